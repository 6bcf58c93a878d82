"""What the engine, its decode step and its scheduler ask of a KV cache: `CacheKind`, the interface each
kind in this package implements (`jaxrl.kv.dense.Dense`, `jaxrl.kv.chunked.Chunked`, `jaxrl.kv.paged.Paged`,
`jaxrl.kv.pallas.PagedPallas`, `jaxrl.kv.triton.PagedTriton`), of which `jaxrl.kv.pick.pick` makes the one
`jaxrl.model.kernels.cache_kind` names for the placement.

A kind is a value (a frozen dataclass): its shapes follow from the model, the slots and the positions it
was made for; what changes per compiled step (the chunks a step reads, the mesh its kernel runs on) is
given to `decode`, which hands the decode step (`jaxrl.model.decode.decode_step`) the kind itself as the
step's `CacheLayout`. Letters as in `jaxrl.model.decoder`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
from jax.sharding import Mesh

from jaxrl.kv.pages import PageAllocator
from jaxrl.model import modules
from jaxrl.model.config import ModelConfig
from jaxrl.model.decode import CacheLayout

# `CacheKind.cache`'s maker of one buffer: (shape, logical axes[, dtype: None, the cache's]) -> an array or a
from jaxrl.model.decoder import KVCache, LayerWeights

# ShapeDtypeStruct
MakeBuffer = Callable[..., Any]


class CacheKind(CacheLayout, Protocol):
    """A KV cache an engine holds: its decode step's `CacheLayout` (`attend` or `attend_layer`, `write`,
    `per_layer`, `indexed`) and what the engine asks of it.

    cfg, slots, max_seq_len: the model, decode slots and positions a slot holds.
    reads_training_weights: an engine over this cache reads the trainer's weights in place; False: the
        engine keeps its own copy laid out as this cache's step reads it fastest (the CPU's,
        `jaxrl.inference.cpu.CpuWeights`).
    allocator(): a new host-side page allocator for a paged cache (`jaxrl.kv.pages`), None for a dense one.
    cache(make): the decode state's KV cache, each buffer `make(shape, logical axes[, dtype])`.
    insert(cache, prefix_cache, slot, pages=None): `cache` with a prefill's stacked cache [L, 1, T, K, H]
        at `slot` (a paged cache: at `pages`, its allocator's).
    chunks(positions): `decode`'s `chunks` that holds positions [0, positions), or None: the whole cache.
    decode(model, layers, tokens_B, positions_B, cache, chunks, mesh): one step's final-norm hidden states
        [B, 1, D] and the updated cache (`jaxrl.model.decode.decode_step`; `layers` the engine's per-layer
        weights or None).
    """

    cfg: ModelConfig
    slots: int
    max_seq_len: int
    reads_training_weights: bool

    def allocator(self) -> PageAllocator | None: ...

    def cache(self, make: MakeBuffer) -> KVCache: ...

    def insert(self, cache: KVCache, prefix_cache: KVCache, slot: jax.Array,
               pages: jax.Array | None = None) -> KVCache: ...

    def chunks(self, positions: int) -> int | None: ...

    def decode(self, model: modules.Model, layers: list[LayerWeights] | None, tokens_B: jax.Array,
               positions_B: jax.Array, cache: KVCache, chunks: int | None,
               mesh: Mesh) -> tuple[jax.Array, KVCache]: ...
