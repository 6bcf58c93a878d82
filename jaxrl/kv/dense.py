"""The plain KV cache, what a TPU or GPU engine runs when given it (`Engine(kv=Dense(...))`; the picker gives
an accelerator the paged pool): one stacked buffer per k and v, {"k","v"} [L, B, S, K, H], index s of row b
holding slot b's position s (`decoder.forward`'s cache), the layers scanned with the cache as their carry,
read in place at each layer's index. Letters as in `jaxrl.model.decoder`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.kv.chunks import attend_chunks, chunk_sizes, chunk_starts, chunks_holding
from jaxrl.kv.kind import MakeBuffer
from jaxrl.model.config import ModelConfig
from jaxrl.model.decoder import KVCache

AXES = (None, "batch", None, "kv_heads", None)  # the logical axes of [L, B, S, K, H]


@dataclasses.dataclass(frozen=True)
class Dense:
    """The dense `jaxrl.kv.kind.CacheKind` for `cfg`, `slots` slots of `max_seq_len` positions; `reads` (the
    first chunks of `chunk_sizes(max_seq_len)` a step reads; None: all) is set per step by `decode`."""

    cfg: ModelConfig
    slots: int
    max_seq_len: int
    reads: int | None = None
    reads_training_weights = True
    per_layer = False
    indexed = True  # `attend_layer` reads each chunk of the stacked cache at a layer index

    def allocator(self) -> None:
        return None

    def cache(self, make: MakeBuffer) -> KVCache:
        c = self.cfg
        shape = (c.num_layers, self.slots, self.max_seq_len, c.num_kv_heads, c.head_dim)
        return {"k": make(shape, AXES), "v": make(shape, AXES)}

    def insert(self, cache: KVCache, prefix_cache: KVCache, slot: jax.Array, pages: None = None) -> KVCache:
        return {n: jax.lax.dynamic_update_slice(cache[n], prefix_cache[n], (0, slot, 0, 0, 0)) for n in ("k", "v")}

    def chunks(self, positions: int) -> int | None:
        """The fewest chunks of `chunk_sizes(max_seq_len)` that hold positions [0, `positions`) (`chunks_holding`;
        None: all): a step reads the positions in use, not `max_seq_len`."""
        return chunks_holding(chunk_sizes(self.max_seq_len), positions)

    def decode(self, model, layers, tokens_B, positions_B, cache, chunks, mesh: Mesh):
        """The step over the first `chunks` chunks of each slot's positions (None: all): a slot's numbers are
        the same, bit for bit, for any `chunks` that holds its position (`attend_chunks`)."""
        return model.decode(tokens_B, positions_B, cache, mesh=mesh, layers=layers,
                            layout=dataclasses.replace(self, reads=chunks))

    def attend_layer(self, q_BKGH, k_BKH, v_BKH, positions_B, cache: KVCache, layer) -> tuple[jax.Array, KVCache]:
        """`attend_chunks` over layer `layer`'s positions in `chunk_sizes(S)`, of which the first `reads` (None:
        all), each chunk read straight out of the stacked cache by a slice of its own. (Read through the
        scan's per-layer slice, which every chunk shared, the layer's k and v were copied out first: Qwen3-4B
        at 64 slots x 8,192 on one v5p chip, 2 layers, kept 3.62 GiB of temporaries beside its 4 GiB cache;
        1.64 GiB so, the rest each chunk's float32 keys and values.) The cache comes back as it came (`write`
        stores this step's keys after the last layer)."""
        sizes = chunk_sizes(self.max_seq_len)[:self.reads]

        def read(x_LBSKH, start, c):
            b, _, k, h = x_LBSKH.shape[1:]
            return jax.lax.dynamic_slice(x_LBSKH, (layer, 0, start, 0, 0), (1, b, c, k, h))[0]

        chunks = [(s, read(cache["k"], s, c), read(cache["v"], s, c))
                  for s, c in zip(chunk_starts(sizes), sizes, strict=True)]
        return attend_chunks(q_BKGH, k_BKH, v_BKH, positions_B, chunks), cache

    @staticmethod
    def write(cache: KVCache, k_LBKH: jax.Array, v_LBKH: jax.Array, positions_B: jax.Array) -> KVCache:
        """One scatter per buffer at (layer, row, position)."""
        rows_B = jnp.arange(positions_B.shape[0])
        return {"k": cache["k"].at[:, rows_B, positions_B].set(k_LBKH),
                "v": cache["v"].at[:, rows_B, positions_B].set(v_LBKH)}
