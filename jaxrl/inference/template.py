"""A model's chat template: its tokenizer (transformers `AutoTokenizer`, offline), the token ids that end an
assistant turn, and the rendering of chat messages (and tool definitions) to prompt token ids. The HTTP
server's chat and text routes (`jaxrl.inference.chat`, `completions`), the environments' loader
(`jaxrl.envs.loader`) and SFT's data (`jaxrl.run.sft`) all render through it, so a prompt is the same
tokens wherever it is built.

A prompt is refused (`BadRequest`) once it fills the context, found without tokenizing the whole of a long
prompt (`encode_within`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

from jaxrl.inference.wire import BadRequest, is_int


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer with a chat template, and the token ids that end an assistant turn."""

    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    stop_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, folder: str | Path, model_folder: str | Path | None = None) -> ChatTemplate:
        """The tokenizer in `folder` (transformers `AutoTokenizer`, offline); end-of-turn ids from the
        `eos_token_id` of `generation_config.json` in `model_folder` or `folder`, else the tokenizer's.

        Raises:
            ValueError: the folder holds no tokenizer, or a tokenizer without a chat template.
        """
        from transformers import AutoTokenizer  # about 1 s to import: only a server that chats pays it

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a tokenizer from {folder}: {exc}") from None
        if not tokenizer.chat_template:
            raise ValueError(f"the tokenizer in {folder} has no chat template")
        stop: list[int] = []
        for where in (model_folder, folder):
            path = Path(where) / "generation_config.json" if where is not None else None
            if path is not None and path.is_file():
                eos = json.loads(path.read_text()).get("eos_token_id")
                stop = [eos] if is_int(eos) else [t for t in eos or [] if is_int(t)]
                if stop:
                    break
        if not stop and tokenizer.eos_token_id is not None:
            stop = [tokenizer.eos_token_id]
        return cls(tokenizer, tuple(stop))

    def render(self, messages: list[dict], template_kwargs: dict[str, Any], tool_defs: list[dict] | None = None,
               forced: str = "", max_tokens: int | None = None) -> list[int]:
        """Prompt token ids for `messages` (and `tool_defs`, the request's `tools`) with the assistant's turn
        opened and `forced` text appended to it; raises `BadRequest` when the template refuses them (it may
        raise on a role order it does not know), or when the prompt has `max_tokens` tokens or more
        (`encode_within`: found without tokenizing the whole of a long prompt)."""
        reserved = sorted(set(template_kwargs) & _template_parameters(self.tokenizer))
        if reserved:
            raise BadRequest(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tool_defs, tokenize=False,
                                                      add_generation_prompt=True, **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja2 errors and the template's raise_exception alike
            raise BadRequest(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                             param="messages") from None
        return encode_within(self.tokenizer, text + forced, max_tokens)


FIRST_CHARS_PER_TOKEN = 8
"""`encode_within` first tokenizes `FIRST_CHARS_PER_TOKEN` characters per token of the limit (English and
code run at about 4 characters a token), then twice as many at each try."""


def encode_within(tokenizer: Any, text: str, limit: int | None, param: str = "messages") -> list[int]:
    """`tokenizer.encode(text)` (no special tokens added) when it is under `limit` tokens; raises
    `BadRequest` when it is not, having tokenized only a prefix of a long text: the first
    `limit * FIRST_CHARS_PER_TOKEN` characters, cut before a space that follows a non-space (where
    byte-level BPE's pre-tokenizer splits the whole text the same way), doubled until the prefix reaches
    `limit` tokens (the whole text then has at least as many) or is the whole text. A 10 MB prompt to a
    256-token model thus costs the tokenization of about 2,000 characters, not 36 s (Qwen3's tokenizer,
    2 loaded cores). `limit` None: the whole text, unbounded. The refusal's `param` is `param` (the request
    field holding the prompt)."""
    size = len(text) if limit is None else limit * FIRST_CHARS_PER_TOKEN
    while True:
        cut = len(text) if size >= len(text) else _space_cut(text, size)
        ids = tokenizer.encode(text[:cut], add_special_tokens=False)
        if limit is not None and len(ids) >= limit:
            more = "" if cut == len(text) else f"more than {len(ids)} tokens (counted over its first {cut:,} of " \
                                                f"{len(text):,} characters)"
            raise BadRequest(f"the prompt is {more or f'{len(ids)} tokens'}; this model's context is {limit} "
                             "(prompt and completion)", param=param)
        if cut == len(text):
            return ids
        size *= 2


def _space_cut(text: str, size: int) -> int:
    """The last position <= `size` of a whitespace character after a non-whitespace one; `size` if none."""
    for i in range(size, max(size - 4096, 0), -1):
        if text[i].isspace() and not text[i - 1].isspace():
            return i
    return size


def _template_parameters(tokenizer: Any) -> set[str]:
    """`apply_chat_template`'s own parameters: a request's template variables may not set them (one is
    `chat_template`, which would run the client's Jinja)."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
