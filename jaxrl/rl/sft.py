"""Supervised fine-tuning data: chat-format JSONL (`jaxrl.config.sft.read_jsonl`: `messages`, or
`prompt` / `completion`) to packed training rows.

Tokens: the whole conversation rendered once with the model's chat template (the tokenizer folder's,
as the rollout server renders chats, `jaxrl.inference.template.ChatTemplate`) and tokenized. The loss mask
is True on each trained assistant message's tokens: everything after its `<|im_start|>assistant\\n` up to
and including its `<|im_end|>` (the model learns to end its turn), found in the token ids (Qwen3's
template is ChatML; the n-th such span is the n-th assistant message). With `enable_thinking` off, a
span's leading empty `<think>\\n\\n</think>\\n\\n` is left out of the loss: the generation prompt that RL
rollouts sample after already holds it, so an SFT'd model is trained on exactly the tokens it will
sample there.

Packing: each conversation of n tokens becomes n - 1 (input, target) pairs (target = the next token;
the mask is the target's), with positions 0..n-2 and its own segment id; conversations are laid one
after the other into rows of `width` pairs, a new row when the next one does not fit (in data order,
after a seeded shuffle), the rest of a row padding (segment 0, no loss). Attention stays within a
segment (`jaxrl.model.attention.mask`), so a packed row trains each conversation exactly as a row
of its own would (tests/test_hf.py checks the logits against transformers). A conversation longer than
`width + 1` tokens is cut to that length (counted in `SftData.truncated`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.config.sft import Conversation, DataError, read_jsonl
from jaxrl.rl.train import Batch, loss_positions

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
EMPTY_THINK = "<think>\n\n</think>\n\n"


def assistant_spans(ids: list[int], start: list[int], end: int) -> list[tuple[int, int]]:
    """`[begin, stop)` token ranges of each assistant message in `ids`: from after each occurrence of the
    token sequence `start` (`<|im_start|>assistant`) and the one token after it (the newline, which a
    message content starting with newlines may extend) through the next `end` (`<|im_end|>`) inclusive,
    or the last token when the message is not closed."""
    spans, i, k = [], 0, len(start)
    while i + k < len(ids):
        if ids[i:i + k] == start:
            begin = i + k + 1
            stop = next((j + 1 for j in range(begin, len(ids)) if ids[j] == end), len(ids))
            spans.append((begin, stop))
            i = stop
        else:
            i += 1
    return spans


@dataclasses.dataclass
class Tokenizer:
    """The chat template and the token ids the assistant mask is found with (`from_tokenizer`)."""

    tokenizer: Any  # transformers.PreTrainedTokenizerBase with a chat template
    enable_thinking: bool | None
    start: list[int]
    end: int
    empty_think: list[int]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, enable_thinking: bool | None) -> Tokenizer:
        """Raises ValueError when the tokenizer has no chat template or no single `<|im_end|>` token."""
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        end = tokenizer.encode(IM_END, add_special_tokens=False)
        if len(end) != 1:
            raise ValueError(f"the tokenizer has no single {IM_END} token (a ChatML template is expected)")
        return cls(tokenizer, enable_thinking, tokenizer.encode(f"{IM_START}assistant", add_special_tokens=False),
                   end[0], tokenizer.encode(EMPTY_THINK, add_special_tokens=False))

    def encode(self, conv: Conversation) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation and its loss mask (the module docstring's rule).

        Raises:
            ValueError: the template refuses the messages, or the rendered text does not hold one
                assistant span per assistant message.
        """
        kwargs = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        try:
            text = self.tokenizer.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja2 errors and the template's raise_exception alike
            raise ValueError(f"the chat template cannot render it: {type(exc).__name__}: {exc}") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        spans = assistant_spans(ids, self.start, self.end)
        replies = sum(m["role"] == "assistant" for m in conv.messages)
        if len(spans) != replies:
            raise ValueError(f"the chat template rendered {len(spans)} assistant turns for {replies} assistant "
                             f"messages")
        mask = [False] * len(ids)
        k = len(self.empty_think)
        for begin, stop in spans[conv.context_replies:]:
            if not self.enable_thinking and ids[begin:begin + k] == self.empty_think:
                begin += k
            mask[begin:stop] = [True] * (stop - begin)
        return ids, mask


