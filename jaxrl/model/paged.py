"""A decode step's paged KV cache (`jaxrl.model.decode.CacheLayout`): the keys and values of every slot in
one pool of fixed-size pages, a page table per slot saying which pages hold its positions, as vLLM's
PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", arXiv:2309.06180). The host side (which pages a slot holds) is
`jaxrl.inference.pages.PageAllocator`; the engine's layout is `jaxrl.inference.paged.PagedLayout`.

The cache is {"k", "v": [K, L, P, page, H], "pages": int32 [B, N]} (`POOL_AXES`), declared once by
`PagedLayout.cache`: per kv head, per layer, P pages of `page` positions. It is the layout JAX's Pallas
TPU paged-attention kernel reads (`jax.experimental.pallas.ops.tpu.paged_attention`: pages [K, pages,
page, H]): [K, L * P, page, H] is the same buffer (a reshape of leading axes, no copy), layer i's page p
at index i * P + p, so the kernel reads one layer's pages out of the whole pool without slicing it.
Page `pages[b, n]` holds slot b's positions [n * page, (n + 1) * page) in every layer. Page 0 is scratch:
a table entry of 0 is a page the slot does not hold (a free slot's, or past its position), written by
nobody who reads it and only read where attention masks it out.

Two ways to attend over it, picked by `jaxrl.model.attention.decode_implementation` from the mesh's
platform:
  * `Paged`, the gather-based reference (CPU and GPU): each chunk of positions a step reads (`Paged.reads`
    of `chunk_sizes(max_seq_len)`, the chunks that hold the busy slots' positions) is gathered from the
    slots' pages into a dense [B, C, K, H] and attended as `decode.Stacked` attends a dense cache's chunk,
    so a step reads the pages in use, not `max_seq_len`, with the dense cache's numbers; this step's keys
    and values are written after the last layer (`Paged.write`).
  * `PagedKernel` (TPU): the Pallas kernel, which reads each slot's pages up to its length straight from
    HBM. It attends over the cache alone (it returns no log-sum-exp to merge this step's key into), so
    each layer writes this step's key/value into its pages first and the kernel reads positions 0 ..
    position; the pool is then the layer loop's carry (written in place), not a per-layer slice.
Letters as in `jaxrl.model.qwen3`; P pages per layer, N table entries.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
from jax.sharding import Mesh, PartitionSpec

from jaxrl.model.cpu import chunk_sizes
from jaxrl.model.decode import CacheLayout, attend_chunks
from jaxrl.model.qwen3 import KVCache
from jaxrl.parallel.sharding import RULES, logical_spec

# the pool's logical axes: its kv heads split over `tensor` and the batch axes, as many as divide them (no
# axis splits it by slot: any slot may hold any page, and slots share pages)
POOL_AXES = ("kv_pool", None, None, None, None)
KERNEL_BLOCK = 128  # positions the kernel reads per compute block (pages_per_compute_block x page)


def pool_shape(kv_heads: int, layers: int, pages: int, page: int, head_dim: int) -> tuple[int, ...]:
    """The shape of one pool (k or v): [K, L, P, page, H]."""
    return (kv_heads, layers, pages, page, head_dim)


def _gather(pool_KLPCH: jax.Array, layer, table_BN: jax.Array) -> jax.Array:
    """Layer `layer`'s pages `table_BN` of the pool, as positions: [B, N * page, K, H] (one gather)."""
    k, _, _, page, h = pool_KLPCH.shape
    b, n = table_BN.shape
    return pool_KLPCH[:, layer, table_BN].reshape(k, b, n * page, h).transpose(1, 2, 0, 3)


