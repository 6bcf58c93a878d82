"""The plain KV cache, what a TPU or GPU engine runs without a page pool: one stacked buffer per k and v,
{"k","v"} [L, B, S, K, H], index s of row b holding slot b's position s (`qwen3.forward`'s cache), the
layers scanned over it. Letters as in `jaxrl.model.qwen3`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.kv.chunks import attend_chunks, chunk_sizes, chunk_starts
from jaxrl.kv.kind import MakeBuffer
from jaxrl.model.qwen3 import KVCache, ModelConfig

AXES = (None, "batch", None, "kv_heads", None)  # the logical axes of [L, B, S, K, H]


@dataclasses.dataclass(frozen=True)
class Dense:
    """The dense `jaxrl.kv.kind.CacheKind` for `cfg`, `slots` slots of `max_seq_len` positions."""

    cfg: ModelConfig
    slots: int
    max_seq_len: int
    reads_training_weights = True
    per_layer = False
    indexed = False

    def allocator(self) -> None:
        return None

    def cache(self, make: MakeBuffer) -> KVCache:
        c = self.cfg
        shape = (c.num_layers, self.slots, self.max_seq_len, c.num_kv_heads, c.head_dim)
        return {"k": make(shape, AXES), "v": make(shape, AXES)}

    def insert(self, cache: KVCache, prefix_cache: KVCache, slot: jax.Array, pages: None = None) -> KVCache:
        return {n: jax.lax.dynamic_update_slice(cache[n], prefix_cache[n], (0, slot, 0, 0, 0)) for n in ("k", "v")}

    def chunks(self, positions: int) -> None:
        return None

    def decode(self, model, layers, tokens_B, positions_B, cache, chunks, mesh: Mesh):
        return model.decode(tokens_B, positions_B, cache, mesh=mesh, layers=layers, layout=self)

    @staticmethod
    def attend(q_BKGH, k_BKH, v_BKH, positions_B, k_BSKH, v_BSKH) -> jax.Array:
        """`attend_chunks` over one layer's [B, S, K, H] as it is, in `chunk_sizes(S)` (`CacheLayout.attend`)."""
        sizes = chunk_sizes(k_BSKH.shape[1])
        chunks = [(s, k_BSKH[:, s:s + c], v_BSKH[:, s:s + c]) for s, c in zip(chunk_starts(sizes), sizes, strict=True)]
        return attend_chunks(q_BKGH, k_BKH, v_BKH, positions_B, chunks)

    @staticmethod
    def write(cache: KVCache, k_LBKH: jax.Array, v_LBKH: jax.Array, positions_B: jax.Array) -> KVCache:
        """One scatter per buffer at (layer, row, position)."""
        rows_B = jnp.arange(positions_B.shape[0])
        return {"k": cache["k"].at[:, rows_B, positions_B].set(k_LBKH),
                "v": cache["v"].at[:, rows_B, positions_B].set(v_LBKH)}
