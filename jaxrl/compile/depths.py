"""Which reduced depths `jaxrl compile` may extrapolate a model's memory from, and at which its cost.

The stack runs as one `jax.lax.scan` per run of layers of one kind (`jaxrl.model.decoder.layer_runs`): a
Qwen3 or Qwen3-MoE is one run; GLM-4.5 and INTELLECT-3 two, their `first_k_dense_replace` dense layers
then their MoE layers. A scan of one trip is inlined by XLA, so a program whose growing run has one trip
is not on the line through deeper ones (INTELLECT-3's prefill at 2 and 3 layers is not the per-layer
step: docs/benchmarks.md, 2026-11-26). So every run but the last must be whole (as deep as in the model)
and the last must have at least 2 trips at the smaller depth: depth `start of the last run + 2`
(Qwen3: 2; INTELLECT-3, one dense layer: 3; GLM-4.5, three: 5).
"""

from __future__ import annotations

import dataclasses

from jaxrl.model.config import ModelConfig
from jaxrl.model.decoder import layer_runs


def last_run_start(model: ModelConfig) -> int:
    """The first layer of the model's last run of one kind (0 for a Qwen3: one run)."""
    return layer_runs(model)[-1][1]


def smallest(model: ModelConfig) -> int:
    """The smallest depth whose programs are on the line through deeper ones: every run but the last
    whole, the last a scan of at least 2 trips (module docstring)."""
    return last_run_start(model) + 2


def describe(model: ModelConfig) -> str:
    """The stack's runs in words, e.g. "1 dense layer, then 45 MoE layers"."""
    parts = []
    for kind, start, stop, _ in layer_runs(model):
        n = stop - start
        parts.append(f"{n} {'MoE' if kind == 'moe' else 'dense'} layer{'s' if n > 1 else ''}")
    return ", then ".join(parts)


def check(model: ModelConfig, depths: tuple[int, ...], name: str) -> None:
    """Refuse reduced `depths` (two layer counts) that `smallest` rules out for `model` (called `name`).

    Raises:
        ValueError: the smaller depth is under `smallest(model)`, naming the model, its runs, the depths
            given and the smallest valid pair (or, where that pair is deeper than the model, saying to
            compile at full depth).
    """
    if len(depths) < 2:
        return
    low, need = min(depths), smallest(model)
    if low >= need:
        return
    given = ",".join(map(str, depths))
    runs = layer_runs(model)
    at_low = layer_runs(dataclasses.replace(model, num_layers=low))
    why = (f"at {low} layer{'s' if low > 1 else ''} its last scan has {at_low[-1][2] - at_low[-1][1]} trip(s)"
           if len(at_low) == len(runs) else
           f"at {low} layer{'s' if low > 1 else ''} it has {len(at_low)} of its {len(runs)} runs")
    pair = (f"the smallest valid pair is {need},{need + 1}" if need + 1 <= model.num_layers else
            "no reduced pair is valid: compile at full depth (leave --depths out)")
    raise ValueError(f"--depths {given}: {name} runs its {model.num_layers} layers as {len(runs)} scan(s) "
                     f"({describe(model)}); {why}, and XLA inlines a scan of one trip, so memory is not affine "
                     f"from there (jaxrl.compile.depths); {pair}")


def cost_depths(model: ModelConfig) -> tuple[int, int]:
    """The two depths whose train steps, compiled with their layers unrolled (`jaxrl.compile.cost`), differ
    by one layer of the model's last run (its MoE layers, in a GLM-4.5): every earlier layer in both, then
    one and two of the last run. Unrolled programs have no loop to inline, so one layer of the last run
    is enough. A one-run model keeps (2, 3), as `jaxrl compile` always compiled it; INTELLECT-3 (one dense
    layer): (2, 3); GLM-4.5 (three): (4, 5). At (2, 3) GLM-4.5's difference would be a dense layer."""
    start = last_run_start(model)
    return (2, 3) if start == 0 else (start + 1, start + 2)
