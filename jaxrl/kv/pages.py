"""The host side of the engine's paged KV cache (`jaxrl.kv.paged`): which pages of the pool each decode
slot holds, a free list and reference counts, as vLLM's block manager (Kwon et al. 2023, arXiv:2309.06180).

Every process of an engine group makes the same calls in the same order (`jaxrl.inference.lockstep`), so
their allocators agree page for page. Page 0 is scratch (never handed out): a table entry of 0 is a page
the slot does not hold.

A finished sequence's pages may be kept (`retire`, then `remember` with the tokens whose keys and values
they hold), so that a later prompt extending those tokens (a multi-turn conversation's next turn: the last
prompt, its completion, the environment's reply) shares them (`match`) and prefills only what follows
(`Engine.prefill_shared`), as vLLM's automatic prefix caching. Kept pages are evicted, least recently used
sequence first, when a page is needed and none is free; they count as free for admission (`free`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from typing import Any

import numpy as np


class PoolExhausted(RuntimeError):
    """No free page is left for a slot's next position."""


@dataclasses.dataclass
class _Kept:
    """A finished sequence's pages: `tokens` (int32 [n]; None until `remember`) whose keys and values
    `pages` (ceil(n / page)) hold, and when it was last used (the allocator's clock, for LRU eviction)."""

    pages: list[int]
    used: int
    tokens: np.ndarray | None = None


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
        self.prefix_hits = 0  # inserts that reused another slot's prompt pages or a kept sequence's
        self.shared_pages = 0  # pages those inserts did not write
        self.prefix_tokens = 0  # prompt positions those inserts did not prefill
        self.copies = 0  # pages copied on write (a shared partial page a slot's decode step writes into)
        self.evictions = 0  # kept sequences dropped for a page
        self._kept: dict[int, _Kept] = {}  # finished sequences' pages, by the caller's handle
        self._kept_refs = np.zeros((num_pages,), np.int32)  # the references to each page `_kept` holds
        self._clock = 0
        self._pinned: dict[Hashable, tuple[list[int], int]] = {}  # prompt -> (pages `match` read, positions)
        self._heads: dict[bytes, set[int]] = {}  # a first page's tokens -> the kept sequences that start so

    @property
    def free(self) -> int:
        """Pages that can be handed out: free ones and those only kept sequences hold (evicted on demand)."""
        if not self._kept:
            return len(self._free)
        return len(self._free) + int(np.sum((self.refs > 0) & (self.refs == self._kept_refs)))

    @property
    def in_use(self) -> int:
        """Pages held by some slot (a shared page counts once; pages only kept sequences hold are not)."""
        return self.num_pages - 1 - self.free

    @property
    def kept(self) -> int:
        """Pages held by kept sequences (some may be shared with slots)."""
        return int(np.sum(self._kept_refs > 0))

    def _take(self) -> int:
        while not self._free and self._kept:  # the least recently used kept sequence goes
            self._forget(min(self._kept, key=lambda h: self._kept[h].used))
            self.evictions += 1
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

    def retire(self, slot: int, handle: int) -> None:
        """Keep `slot`'s pages under `handle` (a number unique to the sequence) instead of returning them;
        the slot holds none after. Not shared until `remember` says what they hold."""
        pages = [int(p) for p in self.table[slot][self.table[slot] > 0]]
        self._forget(handle)
        self._clock += 1
        self._kept[handle] = _Kept(pages, self._clock)
        self._kept_refs[pages] += 1
        self.table[slot] = 0
        self._positions.pop(slot, None)
        self.dirty = True

    def remember(self, handle: int, tokens: list[int]) -> None:
        """The retired sequence `handle` holds the keys and values of `tokens` (positions 0 .. len - 1):
        its pages past them are returned, the rest may be shared (`match`); no tokens, or under a page: all
        returned. A kept sequence whose tokens are a prefix of these is dropped (this one holds its positions). Nothing
        when it was evicted."""
        if (kept := self._kept.get(handle)) is None:
            return
        if not tokens:
            self._forget(handle)
            return
        n = min(len(tokens), len(kept.pages) * self.page)
        keep = math.ceil(n / self.page)
        for p in kept.pages[keep:]:
            self._kept_refs[p] -= 1
            self._drop(p)
        kept.pages, kept.tokens = kept.pages[:keep], np.asarray(tokens[:n], np.int32)
        if n < self.page:  # never shared (`match` wants a page at least)
            self._forget(handle)
            return
        head = kept.tokens[:self.page].tobytes()
        for other in list(self._heads.get(head, ())):  # a kept sequence this one extends: its pages are not needed
            if other != handle and len(t := self._kept[other].tokens) <= n and np.array_equal(t, kept.tokens[:len(t)]):
                self._forget(other)
        self._heads.setdefault(head, set()).add(handle)

    def _forget(self, handle: int) -> None:
        if (kept := self._kept.pop(handle, None)) is not None:
            if kept.tokens is not None and len(kept.tokens) >= self.page:
                heads = self._heads[head := kept.tokens[:self.page].tobytes()]
                heads.discard(handle)
                if not heads:
                    del self._heads[head]
            for p in kept.pages:
                self._kept_refs[p] -= 1
                self._drop(p)

    def forget_all(self) -> None:
        """Share nothing computed so far (new weights: those keys and values are the old policy's): kept
        sequences are dropped and running slots' prompts are no longer shared (`held`)."""
        for handle in list(self._kept):
            self._forget(handle)
        self._prompts.clear()

    def match(self, prompt: tuple[int, ...]) -> int:
        """The most positions of `prompt` whose keys and values a kept sequence holds (its tokens a prefix
        of `prompt`'s, up to len(prompt) - 1: the last token must run for its logits), 0 under one page;
        only the kept sequences that start with `prompt`'s first page are compared (`_heads`).
        Their pages are held for `prompt`'s `assign` (`pinned`) until then or `unpin`."""
        if not self._kept or prompt in self._pinned:
            return self._pinned.get(prompt, ((), 0))[1]
        ids = np.asarray(prompt, np.int32)
        best, best_m = None, 0
        for kept in (self._kept[h] for h in self._heads.get(ids[:self.page].tobytes(), ())):
            n = min(len(kept.tokens), len(ids) - 1)
            differ = np.flatnonzero(kept.tokens[:n] != ids[:n])
            if (m := int(differ[0]) if differ.size else n) > best_m:
                best, best_m = kept, m
        if best is None or best_m < self.page:
            return 0
        self._clock += 1
        best.used = self._clock
        pages = best.pages[:math.ceil(best_m / self.page)]
        self.refs[pages] += 1
        self._pinned[prompt] = (pages, best_m)
        return best_m

    def pinned(self, prompt: tuple[int, ...]) -> list[int]:
        """The pages `match` holds for `prompt` (positions 0 .. its count, the last page maybe partial)."""
        return self._pinned[prompt][0]

    def unpin(self) -> None:
        """Let go of the pages `match` held for prompts that were not assigned."""
        for pages, _ in self._pinned.values():
            for p in pages:
                self._drop(p)
        self._pinned.clear()

    def release(self, slot: int) -> None:
        """Return `slot`'s pages (those shared with another slot stay with it); its entries become 0."""
        for p in self.table[slot][self.table[slot] > 0]:
            self._drop(int(p))
        self.table[slot] = 0
        self._positions.pop(slot, None)
        self.dirty = True

    def held(self, prompt: Hashable) -> Any:
        """What `assign` kept with `prompt` (the engine's logits after it) while some slot or kept sequence
        holds its pages (until `forget_all`), else None."""
        entry = self._prompts.get(prompt)
        return None if entry is None else entry[1]

    def assign(self, slot: int, length: int, bucket: int, prompt: Hashable | None = None,
               keep: Any = None) -> np.ndarray:
        """Pages for a prompt of `length` positions inserted into `slot` (its old pages released first).
        When some slot holds the pages of the same `prompt` (a key: its token ids), `slot` shares all of
        them, reference counted, the partial last one included, and nothing is written: the first decode
        step that writes into a shared page copies it (`step`, copy on write, as vLLM's block manager).
        Else new pages, kept under `prompt` (None: not shared) with `keep` (returned by `held`); where
        `match` pinned a kept sequence's pages for `prompt`, its whole pages are shared and the rest new
        (the partial one among them: written whole from the prefill, which read it: copy on write).

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
            self._hit(len(pages), length)
        else:
            read, m = self._pinned.pop(prompt, ([], 0)) if prompt is not None else ([], 0)
            shared = read[:m // self.page]
            try:
                pages = self._grow(list(shared), n)
            finally:
                for p in read[len(shared):]:  # the partial page, read by the prefill: let go
                    self._drop(p)
            dest[len(shared):n] = pages[len(shared):]
            if shared:
                self._hit(len(shared), m)
            if prompt is not None:
                self._prompts[prompt] = (pages, keep)
        self.table[slot, :n] = pages
        self._positions[slot] = length
        self.dirty = True
        return dest

    def assign_prefix(self, slot: int, length: int, prefix: tuple[int, ...],
                      prompt: tuple[int, ...] | None = None) -> int:
        """Pages for a prompt of `length` positions that `slot` feeds itself (chunked prefill,
        `jaxrl.inference.chunked`; its old pages released first), whose first tokens are `prefix`, whole
        pages of them (len(prefix) a multiple of `page`, below `length`). When some slot holds pages under
        `prefix`, `slot` shares them, reference counted (nothing past them is shared: the rest, the partial
        last page among it, is new), else all are new and the whole pages of `prefix` kept under it, until
        no slot holds them or `forget_all`. Where `match` pinned a kept sequence's pages for `prompt` (its
        token ids: a conversation's next turn), the whole ones are shared instead (the partial one let go:
        its positions are fed again) and nothing is kept under `prefix`.

        Returns:
            The positions shared: len(prefix), the kept whole pages' positions, or 0 (none held).

        Raises:
            PoolExhausted: too few free pages (the slot then holds none).
        """
        self.release(slot)
        read, m = self._pinned.pop(prompt, ([], 0)) if prompt is not None else ([], 0)
        if read:  # `match` counted its references
            shared = read[:m // self.page]
            for p in read[len(shared):]:
                self._drop(p)
        else:
            shared = self._prompts.get(prefix)[0] if prefix and prefix in self._prompts else []
            self.refs[shared] += 1
        pages = self._grow(list(shared), math.ceil(length / self.page))
        if shared:
            self._hit(len(shared), len(shared) * self.page)
        elif prefix:
            self._prompts[prefix] = (pages[:len(prefix) // self.page], None)
        self.table[slot, :len(pages)] = pages
        self._positions[slot] = length
        self.dirty = True
        return len(shared) * self.page

    def _grow(self, pages: list[int], n: int) -> list[int]:
        """`pages` (held references) with new pages appended up to `n`.

        Raises:
            PoolExhausted: too few free pages; every page of `pages` is dropped first (references given back).
        """
        try:
            while len(pages) < n:
                pages.append(self._take())
        except PoolExhausted:
            for p in pages:
                self._drop(p)
            raise
        return pages

    def _hit(self, pages: int, tokens: int) -> None:
        """Count a prompt that shares `pages` held pages, `tokens` positions of them (the prefix counters)."""
        self.prefix_hits += 1
        self.shared_pages += pages
        self.prefix_tokens += tokens

    def _ahead(self, ahead_B: np.ndarray | None) -> list[tuple[int, int, range]]:
        """(slot, its position after its next `ahead_B[slot]` positions (None: one), the page indices they
        fall in) for each held slot (positions clipped to `max_seq_len - 1`, as the engine's)."""
        out = []
        for slot, pos in self._positions.items():
            n = 1 if ahead_B is None else int(ahead_B[slot])
            last = min(pos + n - 1, self.max_seq_len - 1)
            pages = range(pos // self.page, last // self.page + 1) if n > 0 else range(0)
            out.append((slot, min(pos + n, self.max_seq_len - 1), pages))
        return out

    def needed(self, ahead_B: np.ndarray | None = None) -> int:
        """Pages the next `step(ahead_B)` takes: a new one for each page a held slot's next positions fall
        in past its pages or into a page it shares."""
        return sum(int(self.table[slot, i] == 0 or self.refs[self.table[slot, i]] > 1)
                   for slot, _, pages in self._ahead(ahead_B) for i in pages)

    def step(self, ahead_B: np.ndarray | None = None) -> list[tuple[int, int]]:
        """Before a dispatch of decode steps: give each held slot the pages its next `ahead_B[slot]` positions
        fall in (int [slots]; None: one position each, one step; `Engine.generate_steps`): a new one past its
        pages, a copy of a page it shares with another slot (copy on write), then advance it by as many (as
        the engine, up to `max_seq_len - 1`; a slot that stops sooner on the device is released before it
        matters).

        Returns:
            The copies the engine makes before the steps, (from page, to page): at most one a slot (only
            a prompt's partial last page is shared and written).

        Raises:
            PoolExhausted: no page is left for some slot's position.
        """
        copies = []
        for slot, after, pages in self._ahead(ahead_B):
            for i in pages:
                if (p := int(self.table[slot, i])) == 0:
                    self.table[slot, i] = self._take()
                    self.dirty = True
                elif self.refs[p] > 1:
                    self.table[slot, i] = new = self._take()
                    self.refs[p] -= 1  # others still hold it
                    copies.append((p, new))
                    self.copies += 1
                    self.dirty = True
            self._positions[slot] = after
        return copies
