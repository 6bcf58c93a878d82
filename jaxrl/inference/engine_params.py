"""The rollout engine's parameters, `EngineParams`: what its layout (`jaxrl.inference.layout.EngineLayout.prepare`)
makes of the trainer's weights at each policy update, and what every prefill and decode program takes.
Letters as in `jaxrl.model.qwen3`.
"""

from __future__ import annotations

import jax
from flax import struct

from jaxrl.model.cpu import OutMajor
from jaxrl.model.qwen3 import LayerWeights, Params


@struct.dataclass
class EngineParams:
    """The weights an engine's programs read: a pytree (a frozen `flax.struct.dataclass`; None fields are
    empty subtrees), passed to `jax.jit` as one argument. The fields stand in alphabetical order, as the
    keys of the dict they replace were flattened, so the programs' argument order is unchanged.

    base: the base weights, `jaxrl.model.modules.param_specs`' structure: `embed` [V, D], the stacks
        `layers` [L, ...], `mlp` [Q, ...] and `moe` [U, ...], `final_norm` [D], `unembed` [D, V] unless
        tied. On TPU and GPU the trainer's arrays themselves (no copy).
    layers: the CPU layout's per-layer copy (`jaxrl.inference.cpu.CpuLayout.prepare`): one
        `qwen3.LayerWeights` per layer, its projections output-major (`jaxrl.model.cpu.OutMajor`), its
        LoRA the slices of `lora`; None: the layers run over the stacks of `base` and `lora`.
    lora: the LoRA factors, `modules.lora_specs`' structure, or None (full fine-tuning, a bare base).
    unembed: the CPU layout's unembedding as an `OutMajor` [V, D] (a tied embedding read in place); None:
        `qwen3.logits` of `base`.
    unembed_blocks: the CPU layout's unembedding rows in blocks of `jaxrl.inference.cpu.BLOCK` rows [v, D]
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
        "lora" absent or None: none), in place: what the plain and paged layouts' `prepare` return."""
        return cls(base=weights["base"], lora=weights.get("lora"))

    def weights(self) -> Params:
        """The `{"base", "lora"}` dict these were made from (`of`'s inverse): what `Engine.prepare` takes,
        to prepare them again for a second front end (JetStream's, `jaxrl serve --jetstream`); the CPU
        layout then reuses its views of the same base."""
        return {"base": self.base, "lora": self.lora}
