"""`[jax.sft]`: supervised fine-tuning (`jaxrl sft`), and the chat-format JSONL its data is in.

The data file holds one JSON object per line (blank lines skipped), either
  `{"messages": [{"role": ..., "content": ...}, ...]}`: every assistant message is trained, or
  `{"prompt": P, "completion": C}`: P and C each a string (a user message, an assistant message) or a
  message list; only C's assistant messages are trained, P's are context (prime-rl's and TRL's
  prompt-completion form).
Roles are "system", "user", "assistant" and "tool"; contents are strings. Either form may carry `"tools"`, a list
of OpenAI tool objects that the chat template renders (Qwen3: a `<tools></tools>` system turn), as the
rollout server renders a request's `tools`; a tool call is trained as the assistant text the model would
write (Qwen3: `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`). `jaxrl validate` reads every
line, so a bad one is a config error naming its line before anything loads; tokenizing, the loss mask
and packing are `jaxrl.rl.sft`'s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from jaxrl.config.base import Table, json_object

ROLES = ("system", "user", "assistant", "tool")


def _path(value: str) -> str:
    if not value:
        raise ValueError("an empty path names no file")
    return value


class SftConfig(Table):
    """`[jax.sft]`: present in a config that `jaxrl sft` trains (and `jaxrl run` refuses). Each step is one
    AdamW step (`[jax.optim]`, top-level `learning_rate`, LoRA as `[jax]` sets it) on `batch_size` rows
    of `[jax] seq_len` tokens packed from the data, for `max_steps` steps (or `epochs` passes); the rows
    are drawn epoch after epoch, each epoch in a new seeded order. `[[env]]` is optional here: it is what
    `[eval]` / `[val]` play (docs/sft.md)."""

    data: Annotated[str, AfterValidator(_path)]
    """Chat-format JSONL file (relative to the config file; absolute after loading). Required."""
    batch_size: int = Field(8, ge=1)
    """Packed rows of `[jax] seq_len` tokens per optimizer step (the top-level `batch_size`, rollouts per
    RL step, does not apply). Default 8."""
    seed: int = Field(0, ge=0)
    """Seed of the conversations' packing order and of each epoch's row order. Default 0."""
    epochs: float | None = Field(None, gt=0)
    """Passes over the data, in place of `max_steps` (not with it): the run trains
    `ceil(epochs * rows / batch_size)` steps, the rows counted once the data is packed, and its
    `[jax.optim]` schedule spans them. Default None: `max_steps` steps."""


class DataError(ValueError):
    """A line of the data file that cannot be trained on; str() is `<file> line <n>: <reason>` (`<file>:
    <reason>` for the file as a whole, `line` None)."""

    def __init__(self, path: str | Path, line: int | None, reason: str):
        super().__init__(f"{path}{'' if line is None else f' line {line}'}: {reason}")
        self.line = line


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One line of the data file (`line`, from 1): its messages, how many of its assistant messages
    come before the trained ones (the prompt's, in prompt/completion form; 0 with `messages`), and the
    tools the template renders (None: the line has none)."""

    line: int
    messages: list[dict[str, str]]
    context_replies: int
    tools: list[dict[str, Any]] | None = None


def _messages(value: Any, role: str, what: str) -> list[dict[str, str]]:
    """A prompt or completion as a message list: a string is one message of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a string or a non-empty list of messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            keys = sorted(m) if isinstance(m, dict) else type(m).__name__
            raise ValueError(f"{what}[{i}] must be an object with exactly 'role' and 'content', got {keys}")
        if m["role"] not in ROLES:
            raise ValueError(f"{what}[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"{what}[{i}].content must be a string, got {type(m['content']).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def parse_line(text: str) -> tuple[list[dict[str, str]], int, list[dict[str, Any]] | None]:
    """`(messages, context_replies, tools)` of one JSONL line (see the module docstring).

    Raises:
        ValueError: not JSON, not an object, neither form, a malformed message, or no assistant message
            to train.
    """
    obj = json_object(text)
    tools = obj.pop("tools", None)
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("'tools' must be a list of objects")
    if "messages" in obj:
        if extra := sorted(set(obj) - {"messages"}):
            raise ValueError(f"'messages' line with other keys {extra}")
        messages, context = _messages(obj["messages"], "user", "messages"), []
    elif {"prompt", "completion"} <= set(obj):
        if extra := sorted(set(obj) - {"prompt", "completion"}):
            raise ValueError(f"'prompt'/'completion' line with other keys {extra}")
        context = _messages(obj["prompt"], "user", "prompt")
        messages = context + _messages(obj["completion"], "assistant", "completion")
    else:
        raise ValueError(f"needs 'messages', or 'prompt' and 'completion'; has {sorted(obj)}")
    context_replies = sum(m["role"] == "assistant" for m in context)
    if sum(m["role"] == "assistant" for m in messages) == context_replies:
        raise ValueError("no assistant message to train on")
    return messages, context_replies, tools


def read_jsonl(path: str | Path) -> list[Conversation]:
    """Every conversation of a JSONL file, in file order.

    Raises:
        DataError: the first bad line, with its number (from 1) and why; a file with no conversation, or
            not UTF-8 text.
        OSError: the file cannot be read.
    """
    out: list[Conversation] = []
    n = 0
    try:
        with open(path, encoding="utf-8") as f:
            for n, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    messages, context, tools = parse_line(text)
                except ValueError as exc:
                    raise DataError(path, n, str(exc)) from None
                out.append(Conversation(n, messages, context, tools))
    except UnicodeDecodeError as exc:
        raise DataError(path, n + 1, f"not UTF-8 text: {exc}") from None
    if not out:
        raise DataError(path, None, "no conversation in the file")
    return out