@dataclasses.dataclass(frozen=True)
class Paged(CacheLayout):
    """The gather-based `CacheLayout` over a page pool with the page table `table_BN` (int32 [B, N], traced)
    for slots of `max_seq_len` positions, `page` positions per page (a divisor of
    `jaxrl.model.cpu.CACHE_CHUNK`). The positions are read in `chunk_sizes(max_seq_len)` chunks as
    `decode.Stacked` reads a dense cache, of which the first `reads` (None: all)."""

    table_BN: jax.Array
    page: int
    max_seq_len: int
    reads: int | None = None
    per_layer = False
    indexed = True  # `attend_layer` reads the whole pool at a layer index

    def chunks(self, pool_KLPCH: jax.Array, layer) -> list[tuple[int, jax.Array]]:
        """(start, [B, C, K, H]) per chunk read: each slot's pages of the chunk at `layer`, gathered."""
        sizes = chunk_sizes(self.max_seq_len)[:self.reads]
        out = []
        for start, c in zip(itertools.accumulate(sizes[:-1], initial=0), sizes, strict=True):
            table = self.table_BN[:, start // self.page:-(-(start + c) // self.page)]
            out.append((start, _gather(pool_KLPCH, layer, table)[:, :c]))
        return out

    def attend_layer(self, q_BKGH, k_BKH, v_BKH, positions_B, cache: KVCache, layer) -> tuple[jax.Array, KVCache]:
        """`decode.attend_chunks` over layer `layer`'s gathered pages: the numbers of `Stacked` over the
        dense cache, bit for bit, for every slot whose positions before its own are in the chunks read.
        The cache comes back as it came (`write` stores this step's keys after the last layer)."""
        chunks = [(s, k, v) for (s, k), (_, v) in zip(self.chunks(cache["k"], layer), self.chunks(cache["v"], layer),
                                                       strict=True)]
        return attend_chunks(q_BKGH, k_BKH, v_BKH, positions_B, chunks), cache

    def write(self, cache: KVCache, k_LBKH: jax.Array, v_LBKH: jax.Array, positions_B: jax.Array) -> KVCache:
        """One scatter per pool at (every layer, the page that holds each slot's position, offset in it);
        slots whose entry is 0 write the scratch page."""
        page_B, off_B = self._where(positions_B)
        return {"k": cache["k"].at[:, :, page_B, off_B].set(k_LBKH.transpose(2, 0, 1, 3)),
                "v": cache["v"].at[:, :, page_B, off_B].set(v_LBKH.transpose(2, 0, 1, 3)), "pages": cache["pages"]}

    def _where(self, positions_B: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the page that holds each slot's position, the offset in it), int32 [B] each."""
        rows_B = jnp.arange(positions_B.shape[0])
        return self.table_BN[rows_B, positions_B // self.page], positions_B % self.page


@dataclasses.dataclass(frozen=True)
class PagedKernel(Paged):
    """The TPU `CacheLayout` over the same pool: JAX's Pallas paged-attention kernel. Each layer first writes
    this step's key/value into its page (so the kernel sees positions 0 .. position of each slot), then runs
    the kernel inside `shard_map` on `mesh` (`kernel_attention`: heads split as the pool is; the pool is never
    split by slot, so slots share pages). On a CPU mesh it runs in Pallas interpret
    mode (tests). The kernel reads pages in bfloat16 (it casts what it loads), so a float32 pool attends at
    bfloat16 precision. `reads` is not used: the kernel reads each slot's own length."""

    mesh: Mesh | None = None

    def attend_layer(self, q_BKGH, k_BKH, v_BKH, positions_B, cache: KVCache, layer) -> tuple[jax.Array, KVCache]:
        # one row of H per (head, slot), every index given: a write whose window spans the heads ([K, H]
        # per slot) made TPU's layout assignment keep the pool K-minor ({4,0,3,2,1}) in the layer loop and
        # copy it to the kernel's layout at every layer (Qwen3-4B on 4 chips, 2 heads a chip: decode
        # temporaries 1.01 GiB at 2 layers, the whole pool; 0.02 GiB so). A chip holding one head was spared.
        page_B, off_B = self._where(positions_B)
        heads_K1 = jnp.arange(k_BKH.shape[1])[:, None]
        pools = {n: cache[n].at[heads_K1, layer, page_B, off_B].set(x.transpose(1, 0, 2))
                 for n, x in (("k", k_BKH), ("v", v_BKH))}
        b, k, g, h = q_BKGH.shape
        out_BNH = kernel_attention(q_BKGH.reshape(b, k * g, h), pools["k"], pools["v"], positions_B + 1,
                                   self.table_BN, layer, self.mesh)
        return out_BNH.reshape(b, k, g, h), {**cache, **pools}

    def write(self, cache: KVCache, k_LBKH, v_LBKH, positions_B) -> KVCache:
        """Nothing: every layer wrote its own (`attend_layer`)."""
        return cache


def _kernel_local(q_BNH, k_KLPCH, v_KLPCH, lengths_B, table_BN, layer, *, interpret: bool) -> jax.Array:
    """The kernel over the arrays one chip holds: the pool seen as [K, L * P, page, H], layer `layer`'s pages
    by index, the table padded with scratch entries to whole compute blocks."""
    k, layers, p, page, h = k_KLPCH.shape
    block = max(1, KERNEL_BLOCK // page)
    n = table_BN.shape[1]
    table_BN = jnp.pad(table_BN, ((0, 0), (0, -n % block))) + layer * p
    run = functools.partial(paged_attention, pages_per_compute_block=block)
    args = (q_BNH, k_KLPCH.reshape(k, layers * p, page, h), v_KLPCH.reshape(k, layers * p, page, h),
            lengths_B.astype(jnp.int32), table_BN)
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            return run(*args)
    return run(*args)


def kernel_attention(q_BNH: jax.Array, k_KLPCH: jax.Array, v_KLPCH: jax.Array, lengths_B: jax.Array,
                     table_BN: jax.Array, layer, mesh: Mesh | None) -> jax.Array:
    """Attention of each slot's query (q [B, N, H], pre-scaled: the kernel has no scale) over positions
    0 .. `lengths_B` - 1 of its pages `table_BN` at layer `layer` (int32 scalar) of the pools [K, L, P,
    page, H]: [B, N, H] in q's dtype. On `mesh` (None: one device) inside `shard_map`: the kv and query
    heads split as the pool is (`POOL_AXES`: `tensor`, then the batch axes, as many as divide K), each chip
    attending every slot over its heads, except over the batch axes the heads leave free, which split the
    slots (where they divide B). Interpret mode on a CPU mesh."""
    platform = "cpu" if mesh is None else mesh.devices.flat[0].platform
    local = functools.partial(_kernel_local, interpret=platform == "cpu")
    layer = jnp.asarray(layer, jnp.int32)
    if mesh is None or mesh.size == 1:
        return local(q_BNH, k_KLPCH, v_KLPCH, lengths_B, table_BN, layer)
    pool_spec = logical_spec(POOL_AXES, k_KLPCH.shape, mesh, RULES)
    heads = pool_spec[0]
    used = set(heads if isinstance(heads, tuple) else (heads,))
    free = tuple(a for a in RULES["batch"] if a not in used and mesh.shape[a] > 1)
    b = q_BNH.shape[0]
    batch = (free if len(free) > 1 else free[0]) if free and b % math.prod(mesh.shape[a] for a in free) == 0 \
        else None
    q_spec = PartitionSpec(batch, heads, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, pool_spec, pool_spec, PartitionSpec(batch),
                                                     PartitionSpec(batch, None), PartitionSpec()),
                         out_specs=q_spec, check_vma=False)(q_BNH, k_KLPCH, v_KLPCH, lengths_B, table_BN, layer)


def write_prompt(pool_KLPCH: jax.Array, prompt_LTKH: jax.Array, dest_N: jax.Array, page: int) -> jax.Array:
    """`pool_KLPCH` with a prefill's cache [L, T, K, H] (T padded here to whole pages) written page by page
    to pages `dest_N` of every layer (int32 [ceil(T / page)]; 0, the scratch page, where nothing is to be
    written: a page shared with another slot, or past the prompt)."""
    layers, t, k, h = prompt_LTKH.shape
    pad = -t % page
    x = jnp.pad(prompt_LTKH, ((0, 0), (0, pad), (0, 0), (0, 0))).astype(pool_KLPCH.dtype)
    return pool_KLPCH.at[:, :, dest_N].set(x.reshape(layers, (t + pad) // page, page, k, h).transpose(3, 0, 1, 2, 4))
