"""The compiler's cost of a run's programs against the model's ideal FLOPs: `jaxrl compile`'s cost lines.

`cost_analysis()` counts the body of a loop once whatever its trip count (a 1-, 2- and 4-layer scan report
the same FLOPs), so a layer's cost is the difference of the train step compiled with its layers unrolled
at two depths (`jaxrl.compile.depths.cost_depths`: 2 and 3 for a Qwen3 and INTELLECT-3).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.compile import depths, programs, slices
from jaxrl.compile.programs import Shapes
from jaxrl.model.qwen3 import ModelConfig
from jaxrl.parallel.sharding import batch_shards


@dataclasses.dataclass(frozen=True)
class Cost:
    """The compiler's account of one train-step layer, per chip and micro-batch (`train_cost`), against the
    model's ideal. FLOPs and bytes accessed from `cost_analysis()` of the train step compiled with its
    layers unrolled at two depths (`depths.cost_depths`), the deeper minus the shallower; `rest_*` is what the
    shallower holds besides its layers (embedding, output head, loss, the optimizer's update), and
    `micro_batches` how often the step runs a layer's body (the micro-batch loop, counted once by
    `cost_analysis`)."""

    layer_flops: float
    layer_bytes: float
    rest_flops: float
    rest_bytes: float
    ideal_layer_flops: float  # 6 (full) or 4 (LoRA) per active weight and token, causal attention counted once
    remat_layer_flops: float  # what rematerialisation adds to the ideal: the layer's forward again (0: remat off)
    layers: int
    micro_batches: int

    @property
    def ratio(self) -> float:
        """The compiler's FLOPs per layer over the ideal's."""
        return self.layer_flops / self.ideal_layer_flops

    def step(self) -> tuple[float, float]:
        """(FLOPs, bytes accessed) of one train step per chip, from the per-layer figures."""
        k = self.micro_batches
        return (k * (self.layers * self.layer_flops + self.rest_flops),
                k * (self.layers * self.layer_bytes + self.rest_bytes))

    def roofline_s(self, chip: slices.Chip) -> float:
        """A train step's seconds from the compiler's counts: max(FLOPs / peak, bytes / bandwidth)."""
        flops, nbytes = self.step()
        return max(flops / chip.flops, nbytes / chip.hbm_bandwidth)

    def lines(self, chip: slices.Chip) -> list[str]:
        """The report's lines: per-layer counts, the ratio, the roofline, and where the FLOPs beyond the
        ideal go, as far as the counts tell."""
        t = 1e12
        beyond = self.layer_flops - self.ideal_layer_flops - self.remat_layer_flops
        return [f"compiler cost (train step, one layer, per chip and micro-batch): {self.layer_flops / t:.3f} TFLOP, "
                f"{self.layer_bytes / 2**30:.2f} GiB accessed; ideal {self.ideal_layer_flops / t:.3f} TFLOP: "
                f"ratio {self.ratio:.2f}",
                f"  roofline from the compiler's counts: train step {self.roofline_s(chip):.2f} s "
                f"({self.micro_batches} micro-batch(es) x {self.layers} layers)",
                f"  recomputation (remat): {self.remat_layer_flops / self.ideal_layer_flops:.0%} of the ideal",
                f"  the rest beyond ideal + remat (masked attention blocks, LoRA's products, norms, relayouts): "
                f"{beyond / self.ideal_layer_flops:+.0%} of the ideal"]


def ideal_layer_flops(m: ModelConfig, s: Shapes, tokens: int, rows: int) -> tuple[float, float]:
    """(ideal, remat's addition) FLOPs of one layer over `rows` sequences of `s.seq_len` (`tokens` in all):
    per token 2 per active weight forward (the attention projections, the dense MLP or the router and top-k
    experts), 4 backward with LoRA (activations' gradients only) or 6 in all with full fine-tuning; causal
    attention's two products counted once (2·T²·N·H per sequence forward, T²/2 of each product, 3x that in
    training); a KL reference adds one more forward. Remat adds the forward again."""
    d, n_h, k_h = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    mlp = m.num_experts_per_tok * 3 * d * m.moe_intermediate_size + d * m.num_experts if m.is_moe \
        else 3 * d * m.intermediate_size
    weights = 2 * d * n_h + 2 * d * k_h + mlp
    forward = 2 * weights * tokens + 2 * rows * s.seq_len**2 * n_h
    per_weight = 6 if s.full else 4
    ideal = per_weight * weights * tokens + 3 * 2 * rows * s.seq_len**2 * n_h
    if s.loss.kl_coef > 0:
        ideal += forward
    return ideal, forward if s.remat else 0.0


def train_cost(shapes: Shapes, mesh: Any) -> Cost:
    """`Cost` of `shapes`' train step on `mesh` (its micro-batch set): compiled with its layers unrolled at
    `depths.cost_depths` (`cost_analysis()` counts a scanned layer once, whatever the depth). Two compiles.

    Raises:
        programs.ProgramTooLarge: the compiler refused one of them.
    """
    da, db = depths.cost_depths(shapes.model)
    a, b = (programs.compile_train(dataclasses.replace(shapes.at_depth(d), unroll=True), mesh) for d in (da, db))
    layer_flops, layer_bytes = (b.flops - a.flops) / (db - da), (b.bytes_accessed - a.bytes_accessed) / (db - da)
    shards = batch_shards(mesh)
    k = -(-shapes.batch_rows // shapes.micro_batch_size)
    rows = -(-shapes.batch_rows // (k * shards)) * shards  # `Trainer.micro_rows`
    ideal, remat = ideal_layer_flops(shapes.model, shapes, rows * shapes.seq_len, rows)
    chips = mesh.devices.size
    return Cost(layer_flops, layer_bytes, a.flops - da * layer_flops, a.bytes_accessed - da * layer_bytes,
                ideal / chips, remat / chips, shapes.model.num_layers, k)
