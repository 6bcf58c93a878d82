"""The model's CPU-only weight layout: the weights as the rollout engine's decode reads them on CPU
(`jaxrl.inference.cpu.CpuWeights`, the engine's seam, makes and passes them; its KV cache is
`jaxrl.kv.chunked`).

  * `OutMajor`: a projection's weight stored output-major, [O, Y]. The model's code multiplies by a
    weight as `x @ w` (`blocks.project`); with an `OutMajor` that product is `w_OI @ x.T`, the orientation
    XLA's CPU dot reads fastest at a few rows (about 2.4x at the Qwen3-0.6B decode shape).
    `out_major` converts the per-layer weights.

The figures behind each choice are in docs/benchmarks.md (2026-11-23 .. 2026-11-26). Letters as in
`jaxrl.model.decoder`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.model import blocks
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig


@struct.dataclass
class OutMajor:
    """A projection's weight of logical `shape` [Y..., O...] stored output-major: `w_OI` [O, Y], its output
    axes flattened first. It stands where `blocks.project` expects the weight: its `reshape` to the flat
    [Y, O] keeps it output-major, and `x_MY @ w` (Python's `__rmatmul__`: a jax array defers to an operand
    it does not know) computes `w_OI @ x_MY.T`, transposed back outside the dot, where an optimization
    barrier keeps XLA's algebraic simplifier from folding the transpose into the dot (which would undo the
    orientation). Made outside jit (`of`, `out_major`): a transposed copy."""

    w_OI: jax.Array
    shape: tuple[int, ...] = struct.field(pytree_node=False)

    @classmethod
    def of(cls, w: jax.Array, n_in: int) -> OutMajor:
        """`w` [Y..., O...] with `n_in` input axes, as a new output-major array (a transposed copy)."""
        return cls(jnp.asarray(w.reshape(math.prod(w.shape[:n_in]), -1).T), tuple(w.shape))

    def reshape(self, *shape: int) -> OutMajor:
        """The same array as the flat [Y, O] weight (`shape` that, one entry may be -1).

        Raises:
            ValueError: `shape` is not [Y, O].
        """
        o, y = self.w_OI.shape
        known = math.prod(n for n in shape if n != -1)
        want = tuple((y * o) // known if n == -1 else n for n in shape)
        if want != (y, o):
            raise ValueError(f"an OutMajor weight of shape {self.shape} reshapes to its flat ({y}, {o}) only, "
                             f"not {shape}")
        return OutMajor(self.w_OI, (y, o))

    def __rmatmul__(self, x_MY: jax.Array) -> jax.Array:
        y_OM = jax.lax.dot_general(self.w_OI, x_MY, (((1,), (1,)), ((), ())))
        return jax.lax.optimization_barrier(y_OM).T


def out_major(cfg: ModelConfig, layers: list[tuple]) -> list[tuple]:
    """Per-layer base weights `(layers slice, mlp or moe slice)` from `decoder.unstack_layers`, with each
    attention and dense-MLP projection as an `OutMajor` (a transposed copy, made outside jit, in place of
    the slice); norms, routers and experts as they are."""
    n_in = dict(blocks.LORA_TARGETS.values())

    def convert(group: Params) -> Params:
        return {k: OutMajor.of(a, n_in[k]) if k in n_in else a for k, a in group.items()}

    return [(convert(w), convert(mw) if kind == "mlp" else mw)
            for (w, mw), kind in zip(layers, cfg.layer_kinds, strict=True)]


def unembedding(base: Params) -> OutMajor:
    """The unembedding [D, V] as an `OutMajor` [V, D]: a tied embedding as it is (no copy), an untied
    `unembed` transposed."""
    if "unembed" in base:
        return OutMajor.of(base["unembed"], 1)
    v, d = base["embed"].shape
    return OutMajor(base["embed"], (d, v))