@dataclasses.dataclass(frozen=True)
class SftData:
    """Packed rows (numpy, [R, W] each): `inputs`, `targets` int32, `loss_mask` bool (on targets),
    `positions` int32 (from 0 in each conversation), `segment_ids` int32 (1, 2, ... per row; 0 padding).
    `conversations`: conversations packed; `truncated`: those cut to `width + 1` tokens."""

    inputs: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    conversations: int
    truncated: int

    @property
    def rows(self) -> int:
        return self.inputs.shape[0]

    def batch(self, rows: np.ndarray) -> Batch:
        """A train `Batch` of the given row indices: temperature 1, no engine logprobs or advantages, and
        loss positions as wide as the data's fullest row needs (every batch one shape: one compile)."""
        mask = self.loss_mask[rows]
        b, t = mask.shape
        most = int(self.loss_mask.sum(axis=1).max())
        return Batch(self.inputs[rows], self.targets[rows], mask, np.zeros((b, t), np.float32),
                     np.zeros((b,), np.float32), np.ones((b,), np.float32), loss_positions(mask, most),
                     self.positions[rows], self.segment_ids[rows])


def pack(samples: list[tuple[list[int], list[bool]]], width: int) -> SftData:
    """Pack `(token_ids, loss_mask)` samples into rows of `width` (input, target) pairs, in order (see the
    module docstring). Samples with fewer than 2 tokens or no loss token after truncation are dropped.

    Raises:
        ValueError: no sample has a loss token.
    """
    rows: list[list[tuple[list[int], list[bool]]]] = [[]]
    used, truncated, kept = 0, 0, 0
    for ids, mask in samples:
        if len(ids) > width + 1:
            ids, mask, truncated = ids[:width + 1], mask[:width + 1], truncated + 1
        if len(ids) < 2 or not any(mask[1:]):
            continue
        n = len(ids) - 1
        if used + n > width:
            rows.append([])
            used = 0
        rows[-1].append((ids, mask))
        used += n
        kept += 1
    if not kept:
        raise ValueError("no conversation has an assistant token to train on")
    r = len(rows)
    out = {name: np.zeros((r, width), np.int32) for name in ("inputs", "targets", "positions", "segment_ids")}
    loss_mask = np.zeros((r, width), bool)
    for i, row in enumerate(rows):
        at = 0
        for seg, (ids, mask) in enumerate(row, start=1):
            n = len(ids) - 1
            out["inputs"][i, at:at + n] = ids[:-1]
            out["targets"][i, at:at + n] = ids[1:]
            out["positions"][i, at:at + n] = np.arange(n)
            out["segment_ids"][i, at:at + n] = seg
            loss_mask[i, at:at + n] = mask[1:]
            at += n
    return SftData(out["inputs"], out["targets"], loss_mask, out["positions"], out["segment_ids"], kept, truncated)


def load(path: str | Path, tokenizer: Tokenizer, width: int, seed: int) -> SftData:
    """Read, tokenize, shuffle (seeded, so rows differ from file order but not between runs) and pack a
    JSONL file into rows of `width`.

    Raises:
        DataError: a line that cannot be parsed or rendered, named with its number.
        ValueError: no conversation with a token to train.
        OSError: the file cannot be read.
    """
    samples = []
    for conv in read_jsonl(path):
        try:
            samples.append(tokenizer.encode(conv))
        except ValueError as exc:
            raise DataError(path, conv.line, str(exc)) from None
    order = np.random.default_rng(seed).permutation(len(samples))
    return pack([samples[i] for i in order], width)


def step_rows(step: int, batch_size: int, rows: int, seed: int) -> np.ndarray:
    """Row indices of optimizer step `step` (from 0): the rows taken `batch_size` at a time from epoch
    after epoch, each epoch a permutation of all rows seeded by `(seed, epoch)`, so a resumed run takes
    the same rows from its step on. int64 [batch_size]."""
    first = step * batch_size
    epochs = range(first // rows, (first + batch_size - 1) // rows + 1)
    order = np.concatenate([np.random.default_rng((seed, e)).permutation(rows) for e in epochs])
    start = first - epochs[0] * rows
    return order[start:start + batch_size]


def epoch_steps(epochs: float, rows: int, batch_size: int) -> int:
    """Optimizer steps of `epochs` passes over `rows` rows taken `batch_size` at a time: the ceiling of
    `epochs * rows / batch_size`, at least 1."""
    return max(1, math.ceil(epochs * rows / batch_size - 1e-9))
