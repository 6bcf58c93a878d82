"""The GPU's paged KV cache: `jaxrl.kv.paged`'s pool attended by JAX's Pallas Triton paged-attention kernel
(`jax.experimental.pallas.ops.gpu.paged_attention`), which reads each slot's pages up to its length where they
lie in the pool: no gathered [B, C, K, H] copy of the chunks a step reads, as the reference `Paged` makes (its
temporaries: docs/benchmarks.md, `scripts/kv_temporaries.py`). Everything else is `jaxrl.kv.pallas.PagedPallas`'s:
each layer writes this step's key and value into its page first and the kernel reads positions 0 .. position,
inside `shard_map` with the heads split as the pool is. On a CPU mesh it runs in Pallas interpret mode (tests).
Letters as in `jaxrl.model.decoder`; X pages of the pool seen as [K, L * P, page, H], N table entries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

from jaxrl.kv.pallas import KERNEL_BLOCK, PagedPallas

SPLITS = 16
"""Parts of a slot's pages the kernel attends in parallel, merged after by their log-sum-exps (its `k_splits`,
its default): parallel work for a GPU's many cores when the batch is small; a short table gets fewer."""


def gpu_page_attention(q_BNH: jax.Array, k_KXCH: jax.Array, v_KXCH: jax.Array, lengths_B: jax.Array,
                       table_BN: jax.Array, *, interpret: bool) -> jax.Array:
    """The Triton paged attention of each slot's query (q [B, N, H], pre-scaled: the kernel has no scale)
    over positions 0 .. `lengths_B` - 1 (int32 [B]) of its pages `table_BN` (int32 [B, N], indices into X)
    of the pools [K, X, page, H]: [B, N, H] in q's dtype.

    The kernel multiplies in the pool's dtype (q is cast to it: Triton's dot takes one dtype; bfloat16 in a
    run), accumulating in float32. It reads `KERNEL_BLOCK` positions per compute block in up to `SPLITS`
    parts of the table, so the table is padded with entries of page 0 to a whole number of both (past every
    length: the kernel stops at each slot's length and never reads them). Its query heads per kv head are
    padded to 16 (the kernel's `block_h`): compute the step has to spare, its bytes are the pages'.
    """
    block = max(1, KERNEL_BLOCK // k_KXCH.shape[2])
    n = table_BN.shape[1]
    splits = max(1, min(SPLITS, -(-n // block)))
    table_BN = jnp.pad(table_BN, ((0, 0), (0, -n % (splits * block))))
    out_BNH = paged_attention(q_BNH.astype(k_KXCH.dtype), k_KXCH, v_KXCH, table_BN, lengths_B,
                              pages_per_compute_block=block, k_splits=splits, interpret=interpret)
    return out_BNH.astype(q_BNH.dtype)


@dataclasses.dataclass(frozen=True)
class PagedTriton(PagedPallas):
    """The GPU `jaxrl.kv.kind.CacheKind`: `PagedPallas` (the pool, its per-layer write, one compiled step
    over each slot's own length) with the Triton kernel as its page attention (`gpu_page_attention`).
    `jaxrl.model.kernels.cache_kind` gives it to a GPU engine where `PAGED_KERNEL_ON_GPU`."""

    @staticmethod
    def page_attention(q_BNH, k_KXCH, v_KXCH, lengths_B, table_BN, *, interpret: bool) -> jax.Array:
        """The kernel each device runs over the pool's pages (`gpu_page_attention`)."""
        return gpu_page_attention(q_BNH, k_KXCH, v_KXCH, lengths_B, table_BN, interpret=interpret)
