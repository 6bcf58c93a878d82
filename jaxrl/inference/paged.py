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

from jaxrl.inference.pages import PageAllocator
from jaxrl.inference.sampling import sample
from jaxrl.model import cpu, paged, qwen3
from jaxrl.model.qwen3 import KVCache, ModelConfig, Params

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
    reads_training_weights = True

    def __post_init__(self) -> None:
        if cpu.CACHE_CHUNK % self.page:
            raise ValueError(f"KV pages of {self.page} positions: must divide {cpu.CACHE_CHUNK}, the cache's chunk")
        self.chunk_sizes = cpu.chunk_sizes(self.max_seq_len)
        self.num_pages = pool_pages(self.slots, self.max_seq_len, self.kv_cache_tokens, self.page)
        self.pages = PageAllocator(self.num_pages, self.page, self.slots, self.max_seq_len)

    def prepare(self, params: Params) -> Params:
        return {"base": params["base"], "lora": params.get("lora")}

    def cache(self, make) -> KVCache:
        """{"k", "v": [L, P, page, K, H], "pages": int32 [B, N]} (`jaxrl.model.paged`)."""
        c = self.cfg
        shape = (c.num_layers, self.num_pages, self.page, c.num_kv_heads, c.head_dim)
        axes = (None, None, None, "kv_heads", None)
        return {"k": make(shape, axes), "v": make(shape, axes),
                "pages": make(self.pages.table.shape, (None, None), jnp.int32)}

    def insert(self, cache: KVCache, prefix_cache: KVCache, slot: jax.Array, pages: jax.Array | None = None
               ) -> KVCache:
        """The prefill's [L, 1, T, K, H] written to `pages` (`PageAllocator.assign`'s, int32 [ceil(T / page)]);
        the slot's table comes with the next decode step."""
        return {**{n: paged.write_prompt(cache[n], prefix_cache[n][:, 0], pages, self.page) for n in ("k", "v")},
                "pages": cache["pages"]}

    def chunks(self, positions: int) -> int | None:
        """The fewest chunks of `chunk_sizes(max_seq_len)` that hold positions [0, `positions`) (as the CPU
        layout's: about log2(max_seq_len / 128) + 1 compiled steps); None when that is all of them."""
        held = itertools.accumulate(self.chunk_sizes)
        n = next((n for n, h in enumerate(held, 1) if h >= positions), len(self.chunk_sizes))
        return None if n == len(self.chunk_sizes) else n

    def decode(self, model, params, tokens_B, positions_B, cache, chunks, mesh):
        return model.decode(tokens_B, positions_B, cache, mesh=mesh,
                            layout=paged.Paged(cache["pages"], self.page, self.max_seq_len, chunks))

    def logits(self, params: Params, hidden_BTD: jax.Array) -> jax.Array:
        return qwen3.logits(params["base"], hidden_BTD)

    def sample(self, params, hidden_BD, sampling, keys_B, *, truncate, seen_BV, ban_BV):
        return sample(self.logits(params, hidden_BD[:, None])[:, 0], sampling, keys_B, truncate=truncate,
                      seen_BV=seen_BV, ban_BV=ban_BV)
