"""The host side of the engine's paged KV cache (`jaxrl.model.paged`): which pages of the pool each decode
slot holds, a free list and reference counts, as vLLM's block manager (Kwon et al. 2023, arXiv:2309.06180).

Every process of an engine group makes the same calls in the same order (`jaxrl.inference.lockstep`), so
their allocators agree page for page. Page 0 is scratch (never handed out): a table entry of 0 is a page
the slot does not hold.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import numpy as np


class PoolExhausted(RuntimeError):
    """No free page is left for a slot's next position."""


class PageAllocator:
    """Pages of `page` positions for `slots` slots of up to `max_seq_len` positions, from a pool of
    `num_pages` pages (page 0, scratch, included).

    `table` (int32 [slots, ceil(max_seq_len / page)]) is each slot's page table, `dirty` whether it
    changed since the engine last put it on the device. A slot's host position mirrors the engine's
    device one: set at `assign`, advanced by `step`.

    Raises:
        ValueError: a pool of fewer than 2 pages (scratch and one page).
    """

    def __init__(self, num_pages: int, page: int, slots: int, max_seq_len: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a KV page pool of {num_pages} pages: at least 2 (a scratch page and one to use)")
        self.num_pages, self.page, self.max_seq_len = num_pages, page, max_seq_len
        self.table = np.zeros((slots, math.ceil(max_seq_len / page)), np.int32)
        self.refs = np.zeros((num_pages,), np.int32)
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out the lowest page first
        self._positions: dict[int, int] = {}  # slot -> the position its next decode step writes
        # prompt -> (its pages, the last one partial or not; what the engine keeps with it): while held
        self._prompts: dict[Hashable, tuple[list[int], Any]] = {}
        self.dirty = True
        self.prefix_hits = 0  # inserts that reused another slot's prompt pages
        self.shared_pages = 0  # pages those inserts did not write
        self.copies = 0  # pages copied on write (a shared partial page a slot's decode step writes into)

    @property
    def free(self) -> int:
        """Pages that can be handed out."""
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Pages held by some slot (a shared page counts once)."""
        return self.num_pages - 1 - len(self._free)

    def _take(self) -> int:
        if not self._free:
            raise PoolExhausted(f"the KV page pool's {self.num_pages - 1} pages of {self.page} positions are all "
                                "in use; raise [jax] kv_cache_tokens")
        p = self._free.pop()
        self.refs[p] = 1
        return p

    def _drop(self, p: int) -> None:
        self.refs[p] -= 1
        if self.refs[p] == 0:
            self._free.append(p)
            # a later insert must not share a freed page: the prompts it held are forgotten
            for key in [k for k, (pages, _) in self._prompts.items() if p in pages]:
                del self._prompts[key]

    def release(self, slot: int) -> None:
        """Return `slot`'s pages (those shared with another slot stay with it); its entries become 0."""
        for p in self.table[slot][self.table[slot] > 0]:
            self._drop(int(p))
        self.table[slot] = 0
        self._positions.pop(slot, None)
        self.dirty = True

    def held(self, prompt: Hashable) -> Any:
        """What `assign` kept with `prompt` (the engine's logits after it) while some slot holds its pages,
        else None."""
        entry = self._prompts.get(prompt)
        return None if entry is None else entry[1]

    def assign(self, slot: int, length: int, bucket: int, prompt: Hashable | None = None,
               keep: Any = None) -> np.ndarray:
        """Pages for a prompt of `length` positions inserted into `slot` (its old pages released first).
        When some slot holds the pages of the same `prompt` (a key: its token ids), `slot` shares all of
        them, reference counted, the partial last one included, and nothing is written: the first decode
        step that writes into a shared page copies it (`step`, copy on write, as vLLM's block manager).
        Else new pages, kept under `prompt` (None: not shared) with `keep` (returned by `held`).

        Returns:
            int32 [ceil(bucket / page)]: the page each page of the prefill's cache (padded to `bucket`
            positions) is written to, 0 where nothing is written (shared or past the prompt).

        Raises:
            PoolExhausted: too few free pages (the slot then holds none).
        """
        self.release(slot)
        n = math.ceil(length / self.page)
        dest = np.zeros((math.ceil(bucket / self.page),), np.int32)
        if (entry := self._prompts.get(prompt)) is not None:
            pages = entry[0]
            self.refs[pages] += 1
            self.prefix_hits += 1
            self.shared_pages += len(pages)
        else:
            pages = []
            try:
                while len(pages) < n:
                    pages.append(self._take())
            except PoolExhausted:
                for p in pages:
                    self._drop(p)
                raise
            dest[:n] = pages
            if prompt is not None:
                self._prompts[prompt] = (pages, keep)
        self.table[slot, :n] = pages
        self._positions[slot] = length
        self.dirty = True
        return dest

    def needed(self) -> int:
        """Pages the next `step` takes: a new one for each held slot whose position falls past its pages
        or into a page it shares."""
        return sum(int(self.table[slot, pos // self.page] == 0 or self.refs[self.table[slot, pos // self.page]] > 1)
                   for slot, pos in self._positions.items())

    def step(self) -> list[tuple[int, int]]:
        """Before a decode step: give each held slot the page its next position falls in (a new one past
        its pages; a copy of a page it shares with another slot: copy on write), then advance it (as the
        engine, up to `max_seq_len - 1`).

        Returns:
            The copies the engine makes before the step, (from page, to page).

        Raises:
            PoolExhausted: no page is left for some slot's position.
        """
        copies = []
        for slot, pos in self._positions.items():
            i = pos // self.page
            if (p := int(self.table[slot, i])) == 0:
                self.table[slot, i] = self._take()
                self.dirty = True
            elif self.refs[p] > 1:
                self.table[slot, i] = new = self._take()
                self.refs[p] -= 1  # others still hold it
                copies.append((p, new))
                self.copies += 1
                self.dirty = True
            self._positions[slot] = min(pos + 1, self.max_seq_len - 1)
        return copies
