"""How a rollout engine holds its weights and KV cache and samples: the interface the engine calls
(`EngineLayout`), the plain dense implementation (`Plain`), and the one place that picks an implementation
from the mesh's platform (`for_mesh`: the paged pool on TPU and GPU, `jaxrl.inference.paged.PagedLayout`;
on CPU `jaxrl.inference.cpu.CpuLayout`).

The cache's layout is declared once, in `EngineLayout.cache`: the engine builds its zeros from it
(`Engine.init_decode_state`) and `jaxrl compile` its abstract decode state (`programs.abstract_decode_state`).
Letters as in `jaxrl.model.qwen3`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
from jax.sharding import Mesh

from jaxrl.inference import cpu, paged
from jaxrl.inference.engine_params import EngineParams
from jaxrl.inference.sampling import SlotSampling, sample
from jaxrl.model import decode, modules, qwen3
from jaxrl.model.attention import decode_implementation
from jaxrl.model.qwen3 import KVCache, ModelConfig, Params
from jaxrl.parallel.sharding import mesh_platform

# `EngineLayout.cache`'s maker of one buffer: (shape, logical axes[, dtype: None, the cache's]) -> an array
# or a ShapeDtypeStruct
MakeBuffer = Callable[..., Any]


class EngineLayout(Protocol):
    """What the engine (`jaxrl.inference.engine.Engine`) asks of the layout of its weights and cache.

    cfg, slots, max_seq_len: the model, decode slots and cache positions it holds.
    reads_training_weights: the engine reads the trainer's weights in place (no copy of its own).
    prepare(params): the `EngineParams` of `{"base", "lora"}` (outside jit, at each policy update).
    cache(make): the decode state's KV cache {"k", "v"}, each buffer `make(shape, logical axes)`.
    insert(cache, prefix_cache, slot[, pages]): `cache` with a prefill's stacked cache [L, 1, T, K, H] at
        `slot` (a paged layout: at `pages`, its allocator's, `jaxrl.inference.paged`).
    chunks(positions): the `decode` `chunks` that holds positions [0, positions), or None: all of the cache.
    decode(model, params, tokens_B, positions_B, cache, chunks, mesh): one step's final-norm hidden states
        [B, 1, D] and the updated cache (`jaxrl.model.decode.decode_step`).
    logits(params, hidden_BTD): float32 [B, T, V] (`qwen3.logits`).
    sample(params, hidden_BD, sampling, keys_B, *, truncate, seen_BV, ban_BV): (tokens int32 [B],
        logprobs float32 [B]) as `jaxrl.inference.sampling.sample` of the logits.
    """

    cfg: ModelConfig
    slots: int
    max_seq_len: int
    reads_training_weights: bool

    def prepare(self, params: Params) -> EngineParams: ...

    def cache(self, make: MakeBuffer) -> KVCache: ...

    def insert(self, cache: KVCache, prefix_cache: KVCache, slot: jax.Array) -> KVCache: ...

    def chunks(self, positions: int) -> int | None: ...

    def decode(self, model: modules.Qwen3, params: EngineParams, tokens_B: jax.Array, positions_B: jax.Array,
               cache: KVCache, chunks: int | None, mesh: Mesh) -> tuple[jax.Array, KVCache]: ...

    def logits(self, params: EngineParams, hidden_BTD: jax.Array) -> jax.Array: ...

    def sample(self, params: EngineParams, hidden_BD: jax.Array, sampling: SlotSampling, keys_B: jax.Array, *,
               truncate: bool, seen_BV: jax.Array | None,
               ban_BV: jax.Array | None) -> tuple[jax.Array, jax.Array]: ...


@dataclasses.dataclass
class Plain:
    """The plain dense layout (a TPU or GPU engine given it; `for_mesh` picks the paged pool there): the
    training weights read in place (a copy would cost a second base model's HBM), one stacked cache
    {"k","v"} [L, B, S, K, H] per k and v (`decode.STACKED`, the layers scanned over it), sampling from
    the [B, V] logits."""

    cfg: ModelConfig
    slots: int
    max_seq_len: int
    reads_training_weights = True

    def prepare(self, params: Params) -> EngineParams:
        return EngineParams.of(params)

    def cache(self, make: MakeBuffer) -> KVCache:
        c = self.cfg
        shape = (c.num_layers, self.slots, self.max_seq_len, c.num_kv_heads, c.head_dim)
        axes = (None, "batch", None, "kv_heads", None)
        return {"k": make(shape, axes), "v": make(shape, axes)}

    def insert(self, cache: KVCache, prefix_cache: KVCache, slot: jax.Array) -> KVCache:
        return {n: jax.lax.dynamic_update_slice(cache[n], prefix_cache[n], (0, slot, 0, 0, 0)) for n in ("k", "v")}

    def chunks(self, positions: int) -> None:
        return None

    def decode(self, model, params, tokens_B, positions_B, cache, chunks, mesh):
        return model.decode(tokens_B, positions_B, cache, mesh=mesh, layout=decode.STACKED)

    def logits(self, params: EngineParams, hidden_BTD: jax.Array) -> jax.Array:
        return qwen3.logits(params.base, hidden_BTD)

    def sample(self, params, hidden_BD, sampling, keys_B, *, truncate, seen_BV, ban_BV):
        return sample(self.logits(params, hidden_BD[:, None])[:, 0], sampling, keys_B, truncate=truncate,
                      seen_BV=seen_BV, ban_BV=ban_BV)


def for_mesh(cfg: ModelConfig, mesh: Mesh, slots: int, max_seq_len: int,
             kv_cache_tokens: int | None = None) -> EngineLayout:
    """The layout of an engine of `slots` slots and `max_seq_len` positions on `mesh`: on an accelerator
    (`mesh_platform`: the mesh's devices decide, so `jaxrl compile`'s TPU programs traced on a CPU host are
    the TPU's) or with `kv_cache_tokens`, the paged cache of that many positions (None: `slots` x
    `max_seq_len`, at most what its slots ever hold; a run sizes it to what fits first,
    `jaxrl.compile.pool.sized`) (`jaxrl.inference.paged.PagedLayout`, its decode attention
    `decode_implementation`'s for the mesh: the Pallas kernel on TPU); else, on CPU, `cpu.CpuLayout`'s dense
    cache (faster there). `Plain`, the dense cache on an accelerator, is passed to the engine explicitly."""
    platform = mesh_platform(mesh)
    if kv_cache_tokens is not None or platform != "cpu":
        return paged.PagedLayout(cfg, slots, max_seq_len, kv_cache_tokens,
                                 decode_impl=decode_implementation(platform, cfg.head_dim))
    return cpu.CpuLayout(cfg, slots, max_seq_len)
