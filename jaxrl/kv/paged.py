"""The paged KV cache: the keys and values of every slot in one pool of fixed-size pages, a page table per
slot saying which pages hold its positions, as vLLM's PagedAttention (Kwon et al. 2023, "Efficient Memory
Management for Large Language Model Serving with PagedAttention", arXiv:2309.06180). Its memory follows the
tokens in flight, not slots x `max_seq_len`, and a group of rollouts shares its prompt's pages. The host
side (which pages a slot holds) is `jaxrl.kv.pages.PageAllocator`.

The cache is {"k", "v": [K, L, P, page, H], "pages": int32 [B, N]} (`POOL_AXES`): per kv head, per layer,
P pages of `page` positions. It is the layout JAX's Pallas TPU paged-attention kernel reads
(`jaxrl.kv.pallas`): [K, L * P, page, H] is the same buffer, layer i's page p at index i * P + p. Page
`pages[b, n]` holds slot b's positions [n * page, (n + 1) * page) in every layer. Page 0 is scratch: a
table entry of 0 is a page the slot does not hold (a free slot's, or past its position), written by nobody
who reads it and only read where attention masks it out.

The pool holds `kv_cache_tokens` positions (`[jax] kv_cache_tokens`; default slots x `max_seq_len`, the
dense cache's size, so a pool never runs out before the dense cache would) in pages of `PAGE` positions,
plus the scratch page.

`Paged` here is the gather-based reference (CPU and GPU): each chunk of positions a step reads (of
`chunk_sizes(max_seq_len)`, the chunks that hold the busy slots' positions) is gathered from the slots'
pages into a dense [B, C, K, H] (`gather`, the one gather of the pool: prefill extends and page copies read
through it too) and attended as `jaxrl.kv.dense.Dense` attends a dense cache's chunk, so a step reads the
pages in use, not `max_seq_len`, with the dense cache's numbers; this step's keys and values are written
after the last layer (`Paged.write`). Letters as in `jaxrl.model.decoder`; P pages per layer, N table entries.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.kv.chunks import CACHE_CHUNK, attend_chunks, chunk_sizes, chunk_starts, chunks_holding
from jaxrl.kv.kind import MakeBuffer
from jaxrl.kv.pages import PageAllocator
from jaxrl.model.config import ModelConfig
from jaxrl.model.decoder import KVCache

PAGE = 16  # positions per page (vLLM's default block size on GPU)
# the pool's logical axes: its kv heads split over `tensor` and the batch axes, as many as divide them (no
# axis splits it by slot: any slot may hold any page, and slots share pages)
POOL_AXES = ("kv_pool", None, None, None, None)


def pool_shape(kv_heads: int, layers: int, pages: int, page: int, head_dim: int) -> tuple[int, ...]:
    """The shape of one pool (k or v): [K, L, P, page, H]."""
    return (kv_heads, layers, pages, page, head_dim)


def pool_pages(slots: int, max_seq_len: int, kv_cache_tokens: int | None, page: int = PAGE) -> int:
    """Pages of a pool of `kv_cache_tokens` positions (None: `slots` x `max_seq_len`, each slot's positions
    in whole pages), the scratch page included.

    Raises:
        ValueError: a pool that holds fewer than `max_seq_len` positions (one sequence must fit).
    """
    if kv_cache_tokens is None:
        return slots * math.ceil(max_seq_len / page) + 1
    if kv_cache_tokens < max_seq_len:
        raise ValueError(f"[jax] kv_cache_tokens {kv_cache_tokens} holds fewer positions than one sequence "
                         f"([jax] seq_len {max_seq_len})")
    return math.ceil(kv_cache_tokens / page) + 1


def gather(pool_KLPCH: jax.Array, table_BN: jax.Array, layer=None) -> jax.Array:
    """Pages `table_BN` (int32 [B, N]) of the pool [K, L, P, page, H] as positions, one gather: of layer
    `layer` (an int or int32 scalar) [B, N * page, K, H]; of every layer (None) [L, B, N * page, K, H]."""
    k, layers, _, page, h = pool_KLPCH.shape
    b, n = table_BN.shape
    if layer is None:
        return pool_KLPCH[:, :, table_BN].reshape(k, layers, b, n * page, h).transpose(1, 2, 3, 0, 4)
    return pool_KLPCH[:, layer, table_BN].reshape(k, b, n * page, h).transpose(1, 2, 0, 3)


def write_prompt(pool_KLPCH: jax.Array, prompt_LTKH: jax.Array, dest_N: jax.Array, page: int) -> jax.Array:
    """`pool_KLPCH` with a prefill's cache [L, T, K, H] (T padded here to whole pages) written page by page
    to pages `dest_N` of every layer (int32 [ceil(T / page)]; 0, the scratch page, where nothing is to be
    written: a page shared with another slot, or past the prompt)."""
    layers, t, k, h = prompt_LTKH.shape
    pad = -t % page
    x = jnp.pad(prompt_LTKH, ((0, 0), (0, pad), (0, 0), (0, 0))).astype(pool_KLPCH.dtype)
    return pool_KLPCH.at[:, :, dest_N].set(x.reshape(layers, (t + pad) // page, page, k, h).transpose(3, 0, 1, 2, 4))


@dataclasses.dataclass(frozen=True)
class PagePool:
    """What every paged kind shares: `cfg`, `slots` slots of `max_seq_len` positions, in a pool of
    `kv_cache_tokens` positions (None: slots x `max_seq_len`) in pages of `page` positions, and the host's
    allocator of its pages.

    Raises:
        ValueError: a pool too small for one sequence (`pool_pages`).
    """

    cfg: ModelConfig
    slots: int
    max_seq_len: int
    kv_cache_tokens: int | None = None
    page: int = PAGE
    reads_training_weights = True

    def __post_init__(self) -> None:
        pool_pages(self.slots, self.max_seq_len, self.kv_cache_tokens, self.page)

    @property
    def num_pages(self) -> int:
        """Pages of the pool, the scratch page included (`pool_pages`)."""
        return pool_pages(self.slots, self.max_seq_len, self.kv_cache_tokens, self.page)

    def allocator(self) -> PageAllocator:
        return PageAllocator(self.num_pages, self.page, self.slots, self.max_seq_len)


@dataclasses.dataclass(frozen=True)
class Paged(PagePool):
    """The paged `jaxrl.kv.kind.CacheKind` (the gather-based reference) for `cfg`, `slots` slots of
    `max_seq_len` positions, in a pool of `kv_cache_tokens` positions (None: slots x `max_seq_len`) in pages
    of `page` positions (a divisor of `jaxrl.kv.chunks.CACHE_CHUNK`). `reads` (the first chunks of
    `chunk_sizes(max_seq_len)` a step reads; None: all) and `mesh` are set per step by `decode`.

    Raises:
        ValueError: a `page` that does not divide `CACHE_CHUNK`, or a pool too small for one sequence.
    """

    reads: int | None = None
    mesh: Mesh | None = None
    per_layer = False
    indexed = True  # `attend_layer` reads the whole pool at a layer index

    def __post_init__(self) -> None:
        if CACHE_CHUNK % self.page:
            raise ValueError(f"KV pages of {self.page} positions: must divide {CACHE_CHUNK}, the cache's chunk")
        super().__post_init__()

    def cache(self, make: MakeBuffer) -> KVCache:
        """{"k", "v": [K, L, P, page, H], "pages": int32 [B, N]}: the pools as the TPU kernel reads them
        (`POOL_AXES`), the same on every platform."""
        c = self.cfg
        shape = pool_shape(c.num_kv_heads, c.num_layers, self.num_pages, self.page, c.head_dim)
        return {"k": make(shape, POOL_AXES), "v": make(shape, POOL_AXES),
                "pages": make((self.slots, -(-self.max_seq_len // self.page)), (None, None), jnp.int32)}

    def insert(self, cache: KVCache, prefix_cache: KVCache | None, slot: jax.Array,
               pages: jax.Array | None = None) -> KVCache:
        """The prefill's [L, 1, T, K, H] written to `pages` (`PageAllocator.assign`'s, int32 [ceil(T / page)]);
        the slot's table comes with the next decode step. None: nothing to write (the prompt's pages are
        shared, `Engine.prefill_shared`)."""
        if prefix_cache is None:
            return cache
        return {**{n: write_prompt(cache[n], prefix_cache[n][:, 0], pages, self.page) for n in ("k", "v")},
                "pages": cache["pages"]}

    def copy_pages(self, cache: KVCache, src_B: jax.Array, dst_B: jax.Array) -> KVCache:
        """`cache` with pool pages `src_B` copied to `dst_B` (int32 [B] each; 0 to 0 where nothing is copied),
        every layer and head, k and v: copy on write (`PageAllocator.step`)."""
        return {**cache, **{n: cache[n].at[:, :, dst_B].set(cache[n][:, :, src_B]) for n in ("k", "v")}}

    def extend_cache(self, cache: KVCache, read_N: jax.Array) -> KVCache:
        """Pages `read_N` (int32 [N]) of every layer as a prefill's dense cache {"k","v"} [L, 1, N * page, K, H]
        (`gather`), which a prompt's next positions are written into and attend over (`Engine._extend`)."""
        return {n: gather(cache[n], read_N[None]) for n in ("k", "v")}

    def chunks(self, positions: int) -> int | None:
        """The fewest chunks of `chunk_sizes(max_seq_len)` that hold positions [0, `positions`) (as the CPU's
        cache: about log2(max_seq_len / 128) + 1 compiled steps); None when that is all of them."""
        return chunks_holding(chunk_sizes(self.max_seq_len), positions)

    def decode(self, model, layers, tokens_B, positions_B, cache, chunks, mesh: Mesh):
        """The step over the pool, reading the first `chunks` chunks of each slot's positions."""
        step = dataclasses.replace(self, reads=chunks, mesh=mesh)
        return model.decode(tokens_B, positions_B, cache, mesh=mesh, layers=layers, layout=step)

    def read_chunks(self, pool_KLPCH: jax.Array, table_BN: jax.Array, layer) -> list[tuple[int, jax.Array]]:
        """(start, [B, C, K, H]) per chunk read: each slot's pages of the chunk at `layer`, gathered."""
        sizes = chunk_sizes(self.max_seq_len)[:self.reads]
        out = []
        for start, c in zip(chunk_starts(sizes), sizes, strict=True):
            table = table_BN[:, start // self.page:-(-(start + c) // self.page)]
            out.append((start, gather(pool_KLPCH, table, layer)[:, :c]))
        return out

    def attend_layer(self, q_BKGH, k_BKH, v_BKH, positions_B, cache: KVCache, layer) -> tuple[jax.Array, KVCache]:
        """`attend_chunks` over layer `layer`'s gathered pages: the numbers of `Dense` over the dense cache,
        bit for bit, for every slot whose positions before its own are in the chunks read. The cache comes
        back as it came (`write` stores this step's keys after the last layer)."""
        table = cache["pages"]
        chunks = [(s, k, v) for (s, k), (_, v) in zip(self.read_chunks(cache["k"], table, layer),
                                                       self.read_chunks(cache["v"], table, layer), strict=True)]
        return attend_chunks(q_BKGH, k_BKH, v_BKH, positions_B, chunks), cache

    def write(self, cache: KVCache, k_LBKH: jax.Array, v_LBKH: jax.Array, positions_B: jax.Array) -> KVCache:
        """One scatter per pool at (every layer, the page that holds each slot's position, offset in it);
        slots whose entry is 0 write the scratch page."""
        page_B, off_B = self.where(cache["pages"], positions_B)
        return {"k": cache["k"].at[:, :, page_B, off_B].set(k_LBKH.transpose(2, 0, 1, 3)),
                "v": cache["v"].at[:, :, page_B, off_B].set(v_LBKH.transpose(2, 0, 1, 3)), "pages": cache["pages"]}

    def where(self, table_BN: jax.Array, positions_B: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the page that holds each slot's position, the offset in it), int32 [B] each."""
        rows_B = jnp.arange(positions_B.shape[0])
        return table_BN[rows_B, positions_B // self.page], positions_B % self.page
