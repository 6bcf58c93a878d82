"""The TPU's paged KV cache: `jaxrl.kv.paged`'s pool attended by JAX's Pallas paged-attention kernel
(`jax.experimental.pallas.ops.tpu.paged_attention`, its pages [K, pages, page, H]), which reads each slot's
pages up to its length straight from HBM. The kernel attends over the cache alone (it returns no
log-sum-exp to merge this step's key into), so each layer writes this step's key/value into its pages first
and the kernel reads positions 0 .. position; the pool is then the layer loop's carry (written in place),
not a per-layer slice. On a CPU mesh it runs in Pallas interpret mode (tests). Letters as in
`jaxrl.model.decoder`; P pages per layer, N table entries.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
from jax.sharding import Mesh, PartitionSpec

from jaxrl.kv.paged import POOL_AXES, Paged
from jaxrl.model import kernels
from jaxrl.model.decoder import KVCache
from jaxrl.parallel.sharding import RULES, logical_spec

KERNEL_BLOCK = 128  # positions the kernel reads per compute block (pages_per_compute_block x page)


@dataclasses.dataclass(frozen=True)
class PagedPallas(Paged):
    """The TPU `jaxrl.kv.kind.CacheKind`: `Paged`'s pool, shapes, inserts and page copies, its decode
    attention the Pallas kernel inside `shard_map` on the step's mesh (`kernel_attention`: heads split as
    the pool is; the pool is never split by slot, so slots share pages). The kernel reads pages in bfloat16
    (it casts what it loads), so a float32 pool attends at bfloat16 precision. It reads each slot's own
    length: one compiled step (`chunks` None)."""

    def chunks(self, positions: int) -> None:
        return None

    def attend_layer(self, q_BKGH, k_BKH, v_BKH, positions_B, cache: KVCache, layer) -> tuple[jax.Array, KVCache]:
        # one row of H per (head, slot), every index given: a write whose window spans the heads ([K, H]
        # per slot) made TPU's layout assignment keep the pool K-minor ({4,0,3,2,1}) in the layer loop and
        # copy it to the kernel's layout at every layer (Qwen3-4B on 4 chips, 2 heads a chip: decode
        # temporaries 1.01 GiB at 2 layers, the whole pool; 0.02 GiB so). A chip holding one head was spared.
        table_BN = cache["pages"]
        page_B, off_B = self.where(table_BN, positions_B)
        heads_K1 = jnp.arange(k_BKH.shape[1])[:, None]
        pools = {n: cache[n].at[heads_K1, layer, page_B, off_B].set(x.transpose(1, 0, 2))
                 for n, x in (("k", k_BKH), ("v", v_BKH))}
        b, k, g, h = q_BKGH.shape
        out_BNH = kernel_attention(q_BKGH.reshape(b, k * g, h), pools["k"], pools["v"], positions_B + 1,
                                   table_BN, layer, self.mesh)
        return out_BNH.reshape(b, k, g, h), {**cache, **pools}

    def write(self, cache: KVCache, k_LBKH, v_LBKH, positions_B) -> KVCache:
        """Nothing: every layer wrote its own (`attend_layer`)."""
        return cache


def _kernel_local(q_BNH, k_KLPCH, v_KLPCH, lengths_B, table_BN, layer, *, interpret: bool) -> jax.Array:
    """The kernel over the arrays one chip holds: the pool seen as [K, L * P, page, H], layer `layer`'s pages
    by index, the table padded with scratch entries to whole compute blocks."""
    k, layers, p, page, h = k_KLPCH.shape
    block = max(1, KERNEL_BLOCK // page)
    n = table_BN.shape[1]
    table_BN = jnp.pad(table_BN, ((0, 0), (0, -n % block))) + layer * p
    run = functools.partial(paged_attention, pages_per_compute_block=block)
    args = (q_BNH, k_KLPCH.reshape(k, layers * p, page, h), v_KLPCH.reshape(k, layers * p, page, h),
            lengths_B.astype(jnp.int32), table_BN)
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            return run(*args)
    return run(*args)


def kernel_attention(q_BNH: jax.Array, k_KLPCH: jax.Array, v_KLPCH: jax.Array, lengths_B: jax.Array,
                     table_BN: jax.Array, layer, mesh: Mesh | None) -> jax.Array:
    """Attention of each slot's query (q [B, N, H], pre-scaled: the kernel has no scale) over positions
    0 .. `lengths_B` - 1 of its pages `table_BN` at layer `layer` (int32 scalar) of the pools [K, L, P,
    page, H]: [B, N, H] in q's dtype. On `mesh` (None: one device) inside `shard_map`: the kv and query
    heads split as the pool is (`POOL_AXES`: `tensor`, then the batch axes, as many as divide K), each chip
    attending every slot over its heads, except over the batch axes the heads leave free, which split the
    slots (where they divide B). Interpret mode on a CPU mesh."""
    local = functools.partial(_kernel_local, interpret=kernels.interpret(mesh))
    layer = jnp.asarray(layer, jnp.int32)
    if mesh is None or mesh.size == 1:
        return local(q_BNH, k_KLPCH, v_KLPCH, lengths_B, table_BN, layer)
    pool_spec = logical_spec(POOL_AXES, k_KLPCH.shape, mesh, RULES)
    heads = pool_spec[0]
    used = set(heads if isinstance(heads, tuple) else (heads,))
    free = tuple(a for a in RULES["batch"] if a not in used and mesh.shape[a] > 1)
    b = q_BNH.shape[0]
    batch = (free if len(free) > 1 else free[0]) if free and b % math.prod(mesh.shape[a] for a in free) == 0 \
        else None
    q_spec = PartitionSpec(batch, heads, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, pool_spec, pool_spec, PartitionSpec(batch),
                                                     PartitionSpec(batch, None), PartitionSpec()),
                         out_specs=q_spec, check_vma=False)(q_BNH, k_KLPCH, v_KLPCH, lengths_B, table_BN, layer)
