"""The compiler's cost of a run's programs against the model's ideal FLOPs: `jaxrl compile`'s cost lines.

`cost_analysis()` counts the body of a loop once whatever its trip count (a 1-, 2- and 4-layer scan report
the same FLOPs), so a layer's cost is the difference of the train step compiled with its layers unrolled
at two depths (`jaxrl.compile.depths.cost_depths`: 2 and 3 for a Qwen3 and INTELLECT-3); the prefill's
and decode's the same way (`jaxrl.compile.engine_cost`).

`cost_analysis()` counts nothing inside a Pallas kernel (a custom call): under splash attention (on TPU,
`jaxrl.model.kernels.attention_kernel`) the causal attention's FLOPs are not in the compiler's counts at
all, so the ratio to the ideal can fall below 1. The lines then give that attention apart, as what the
compiler cannot see, and compare the compiler's counts with the rest of the ideal (docs/tpu.md 7.2:
Qwen3-4B at 32,768 tokens, ratio 0.47, 0.95 outside the kernel).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.compile import depths, programs, slices
from jaxrl.compile.programs import Shapes
from jaxrl.model import kernels
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import batch_shards


def flops_text(x: float) -> str:
    """FLOPs with a unit that leaves 1 to 3 digits before the point (e.g. "4.697 TFLOP", "12.6 MFLOP")."""
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{x:.0f} FLOP"


def bytes_text(x: float) -> str:
    """Bytes in GiB, MiB or KiB (two decimals)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """The compiler's account of one layer of an engine program (prefill or decode), per chip, against the
    ideal (`jaxrl.compile.engine_cost`): FLOPs and bytes accessed, the deeper unrolled program minus the
    shallower; the ideal FLOPs (`kernel_flops` of them attention inside a Pallas kernel, which the compiler
    does not count) and the ideal bytes (the layer's weights read once, and the KV cache the step writes
    or reads)."""

    program: str  # e.g. "prefill 4095 tokens", "decode 64 slots x 4096"
    flops: float
    bytes: float
    ideal_flops: float
    ideal_bytes: float
    kernel_flops: float = 0.0
    # whether the line compares the bytes accessed with the ideal: not for decode, whose bytes the decode
    # step bytes line gives from its buffers (`jaxrl.compile.decode_bytes`; the unrolled step's bytes accessed
    # count each layer's cache slice and nothing inside the paged-attention kernel)
    bytes_counted: bool = True

    def line(self) -> str:
        """One report line: the counts, the ideal and their ratios."""
        seen = self.ideal_flops - self.kernel_flops
        which = "splash" if self.program.startswith("prefill") else "paged-attention"
        kernel = (f", {flops_text(self.kernel_flops)} of it attention inside the {which} kernel, not counted by "
                  f"the compiler (outside it: ratio {self.flops / seen:.2f})" if self.kernel_flops else "")
        if not self.bytes_counted:
            return (f"compiler cost ({self.program}, one layer, per chip): {flops_text(self.flops)}; ideal "
                    f"{flops_text(self.ideal_flops)}{kernel}: ratio {self.flops / self.ideal_flops:.2f} FLOPs "
                    f"(bytes: the decode step bytes line)")
        return (f"compiler cost ({self.program}, one layer, per chip): {flops_text(self.flops)}, "
                f"{bytes_text(self.bytes)} accessed; ideal {flops_text(self.ideal_flops)}{kernel}, "
                f"{bytes_text(self.ideal_bytes)} (weights once + KV): ratio {self.flops / self.ideal_flops:.2f} "
                f"FLOPs, {self.bytes / self.ideal_bytes:.2f} bytes")


