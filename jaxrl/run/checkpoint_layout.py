"""Checkpoints of the LoRA A factors' earlier layout, restored into today's.

Until 2026-11-26 a LoRA `a` factor was declared [stack..., in..., R]; since then it is rank-major,
[stack..., R, in...] (`jaxrl.model.modules.LoRA`: PEFT's own `lora_A.weight` layout, which a TPU tiles
without padding). A checkpoint records its layout in its metadata JSON (`LAYOUT_KEY`, written by
`Checkpointer.save`); one without the key was saved before the change. Its `a` factors, and the
optimizer's moments of them (the same paths under `opt_state`), are restored in the old shape and
transposed: the same numbers, so a run resumes (or exports) across the change. Detected by the
metadata, not by shape: an `a` whose input size equals the rank has the same shape in both layouts.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.model.modules import lora_stack_axes

LAYOUT_KEY = "lora_a_layout"  # in a checkpoint's metadata JSON; absent: saved with the old layout
RANK_MAJOR = "rank-major"
_GROUPS = ("layers", "mlp", "moe")  # `lora_specs`' groups


def _stack_axes_of(path: tuple) -> int | None:
    """The stack axes (`lora_stack_axes`) of a leaf at `path` that is a LoRA `a` factor, or a moment of one
    (a path ending group/weight/"a"); None for any other leaf."""
    keys = [getattr(k, "key", None) for k in path]
    if len(keys) >= 3 and keys[-1] == "a" and keys[-3] in _GROUPS:
        return lora_stack_axes(keys[-3])
    return None


def _old_order(ndim: int, p: int) -> list[int]:
    """Today's axes in the old layout's order: the rank (axis `p`) last."""
    return [*range(p), *range(p + 1, ndim), p]


def old_layout_target(abstract: dict[str, Any]) -> dict[str, Any]:
    """The restore target of a checkpoint saved with the old layout: `abstract` (today's
    `jax.ShapeDtypeStruct`s, as `Checkpointer.restore` builds them from its `like`) with each LoRA `a`
    leaf's shape, and its `NamedSharding`'s spec, in the old axis order [stack..., in..., R]. A full
    fine-tuning tree (no `lora`) is returned as it is."""
    if "lora" not in abstract:
        return abstract

    def old(path: tuple, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        p = _stack_axes_of(path)
        if p is None:
            return x
        order = _old_order(len(x.shape), p)
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            spec = (*sharding.spec, *(None,) * (len(x.shape) - len(sharding.spec)))
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*(spec[i] for i in order)))
        return jax.ShapeDtypeStruct(tuple(x.shape[i] for i in order), x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(old, abstract)


def to_rank_major(tree: dict[str, Any], abstract: dict[str, Any]) -> dict[str, Any]:
    """`tree`, restored against `old_layout_target(abstract)`, with each LoRA `a` leaf moved from
    [stack..., in..., R] to [stack..., R, in...] and placed with `abstract`'s sharding."""
    if "lora" not in abstract:
        return tree

    def new(path: tuple, x: Any, like: jax.ShapeDtypeStruct) -> Any:
        p = _stack_axes_of(path)
        if p is None:
            return x
        move = jax.jit(functools.partial(jnp.moveaxis, source=-1, destination=p), out_shardings=like.sharding)
        return move(x)

    return jax.tree_util.tree_map_with_path(new, tree, abstract)
