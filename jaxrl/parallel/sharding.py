"""The device mesh and the logical-axis rules that place every array on it.

Mesh axes: `data` (replicas of the model, batch split), `fsdp` (batch split, weights sharded on their
`embed` axis), `tensor` (heads, MLP and vocabulary split), `expert` (reserved for MoE expert
parallelism). Weights and activations carry logical axis names (declared in `jaxrl.model.modules`); one
rules table maps each logical name to mesh axes. A dimension that the mapped mesh axes do not divide
is replicated instead, so tiny test models run on any mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.parallel.spec import ParamSpec, is_spec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

Rules = Mapping[str, tuple[str, ...]]

# One table serves training and rollout on purpose: the engine reads the trainer's weight arrays by
# reference, so a rollout table that placed any weight differently would cost a resharded copy of the
# model after every optimizer step. Activations (the train batch, decode slots, the KV cache's batch and
# kv_heads axes) use the same names in both.
RULES: Rules = {
    "batch": ("data", "fsdp", "expert"),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": ("expert",),
    # a paged KV pool's kv heads (`jaxrl.kv.paged`): its pages are shared by every slot, so the pool is
    # split by heads over every axis that divides them, the batch axes too (`PARTIAL`)
    "kv_pool": ("tensor", "expert", "fsdp", "data"),
    # the same pool's kv heads as JAX's ragged paged-attention kernel holds them, each head's key and value
    # side by side ([2K], `jaxrl.kv.ragged`): split as `kv_pool`, in whole pairs (`PAIRED`)
    "kv_pairs": ("tensor", "expert", "fsdp", "data"),
}
# logical axes split over the longest prefix of their mesh axes (size > 1) whose product divides the
# dimension, not all or nothing
PARTIAL = frozenset({"kv_pool", "kv_pairs"})
# PARTIAL axes whose dimension is pairs: the prefix must divide the pairs (half the dimension)
PAIRED = frozenset({"kv_pairs"})


def check_rules(rules: Rules) -> None:
    """Refuse a rules table that names a mesh axis other than `MESH_AXES`, or one mesh axis twice for a
    logical axis. (Two dimensions of one array that land on the same mesh axis are refused by
    `logical_spec`.)

    Raises:
        ValueError: naming the logical axis and the bad mesh axis.
    """
    for name, axes in rules.items():
        for a in axes:
            if a not in MESH_AXES:
                raise ValueError(f"sharding rule {name!r} -> {a!r}: {a!r} is not a mesh axis {MESH_AXES}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"sharding rule {name!r} maps mesh axes {axes} more than once")


check_rules(RULES)


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes `MESH_AXES` of the given sizes (missing axes are 1). When every size is 1 (the
    default) and several devices are given, all of them go on `fsdp`.

    Raises:
        ValueError: the sizes' product differs from the number of devices.
    """
    sizes = tuple(int(shape.get(a, 1)) for a in MESH_AXES)
    devices = list(devices if devices is not None else jax.devices())
    if math.prod(sizes) == 1:
        sizes = (1, len(devices), 1, 1)
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} devices, "
            f"but {len(devices)} are visible"
        )
    return Mesh(np.array(devices).reshape(sizes), MESH_AXES)


def mesh_platform(mesh: Mesh) -> str:
    """The platform of `mesh`'s devices ("cpu", "tpu", "gpu", ...: `jax.Device.platform`), which decides what
    is done differently on a CPU (the CPU seams: `jaxrl.rl.cpu.tuning`, the engine's). The mesh's devices
    decide, not `jax.default_backend()`: `jaxrl compile` traces its TPU programs on a CPU host, over a TPU
    topology's devices."""
    return mesh.devices.flat[0].platform


def logical_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                 rules: Rules = RULES) -> PartitionSpec:
    """PartitionSpec for an array with logical `axes` and `shape` on `mesh`.

    Mesh axes of size 1 are dropped; a dimension they do not divide is replicated (a `PARTIAL` axis: split
    over the longest prefix of them that divides it; a `PAIRED` one, that divides its pairs).

    Raises:
        ValueError: two dimensions map to the same mesh axis.
    """
    used: set[str] = set()
    out: list[Any] = []
    for name, dim in zip(axes, shape, strict=True):
        mesh_axes = tuple(a for a in rules.get(name, ()) if name is not None and mesh.shape[a] > 1)
        if name in PARTIAL:
            whole = dim // 2 if name in PAIRED else dim
            while mesh_axes and whole % math.prod(mesh.shape[a] for a in mesh_axes):
                mesh_axes = mesh_axes[:-1]
        if used & set(mesh_axes):
            raise ValueError(f"logical axes {tuple(axes)} map mesh axes {sorted(used & set(mesh_axes))} twice")
        if not mesh_axes or dim % math.prod(mesh.shape[a] for a in mesh_axes):
            out.append(None)
            continue
        used.update(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*out)


def spec_shardings(specs: Any, dims: Mapping[str, int], mesh: Mesh, rules: Rules = RULES) -> Any:
    """NamedShardings for a pytree of `ParamSpec` (same structure)."""

    def one(s: ParamSpec) -> NamedSharding:
        return NamedSharding(mesh, logical_spec(s.axes, s.shape(dims), mesh, rules))

    return jax.tree.map(one, specs, is_leaf=is_spec)


def array_sharding(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                   rules: Rules = RULES) -> NamedSharding:
    """NamedSharding for one activation-like array with logical `axes`."""
    return NamedSharding(mesh, logical_spec(axes, shape, mesh, rules))


def batch_shards(mesh: Mesh, rules: Rules = RULES) -> int:
    """How many pieces a batch axis is split into on `mesh`: the product of the mesh axes that `batch`
    maps to (data x fsdp x expert)."""
    return math.prod(mesh.shape[a] for a in rules["batch"])


def bytes_per_device(specs: Any, dims: Mapping[str, int], mesh_shape: Mapping[str, int], itemsize: int,
                     rules: Rules = RULES) -> int:
    """Bytes of the largest shard of a pytree of `ParamSpec` on a mesh of `mesh_shape` (no devices needed):
    each weight's size over the product of the mesh axes its logical axes map to, times `itemsize`."""
    sizes = tuple(int(mesh_shape.get(a, 1)) for a in MESH_AXES)
    mesh = jax.sharding.AbstractMesh(sizes, MESH_AXES)
    total = 0
    for s in jax.tree.leaves(specs, is_leaf=is_spec):
        shape = s.shape(dims)
        spec = logical_spec(s.axes, shape, mesh, rules)
        shards = math.prod(mesh.shape[a] for p in spec if p is not None for a in ((p,) if isinstance(p, str) else p))
        total += math.prod(shape) // shards * itemsize
    return total
