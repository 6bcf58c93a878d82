"""Several decode steps in one program (`jaxrl.inference.engine.Engine.generate_steps`): an on-device loop
over the engine's masked decode step, as tpu-inference's multi-step decode ("continue_decode"), so that the
host sees the engine once per k steps and not after every token. Letters as in `jaxrl.model.decoder`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import Mesh, PartitionSpec

from jaxrl.inference.decode_state import DecodeState
from jaxrl.model import kernels

# (params, state, live_B) -> (the next state, (tokens int32 [B], logprobs float32 [B], top ids int32 [B, top],
# top logprobs float32 [B, top])): one decode step with the engine's weights `params` in which the slots not
# `live_B` keep their state
MaskedStep = Callable[[Any, DecodeState, jax.Array], tuple[DecodeState, tuple[jax.Array, ...]]]


@dataclasses.dataclass(frozen=True)
class Pin:
    """How `run_steps` pins the weights' layouts in its loop: their `mesh` and each leaf's PartitionSpec on it
    (`specs`, in `jax.tree.leaves` order). Hashable: a jitted program's static argument."""

    mesh: Mesh
    specs: tuple[PartitionSpec, ...]


def pin_for(params: Any, mesh: Mesh) -> Pin | None:
    """The `Pin` of `params` (arrays or ShapeDtypeStructs, placed) on `mesh` where a loop of decode steps pins
    the weights' layouts (`jaxrl.model.kernels.pins_loop_layouts`), else None."""
    if not kernels.pins_loop_layouts(kernels.platform_of(mesh)):
        return None
    return Pin(mesh, tuple(x.sharding.spec for x in jax.tree.leaves(params)))


def _pinned(params: Any, pin: Pin) -> Any:
    """`params` with each leaf's layout constrained to the row-major one of its argument, shard by shard
    (`shard_map` over its own spec: the constraint is a custom call, which the SPMD partitioner would
    otherwise only run on the whole array, gathering it)."""

    def pin_one(x: jax.Array, spec: PartitionSpec) -> jax.Array:
        def local(y: jax.Array) -> jax.Array:
            return with_layout_constraint(y, Layout(tuple(range(y.ndim))))

        return jax.shard_map(local, mesh=pin.mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)

    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [pin_one(x, spec) for x, spec in zip(leaves, pin.specs, strict=True)])


def run_steps(step: MaskedStep, params: Any, state: DecodeState, budget_B: jax.Array, *, steps: int,
              top: int, pin: Pin | None = None) -> tuple[DecodeState, tuple[jax.Array, ...], jax.Array]:
    """Up to `steps` calls of `step` with `params` (the engine's weights, a pytree of arrays, read by every
    step and never changed) in a `lax.while_loop`, slot b live in a step while it has run fewer than
    `budget_B[b]` (int32 [B]) and its input token (the last it sampled) is not one of its stop tokens
    (`DecodeState.stop`); the loop ends once no slot is live. `pin` (`pin_for`; None: not pinned): where and
    how the loop's body pins the layouts of `params`' leaves. One step
    (`steps` 1) is the step alone, no loop: the program a single step compiled to before (a TPU's layout
    assignment may give a loop's state layouts of its own, with copies into them before the loop;
    docs/benchmarks.md, 2026-11-27).

    Returns:
        The state after the loop, each step's outputs stacked (tokens int32 [steps, B], logprobs float32
        [steps, B], top ids int32 [steps, B, top], top logprobs float32 [steps, B, top]; rows past a slot's
        count are not its tokens, and zeros past the last step run) and how many steps each slot ran,
        int32 [B].
    """
    b = budget_B.shape[0]
    rows_B = jnp.arange(b)

    def live(i, s: DecodeState):
        return (i < budget_B) & ~s.stop[rows_B, s.tokens]

    if steps == 1:
        live_B = live(0, state)
        state, result = step(params, state, live_B)
        return state, tuple(r[None] for r in result), live_B.astype(jnp.int32)

    def body(carry):
        i, s, out, counts_B = carry
        live_B = live(i, s)
        # The weights are loop-invariant, so XLA computes what depends on them alone once, before the loop
        # (loop-invariant code motion), and holds it for the whole program: on TPU the fsdp-gathered whole
        # unembedding, 1.16 GiB a chip for INTELLECT-3 (docs/benchmarks-log.md, 2026-11-28). An optimization
        # barrier that ties them to the step counter makes them the loop's own values each step (it copies
        # nothing: its outputs are its operands' buffers), so each step gathers them where the single step
        # does and frees them after use. The loop also carries them, and the carry's layout is XLA's to
        # choose: on TPU it takes the one the layer scan's dots want (the attention projections with the model
        # dimension minor, the experts' LoRA factors with the rank minor), copying every stacked weight into it
        # before the loop, 59 MB a layer for Qwen3-30B-A3B. Pinned inside the body to the arguments' layout,
        # the carry keeps it, and each layer's slice is relayouted inside the layer scan as in the single step.
        p, _ = jax.lax.optimization_barrier((params, i))
        if pin is not None:
            p = _pinned(p, pin)
        s, result = step(p, s, live_B)
        out = tuple(jax.lax.dynamic_update_index_in_dim(o, r, i, 0) for o, r in zip(out, result, strict=True))
        return i + 1, s, out, counts_B + live_B

    out = (jnp.zeros((steps, b), jnp.int32), jnp.zeros((steps, b), jnp.float32),
           jnp.zeros((steps, b, top), jnp.int32), jnp.zeros((steps, b, top), jnp.float32))
    _, state, out, counts_B = jax.lax.while_loop(lambda c: (c[0] < steps) & jnp.any(live(c[0], c[1])), body,
                                                 (jnp.int32(0), state, out, jnp.zeros((b,), jnp.int32)))
    return state, out, counts_B
