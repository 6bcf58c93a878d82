"""A decode step's paged KV cache (`jaxrl.model.decode.CacheLayout`): the keys and values of every slot in
one pool of fixed-size pages per layer, a page table per slot saying which pages hold its positions, as
vLLM's PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", arXiv:2309.06180). The host side (which pages a slot holds) is
`jaxrl.inference.pages.PageAllocator`; the engine's layout is `jaxrl.inference.paged.PagedLayout`.

The cache is {"k", "v": [L, P, page, K, H], "pages": int32 [B, N]}: page `pages[b, i]` of the pool holds
slot b's positions [i * page, (i + 1) * page). Page 0 is scratch: a table entry of 0 is a page the slot does
not hold (a free slot's, or past its position), written by nobody who reads it and only read where
attention masks it out. Attention here is the gather-based reference: each chunk of positions a step reads
(`Paged.reads` of `chunk_sizes(max_seq_len)`, the chunks that hold the busy slots' positions) is gathered
from the slots' pages into a dense [B, C, K, H] and attended as `decode.Stacked` attends a dense cache's
chunk, so a step reads the pages in use, not `max_seq_len`, with the dense cache's numbers.
Letters as in `jaxrl.model.qwen3`; P pages, N table entries.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp

from jaxrl.model.cpu import chunk_sizes
from jaxrl.model.decode import attend_chunks
from jaxrl.model.qwen3 import KVCache


@dataclasses.dataclass(frozen=True)
class Paged:
    """`CacheLayout` over a page pool with the page table `table_BN` (int32 [B, N], traced) for slots of
    `max_seq_len` positions, `page` positions per page (a divisor of `jaxrl.model.cpu.CACHE_CHUNK`). The
    positions are read in `chunk_sizes(max_seq_len)` chunks as `decode.Stacked` reads a dense cache, of
    which the first `reads` (None: all)."""

    table_BN: jax.Array
    page: int
    max_seq_len: int
    reads: int | None = None
    per_layer = False

    def chunks(self, pool_PCKH: jax.Array) -> list[tuple[int, jax.Array]]:
        """(start, [B, C, K, H]) per chunk read: each slot's pages of the chunk gathered (index: position)."""
        sizes = chunk_sizes(self.max_seq_len)[:self.reads]
        out = []
        for start, c in zip(itertools.accumulate(sizes[:-1], initial=0), sizes, strict=True):
            table = self.table_BN[:, start // self.page:-(-(start + c) // self.page)]
            b, n = table.shape
            out.append((start, pool_PCKH[table].reshape(b, n * self.page, *pool_PCKH.shape[2:])[:, :c]))
        return out

    def attend(self, q_BKGH, k_BKH, v_BKH, positions_B, k_PCKH, v_PCKH) -> jax.Array:
        """`decode.attend_chunks` over the gathered pages: the numbers of `Stacked` over the dense cache, bit
        for bit, for every slot whose positions before its own are in the chunks read."""
        chunks = [(s, k, v) for (s, k), (_, v) in zip(self.chunks(k_PCKH), self.chunks(v_PCKH), strict=True)]
        return attend_chunks(q_BKGH, k_BKH, v_BKH, positions_B, chunks)

    def write(self, cache: KVCache, k_LBKH: jax.Array, v_LBKH: jax.Array, positions_B: jax.Array) -> KVCache:
        """One scatter per pool at (layer, the page that holds each slot's position, offset in it); slots
        whose entry is 0 write the scratch page."""
        rows_B = jnp.arange(positions_B.shape[0])
        page_B = self.table_BN[rows_B, positions_B // self.page]
        off_B = positions_B % self.page
        return {"k": cache["k"].at[:, page_B, off_B].set(k_LBKH),
                "v": cache["v"].at[:, page_B, off_B].set(v_LBKH), "pages": cache["pages"]}


def write_prompt(pool_LPCKH: jax.Array, prompt_LTKH: jax.Array, dest_N: jax.Array, page: int) -> jax.Array:
    """`pool_LPCKH` with a prefill's cache [L, T, K, H] (T padded here to whole pages) written page by page
    to pages `dest_N` (int32 [ceil(T / page)]; 0, the scratch page, where nothing is to be written: a page
    shared with another slot, or past the prompt)."""
    layers, t = prompt_LTKH.shape[:2]
    pad = -t % page
    x = jnp.pad(prompt_LTKH, ((0, 0), (0, pad), (0, 0), (0, 0))).astype(pool_LPCKH.dtype)
    return pool_LPCKH.at[:, dest_N].set(x.reshape(layers, (t + pad) // page, page, *x.shape[2:]))
