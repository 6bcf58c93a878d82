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
    length: one compiled step (`chunks` None). `interpret`: Pallas interpret mode (None: on a CPU mesh,
    `jaxrl.model.kernels.interpret`; False lowers the kernel itself from any host, for its accelerator).
    A subclass runs another kernel over the same pool by its own `page_attention` (`jaxrl.kv.triton`)."""

    interpret: bool | None = None

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
                                   table_BN, layer, self.mesh, kernel=self.page_attention, interpret=self.interpret)
        return out_BNH.reshape(b, k, g, h), {**cache, **pools}

    def write(self, cache: KVCache, k_LBKH, v_LBKH, positions_B) -> KVCache:
        """Nothing: every layer wrote its own (`attend_layer`)."""
        return cache

    @staticmethod
    def page_attention(q_BNH, k_KXCH, v_KXCH, lengths_B, table_BN, *, interpret: bool) -> jax.Array:
        """The kernel each chip runs over the pool's pages (`tpu_page_attention`)."""
        return tpu_page_attention(q_BNH, k_KXCH, v_KXCH, lengths_B, table_BN, interpret=interpret)


def tpu_page_attention(q_BNH: jax.Array, k_KXCH: jax.Array, v_KXCH: jax.Array, lengths_B: jax.Array,
                       table_BN: jax.Array, *, interpret: bool) -> jax.Array:
    """JAX's Pallas TPU paged attention of each slot's query (q [B, N, H], pre-scaled) over positions
    0 .. `lengths_B` - 1 (int32 [B]) of its pages `table_BN` (int32 [B, N], indices into X) of the pools
    [K, X, page, H]: [B, N, H]. The table is padded with entries of page 0 to whole compute blocks of
    `KERNEL_BLOCK` positions (past every length: never read)."""
    block = max(1, KERNEL_BLOCK // k_KXCH.shape[2])
    n = table_BN.shape[1]
    run = functools.partial(paged_attention, q_BNH, k_KXCH, v_KXCH, lengths_B,
                            jnp.pad(table_BN, ((0, 0), (0, -n % block))), pages_per_compute_block=block)
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            return run()
    return run()


def _kernel_local(q_BNH, k_KLPCH, v_KLPCH, lengths_B, table_BN, layer, *, kernel, interpret: bool) -> jax.Array:
    """`kernel` over the arrays one chip holds: the pool seen as [K, L * P, page, H], layer `layer`'s pages
    by index."""
    k, layers, p, page, h = k_KLPCH.shape
    return kernel(q_BNH, k_KLPCH.reshape(k, layers * p, page, h), v_KLPCH.reshape(k, layers * p, page, h),
                  lengths_B.astype(jnp.int32), table_BN + layer * p, interpret=interpret)


def kernel_attention(q_BNH: jax.Array, k_KLPCH: jax.Array, v_KLPCH: jax.Array, lengths_B: jax.Array,
                     table_BN: jax.Array, layer, mesh: Mesh | None, *, kernel=tpu_page_attention,
                     interpret: bool | None = None) -> jax.Array:
    """Attention of each slot's query (q [B, N, H], pre-scaled: the kernel has no scale) over positions
    0 .. `lengths_B` - 1 of its pages `table_BN` at layer `layer` (int32 scalar) of the pools [K, L, P,
    page, H]: [B, N, H] in q's dtype. On `mesh` (None: one device) inside `shard_map`: the kv and query
    heads split as the pool is (`POOL_AXES`: `tensor`, then the batch axes, as many as divide K), each chip
    attending every slot over its heads, except over the batch axes the heads leave free, which split the
    slots (where they divide B). `kernel`: the paged attention each chip runs (`tpu_page_attention`'s
    signature); `interpret`: in Pallas interpret mode (None: on a CPU mesh)."""
    interpret = kernels.interpret(mesh) if interpret is None else interpret
    local = functools.partial(_kernel_local, kernel=kernel, interpret=interpret)
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
