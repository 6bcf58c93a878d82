"""Sampled token ids to text, incrementally, as vLLM's incremental detokenizer does: each new token decodes
only a window of recent tokens (prefix and read offsets), so a completion of n tokens costs O(n)
decoding, not O(n^2); a token whose bytes end mid-character is held back until the next one completes
it; and, while stop strings are set, the last `len(longest stop) - 1` characters are held back too, as
they could begin one. The chat and text routes (`jaxrl.inference.chat`) stream through it.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    """Sampled tokens to text, incrementally, cut before the first stop string found once `min_tokens`
    tokens are in (vLLM's rule: a stop string wholly before then is not looked for again).

    `add` decodes only a window of recent tokens (vLLM's prefix/read offsets), so a long completion
    costs O(n) decoding, not O(n^2); a token whose bytes end mid-character waits for the next one.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], skip_special_tokens: bool, min_tokens: int = 0) -> None:
        self._tok, self._stop, self._skip, self._min = tokenizer, stop, skip_special_tokens, min_tokens
        self._hold = max(map(len, stop), default=1) - 1  # chars that might begin a stop string
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string was found; `text` ends before it
        self._prefix = self._read = self._sent = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> None:
        """Append one sampled token (ignored after a stop string)."""
        if self.stopped:
            return
        self.token_ids.append(token_id)
        self._advance(final=False)

    def _advance(self, final: bool) -> None:
        before = self._decode(self.token_ids[self._prefix:self._read])
        now = self._decode(self.token_ids[self._prefix:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self._check(len(self.text), now[len(before):])
            self._prefix, self._read = self._read, len(self.token_ids)

    def _check(self, old_len: int, new: str) -> None:
        self.text += new
        if len(self.token_ids) < self._min:  # vLLM's min_tokens: stop strings count from then on
            return
        start = max(0, old_len - self._hold)
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def finish(self) -> None:
        """Decode what `add` held back (a trailing partial character comes out as U+FFFD)."""
        if not self.stopped:
            self._advance(final=True)

    def take(self, final: bool = False) -> str:
        """The text not taken yet, minus what could still turn out to begin a stop string."""
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._hold)
        out, self._sent = self.text[self._sent:end], end
        return out
