"""The engine's paged layout (`jaxrl.inference.layout.EngineLayout`): the plain layout's weights and sampling
over a paged KV cache (`jaxrl.model.paged`), whose memory follows the tokens in flight, not slots x
`max_seq_len`, and whose group of rollouts shares its prompt's pages (`jaxrl.inference.pages`).

The pool holds `kv_cache_tokens` positions (`[jax] kv_cache_tokens`; default slots x `max_seq_len`, the
dense cache's size, so a pool never runs out before the dense cache would) in pages of `PAGE` positions,
plus the scratch page. Letters as in `jaxrl.model.qwen3`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp

from jaxrl.inference.engine_params import EngineParams
from jaxrl.inference.pages import PageAllocator
from jaxrl.inference.sampling import sample
from jaxrl.model import attention, cpu, paged, qwen3
from jaxrl.model.qwen3 import KVCache, ModelConfig, Params
from jaxrl.parallel.sharding import mesh_platform

PAGE = 16  # positions per page (vLLM's default block size on GPU)


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


@dataclasses.dataclass
class PagedLayout:
    """`EngineLayout` with a paged cache for `slots` slots of `max_seq_len` positions in a pool of
    `kv_cache_tokens` positions (None: slots x `max_seq_len`). `pages` is the host's allocator."""

    cfg: ModelConfig
    slots: int
    max_seq_len: int
    kv_cache_tokens: int | None = None
    page: int = PAGE
    decode_impl: attention.DecodeImplementation | None = None  # None: `attention.decode_implementation`'s
    reads_training_weights = True

    def __post_init__(self) -> None:
        if cpu.CACHE_CHUNK % self.page:
            raise ValueError(f"KV pages of {self.page} positions: must divide {cpu.CACHE_CHUNK}, the cache's chunk")
        self.chunk_sizes = cpu.chunk_sizes(self.max_seq_len)
        self.num_pages = pool_pages(self.slots, self.max_seq_len, self.kv_cache_tokens, self.page)
        self.pages = PageAllocator(self.num_pages, self.page, self.slots, self.max_seq_len)

    def prepare(self, params: Params) -> EngineParams:
        return EngineParams.of(params)

    def cache(self, make) -> KVCache:
        """{"k", "v": [K, L, P, page, H], "pages": int32 [B, N]}: the pools as the TPU kernel reads them
        (`jaxrl.model.paged`, `POOL_AXES`), the same on every platform."""
        c = self.cfg
        shape = paged.pool_shape(c.num_kv_heads, c.num_layers, self.num_pages, self.page, c.head_dim)
        return {"k": make(shape, paged.POOL_AXES), "v": make(shape, paged.POOL_AXES),
                "pages": make(self.pages.table.shape, (None, None), jnp.int32)}

    def insert(self, cache: KVCache, prefix_cache: KVCache, slot: jax.Array, pages: jax.Array | None = None
               ) -> KVCache:
        """The prefill's [L, 1, T, K, H] written to `pages` (`PageAllocator.assign`'s, int32 [ceil(T / page)]);
        the slot's table comes with the next decode step. None: nothing to write (the prompt's pages are
        shared, `Engine.prefill_shared`)."""
        if prefix_cache is None:
            return cache
        return {**{n: paged.write_prompt(cache[n], prefix_cache[n][:, 0], pages, self.page) for n in ("k", "v")},
                "pages": cache["pages"]}

    def copy_pages(self, cache: KVCache, src_B: jax.Array, dst_B: jax.Array) -> KVCache:
        """`cache` with pool pages `src_B` copied to `dst_B` (int32 [B] each; 0 to 0 where nothing is copied),
        every layer and head, k and v: copy on write (`PageAllocator.step`)."""
        return {**cache, **{n: cache[n].at[:, :, dst_B].set(cache[n][:, :, src_B]) for n in ("k", "v")}}

    def chunks(self, positions: int) -> int | None:
        """None with the Pallas kernel (`decode_impl`; it reads each slot's own length: one compiled step).
        Else the fewest chunks of `chunk_sizes(max_seq_len)` that hold positions [0, `positions`) (as the CPU
        layout's: about log2(max_seq_len / 128) + 1 compiled steps); None when that is all of them."""
        if self.decode_impl == "pallas":
            return None
        held = itertools.accumulate(self.chunk_sizes)
        n = next((n for n, h in enumerate(held, 1) if h >= positions), len(self.chunk_sizes))
        return None if n == len(self.chunk_sizes) else n

    def decode(self, model, params, tokens_B, positions_B, cache, chunks, mesh):
        """The step over the pool: JAX's Pallas kernel where `attention.decode_implementation` picks it for
        `mesh` (TPU; `self.decode_impl` forces one), else the gather-based reference over `chunks`."""
        if self.implementation(mesh) == "pallas":
            layout = paged.PagedKernel(cache["pages"], self.page, self.max_seq_len, mesh=mesh)
        else:
            layout = paged.Paged(cache["pages"], self.page, self.max_seq_len, chunks)
        return model.decode(tokens_B, positions_B, cache, mesh=mesh, layout=layout)

    def implementation(self, mesh) -> attention.DecodeImplementation:
        """`self.decode_impl`, else `attention.decode_implementation` for `mesh`'s platform."""
        return self.decode_impl or attention.decode_implementation(mesh_platform(mesh), self.cfg.head_dim)

    def logits(self, params: EngineParams, hidden_BTD: jax.Array) -> jax.Array:
        return qwen3.logits(params.base, hidden_BTD)

    def sample(self, params, hidden_BD, sampling, keys_B, *, truncate, seen_BV, ban_BV):
        return sample(self.logits(params, hidden_BD[:, None])[:, 0], sampling, keys_B, truncate=truncate,
                      seen_BV=seen_BV, ban_BV=ban_BV)