@dataclasses.dataclass(frozen=True)
class Cost:
    """The compiler's account of one train-step layer, per chip and micro-batch (`train_cost`), against the
    model's ideal. FLOPs and bytes accessed from `cost_analysis()` of the train step compiled with its
    layers unrolled at two depths (`depths`: `depths.cost_depths`), the deeper minus the shallower; `rest_*`
    is what the shallower holds besides its layers (embedding, output head, loss, the optimizer's update),
    and `micro_batches` how often the step runs a layer's body (the micro-batch loop, counted once by
    `cost_analysis`). `attention_flops`: the ideal's causal attention, inside the splash kernel when
    `kernel` (not counted by the compiler); `engine`: the prefill's and decode's layers (`LayerCost`)."""

    layer_flops: float
    layer_bytes: float
    rest_flops: float
    rest_bytes: float
    ideal_layer_flops: float  # 6 (full) or 4 (LoRA) per active weight and token, causal attention counted once
    remat_layer_flops: float  # what rematerialisation adds to the ideal (0: remat off; see `ideal_layer_flops`)
    layers: int
    micro_batches: int
    attention_flops: float = 0.0  # the ideal's causal attention (forward, backward, a KL reference's forward)
    kernel: bool = False  # attention runs in the Pallas splash kernel: `cost_analysis()` counts none of it
    depths: tuple[int, int] = (2, 3)
    engine: tuple[LayerCost, ...] = ()

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
        ideal go, as far as the counts tell: under splash, attention apart (the compiler cannot see it)
        and the rest against the ideal without it; never a negative "waste". Then one line per engine
        program (`LayerCost.line`)."""
        ideal = self.ideal_layer_flops
        da, db = self.depths
        out = [f"compiler cost (train step, one layer: unrolled at {da} and {db} layers, per chip and micro-batch): "
               f"{flops_text(self.layer_flops)}, {bytes_text(self.layer_bytes)} accessed; ideal {flops_text(ideal)}: "
               f"ratio {self.ratio:.2f}",
               f"  roofline from the compiler's counts: train step {self.roofline_s(chip):.2f} s "
               f"({self.micro_batches} micro-batch(es) x {self.layers} layers"
               + (", attention not in them)" if self.kernel else ")"),
               f"  recomputation (remat): {self.remat_layer_flops / ideal:.0%} of the ideal"]
        seen = ideal - (self.attention_flops if self.kernel else 0.0)
        if self.kernel:
            out.append(f"  attention inside the splash kernel: {flops_text(self.attention_flops)} "
                       f"({self.attention_flops / ideal:.0%} of the ideal), not counted by the compiler; outside "
                       f"it the compiler counts {self.layer_flops / (seen + self.remat_layer_flops):.2f} of the "
                       f"ideal + remat ({flops_text(seen + self.remat_layer_flops)})")
        beyond = self.layer_flops - seen - self.remat_layer_flops
        what = "LoRA's products, norms, relayouts" if self.kernel else \
            "masked attention blocks, LoRA's products, norms, relayouts"
        where = " outside the kernel" if self.kernel else ""
        out.append(f"  the rest beyond ideal + remat{where} ({what}): {beyond / seen:+.0%} of the ideal{where}"
                   if beyond >= 0 else
                   f"  nothing beyond ideal + remat{where}: the compiler counts fewer FLOPs than it")
        return out + [e.line() for e in self.engine]


def active_layer_weights(m: ModelConfig) -> int:
    """Weights a token goes through in one layer of the model's last run (an MoE layer in an MoE model):
    the attention projections, then the dense MLP, or the router, the top-k experts and the shared
    experts (`n_shared_experts`, GLM-4.5's always-on expert)."""
    d, n_h, k_h = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    mlp = (m.num_experts_per_tok + m.n_shared_experts) * 3 * d * m.moe_intermediate_size + d * m.num_experts \
        if m.is_moe else 3 * d * m.intermediate_size
    return 2 * d * n_h + 2 * d * k_h + mlp


def ideal_layer_flops(m: ModelConfig, s: Shapes, tokens: int, rows: int,
                      kernel: bool = False) -> tuple[float, float, float]:
    """(ideal, remat's addition, attention's part of the ideal) FLOPs of one layer over `rows` sequences of
    `s.seq_len` (`tokens` in all): per token 2 per active weight forward (`active_layer_weights`), 4
    backward with LoRA (activations' gradients only) or 6 in all with full fine-tuning (Kaplan et al. 2020,
    "Scaling Laws for Neural Language Models", section 2.1: 2N forward, 6N a trained token); causal
    attention's two products counted once (2·T²·N·H per sequence forward, T²/2 of each product, 3x that in
    training); a KL reference adds one more forward. Remat adds the forward again; with the splash kernel
    (`kernel`) the layer keeps the kernel's output (`attention.remat_policy`), so only the matmuls'."""
    weights = active_layer_weights(m)
    attention = 2 * rows * s.seq_len**2 * m.num_heads * m.head_dim
    forward = 2 * weights * tokens + attention
    per_weight = 6 if s.full else 4
    ideal, attn = per_weight * weights * tokens + 3 * attention, 3 * attention
    if s.loss.kl_coef > 0:
        ideal, attn = ideal + forward, attn + attention
    remat = (forward - attention if kernel else forward) if s.remat else 0.0
    return ideal, remat, attn


def train_cost(shapes: Shapes, mesh: Any) -> Cost:
    """`Cost` of `shapes`' train step on `mesh` (its micro-batch set): compiled with its layers unrolled at
    `depths.cost_depths` (`cost_analysis()` counts a scanned layer once, whatever the depth). Two compiles.

    Raises:
        programs.ProgramTooLarge: the compiler refused one of them.
    """
    m = shapes.model
    da, db = depths.cost_depths(m)
    a, b = (programs.compile_train(dataclasses.replace(shapes.at_depth(d), unroll=True), mesh) for d in (da, db))
    layer_flops, layer_bytes = (b.flops - a.flops) / (db - da), (b.bytes_accessed - a.bytes_accessed) / (db - da)
    shards = batch_shards(mesh)
    k = -(-shapes.batch_rows // shapes.micro_batch_size)
    rows = -(-shapes.batch_rows // (k * shards)) * shards  # `Trainer.micro_rows`
    impl = kernels.attention_kernel(kernels.platform_of(mesh), shapes.seq_len, shapes.dtype, m.head_dim, False)
    kernel = impl == "splash"
    ideal, remat, attention = ideal_layer_flops(m, shapes, rows * shapes.seq_len, rows, kernel)
    chips = mesh.devices.size
    return Cost(layer_flops, layer_bytes, a.flops - da * layer_flops, a.bytes_accessed - da * layer_bytes,
                ideal / chips, remat / chips, m.num_layers, k, attention / chips, kernel, (da, db))
