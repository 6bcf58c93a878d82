"""The rollout engine's parameters, `EngineParams`: what its weights seam (`EngineWeights.prepare`) makes of
the trainer's weights at each policy update, and what every prefill and decode program takes; and that seam,
`EngineWeights`: `PlainWeights` (the trainer's arrays read in place, TPU and GPU) or the CPU's copies
(`jaxrl.inference.cpu.CpuWeights`), chosen by the engine from its KV cache's kind
(`jaxrl.kv.kind.CacheKind.reads_training_weights`). Letters as in `jaxrl.model.decoder`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
from flax import struct

from jaxrl.inference.sampling import SlotSampling, sample
from jaxrl.model import decoder
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.cpu import OutMajor
from jaxrl.model.decoder import LayerWeights
from jaxrl.model.kernels import Search


@struct.dataclass
class EngineParams:
    """The weights an engine's programs read: a pytree (a frozen `flax.struct.dataclass`; None fields are
    empty subtrees), passed to `jax.jit` as one argument. The fields stand in alphabetical order, as the
    keys of the dict they replace were flattened, so the programs' argument order is unchanged.

    base: the base weights, `jaxrl.model.modules.param_specs`' structure: `embed` [V, D], the stacks
        `layers` [L, ...], `mlp` [Q, ...] and `moe` [U, ...], `final_norm` [D], `unembed` [D, V] unless
        tied. On TPU and GPU the trainer's arrays themselves (no copy).
    layers: the CPU's per-layer copy (`jaxrl.inference.cpu.CpuWeights.prepare`): one
        `decoder.LayerWeights` per layer, its projections output-major (`jaxrl.model.cpu.OutMajor`), its
        LoRA the slices of `lora`; None: the layers run over the stacks of `base` and `lora`.
    lora: the LoRA factors, `modules.lora_specs`' structure, or None (full fine-tuning, a bare base).
    unembed: the CPU's unembedding as an `OutMajor` [V, D] (a tied embedding read in place); None:
        `decoder.logits` of `base`.
    unembed_blocks: the CPU's unembedding rows in blocks of `jaxrl.inference.cpu.BLOCK` rows [v, D]
        (`cpu.vocab_blocks`, copies) for its blocked sampler; None: no blocks made (the sampler, where it
        runs, slices them at each call).
    """

    base: Params
    layers: list[LayerWeights] | None = None
    lora: Params | None = None
    unembed: OutMajor | None = None
    unembed_blocks: tuple[jax.Array, ...] | None = None

    @classmethod
    def of(cls, weights: Params) -> EngineParams:
        """The engine params that read `weights`, a `{"base", "lora"}` dict (`jaxrl.model.modules`' pair;
        "lora" absent or None: none), in place: what `PlainWeights.prepare` returns."""
        return cls(base=weights["base"], lora=weights.get("lora"))

    def weights(self) -> Params:
        """The `{"base", "lora"}` dict these were made from (`of`'s inverse): what `Engine.prepare` takes,
        to prepare them again for a second front end (JetStream's, `jaxrl serve --jetstream`); the CPU
        weights then reuse their views of the same base."""
        return {"base": self.base, "lora": self.lora}


class EngineWeights(Protocol):
    """How the engine holds its weights and samples.

    reads_training_weights: the engine reads the trainer's weights in place (no copy of its own).
    prepare(params): the `EngineParams` of `{"base", "lora"}` (outside jit, at each policy update).
    logits(params, hidden_BTD): float32 [B, T, V] (`decoder.logits`).
    sample(params, hidden_BD, sampling, keys_B, *, truncate, seen_BV, ban_BV, search): (tokens int32 [B],
        logprobs float32 [B]) as `jaxrl.inference.sampling.sample` of the logits (`search` its threshold
        search, `jaxrl.model.kernels.sampler_search`'s for the engine's mesh).
    """

    reads_training_weights: bool

    def prepare(self, params: Params) -> EngineParams: ...

    def logits(self, params: EngineParams, hidden_BTD: jax.Array) -> jax.Array: ...

    def sample(self, params: EngineParams, hidden_BD: jax.Array, sampling: SlotSampling, keys_B: jax.Array, *,
               truncate: bool, seen_BV: jax.Array | None, ban_BV: jax.Array | None,
               search: Search | None = None) -> tuple[jax.Array, jax.Array]: ...


@dataclasses.dataclass
class PlainWeights:
    """The plain `EngineWeights`, what a TPU or GPU engine runs: the training weights read in place (a copy
    would cost a second base model's HBM), sampling from the [B, V] logits."""

    cfg: ModelConfig
    reads_training_weights = True

    def prepare(self, params: Params) -> EngineParams:
        return EngineParams.of(params)

    def logits(self, params: EngineParams, hidden_BTD: jax.Array) -> jax.Array:
        return decoder.logits(params.base, hidden_BTD)

    def sample(self, params, hidden_BD, sampling, keys_B, *, truncate, seen_BV, ban_BV, search=None):
        return sample(self.logits(params, hidden_BD[:, None])[:, 0], sampling, keys_B, truncate=truncate,
                      seen_BV=seen_BV, ban_BV=ban_BV, search=search)
