"""The ragged paged KV cache: a page pool laid out as JAX's Pallas ragged paged-attention kernel reads it
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention`, the kernel vLLM's TPU backend runs), so one
compiled step serves any mix of prompt chunks and decode tokens (a flat batch of M tokens, `Ragged`), as
vLLM V1 and tpu-inference schedule chunked prefill.

The cache is {"kv": [L, P, page, 2K, H], "pages": int32 [B, N]}: per layer, P pages of `page` positions,
each position's K kv heads as the kernel wants them, key and value of head k at 2k and 2k + 1 (`PAIR_AXES`:
split by whole pairs). [L * P, page, 2K, H] is the same buffer, layer i's page p at index i * P + p, which
is how the kernel sees every layer's pages at once. Page `pages[b, n]` holds slot b's positions
[n * page, (n + 1) * page) in every layer; page 0 is scratch (`jaxrl.kv.paged`), and the host side is the
same `jaxrl.kv.pages.PageAllocator`.

The kernel does not write the cache: each layer of the step (`jaxrl.model.ragged.ragged_step`) writes its
tokens' keys and values into their pages first (one scatter, the pool the layer loop's carry), then
attends. On TPU the attention is the kernel inside `shard_map` (heads split as the pool is); elsewhere the
same `shard_map` runs `reference_attention`, a gather of each token's sequence (the kernel has no interpret
mode on CPU: jaxrl's tests check the reference against the kernel module's own `ref_ragged_paged_attention`
and the engine's numbers against `jaxrl.kv.paged.Paged`'s). Letters as in `jaxrl.model.decoder`; M flat
tokens, S sequences of a step (at most B), P pages per layer, N table entries, X positions of N pages,
C the 2K combined heads.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
from jax.sharding import Mesh, PartitionSpec

from jaxrl.kv.kind import MakeBuffer
from jaxrl.kv.paged import PagePool
from jaxrl.model import kernels
from jaxrl.model.decoder import KVCache
from jaxrl.parallel.sharding import RULES, logical_spec

PAIR_AXES = (None, None, None, "kv_pairs", None)  # the logical axes of the pool [L, P, page, 2K, H]
KV_BLOCK = 128  # positions the kernel reads per block (num_kv_pages_per_block x page), as `jaxrl.kv.pallas`'s
QUERY_BLOCK = 32  # tokens per query block (the kernel's untuned default, `get_tuned_block_sizes`)
MASKED = -0.7 * float(np.finfo(np.float32).max)  # the kernel's mask value: finite, so a masked row is no NaN


@struct.dataclass
class Ragged:
    """Where one ragged step's M tokens go (device arrays; `pack` makes one on the host). Token m belongs
    to slot `slots[m]` (its page table's row) at position `positions[m]`; `valid[m]` is False for padding
    past the last sequence's tokens (written to the scratch page, attending to nothing). The step's S
    sequences, in the order their tokens lie: sequence i is slot `seq_slots[i]`, its tokens
    [cu_q_lens[i], cu_q_lens[i + 1]) the last of its `kv_lens[i]` positions; the first `num_seqs[0]` count,
    the rest are padding. Shapes: int32 [M] (bool `valid`), int32 [S], [S], [S + 1], [1]."""

    positions: jax.Array
    slots: jax.Array
    valid: jax.Array
    seq_slots: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array

    @classmethod
    def one_each(cls, positions_B: jax.Array) -> Ragged:
        """A decode step's batch: every slot one sequence of one token at `positions_B` (int32 [B])."""
        b = positions_B.shape[0]
        rows = jnp.arange(b, dtype=jnp.int32)
        return cls(positions_B, rows, jnp.ones((b,), jnp.bool_), rows, positions_B + 1,
                   jnp.arange(b + 1, dtype=jnp.int32), jnp.full((1,), b, jnp.int32))


def pack(runs: list[tuple[int, int, int]], tokens: int, seqs: int) -> Ragged:
    """The host's `Ragged` (numpy) for `runs`, one (slot, first position, count) per sequence in order, in
    a batch of `tokens` flat tokens and `seqs` sequences.

    Raises:
        ValueError: more tokens or sequences than the batch holds, or a run of no tokens.
    """
    if sum(n for _, _, n in runs) > tokens or len(runs) > seqs or any(n < 1 for _, _, n in runs):
        raise ValueError(f"runs {runs} do not fit a ragged batch of {tokens} tokens and {seqs} sequences, "
                         "one token at least each")
    positions, slots, valid = np.zeros((tokens,), np.int32), np.zeros((tokens,), np.int32), np.zeros((tokens,), bool)
    seq_slots, kv_lens, cu = np.zeros((seqs,), np.int32), np.zeros((seqs,), np.int32), np.zeros((seqs + 1,), np.int32)
    at = 0
    for i, (slot, start, n) in enumerate(runs):
        positions[at:at + n], slots[at:at + n], valid[at:at + n] = np.arange(start, start + n), slot, True
        seq_slots[i], kv_lens[i] = slot, start + n
        at += n
        cu[i + 1:] = at
    return Ragged(positions, slots, valid, seq_slots, kv_lens, cu, np.array([len(runs)], np.int32))


def reference_attention(q_MNH: jax.Array, kv_QPCH: jax.Array, kv_lens_S: jax.Array, table_SN: jax.Array,
                        cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float) -> jax.Array:
    """What `ragged_paged_attention` computes, jittable (its module's `ref_ragged_paged_attention` loops in
    Python over a concrete `num_seqs`): each token's query (q [M, N, H]) over its sequence's positions up to
    its own, read from pages `table_SN` of the pool [pages, page, 2K, H], softmax in float32; [M, N, H] in
    q's dtype, 0 for tokens past the last sequence. Each token gathers its sequence's N pages (an [M, X, K,
    H] copy: a reference, not a fast path)."""
    m, n_heads, h = q_MNH.shape
    s, n = table_SN.shape
    k = kv_QPCH.shape[2] // 2
    token_M = jnp.arange(m, dtype=jnp.int32)
    seq_M = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], token_M, side="right"), s - 1)
    valid_M = token_M < cu_q_lens[num_seqs[0]]
    pos_M = kv_lens_S[seq_M] - (cu_q_lens[seq_M + 1] - token_M)  # the token's position in its sequence
    kv_MXCH = kv_QPCH[table_SN[seq_M]].reshape(m, n * kv_QPCH.shape[1], 2 * k, h).astype(jnp.float32)
    q_MKGH = q_MNH.reshape(m, k, n_heads // k, h).astype(jnp.float32)
    s_MKGX = jnp.einsum("mkgh,mxkh->mkgx", q_MKGH, kv_MXCH[:, :, 0::2]) * sm_scale
    seen_MX = jnp.arange(s_MKGX.shape[-1])[None] <= pos_M[:, None]
    p_MKGX = jax.nn.softmax(jnp.where(seen_MX[:, None, None], s_MKGX, MASKED), axis=-1)
    out_MKGH = jnp.einsum("mkgx,mxkh->mkgh", p_MKGX, kv_MXCH[:, :, 1::2])
    return jnp.where(valid_M[:, None, None], out_MKGH.reshape(m, n_heads, h), 0).astype(q_MNH.dtype)


def _local(q_MNH, kv_LPCCH, kv_lens_S, table_SN, cu_q_lens, num_seqs, layer, *, sm_scale: float, kernel: bool):
    """Attention over the pools one chip holds: every layer's pages as one [L * P, page, 2K, H] (a free
    reshape), layer `layer`'s by index, the table padded with scratch entries to whole kv blocks."""
    layers, p, page, c, h = kv_LPCCH.shape
    block = max(1, KV_BLOCK // page)
    table_SN = jnp.pad(table_SN, ((0, 0), (0, -table_SN.shape[1] % block))) + layer * p
    pool = kv_LPCCH.reshape(layers * p, page, c, h)
    if kernel:
        return ragged_paged_attention(q_MNH, pool, kv_lens_S, table_SN, cu_q_lens, num_seqs, sm_scale=sm_scale,
                                      num_kv_pages_per_block=min(block, table_SN.shape[1]),
                                      num_queries_per_block=min(QUERY_BLOCK, q_MNH.shape[0]))
    return reference_attention(q_MNH, pool, kv_lens_S, table_SN, cu_q_lens, num_seqs, sm_scale=sm_scale)


def pool_attention(q_MNH: jax.Array, kv_LPCCH: jax.Array, kv_lens_S: jax.Array, table_SN: jax.Array,
                   cu_q_lens: jax.Array, num_seqs: jax.Array, layer, mesh: Mesh | None, *,
                   sm_scale: float) -> jax.Array:
    """Ragged attention of q [M, N, H] (`Ragged`'s sequences, pages `table_SN` int32 [S, N]) over layer
    `layer` (int32 scalar) of the pool [L, P, page, 2K, H]: [M, N, H] in q's dtype (the pool's). On `mesh`
    (None: one device) inside `shard_map`, the kv and query heads split as the pool is (`PAIR_AXES`), every
    chip attending every token over its heads; the kernel on an accelerator mesh (the kind is TPU's,
    `jaxrl.model.kernels.cache_kind`), `reference_attention` on a CPU mesh (`kernels.interpret`)."""
    local = functools.partial(_local, sm_scale=sm_scale, kernel=not kernels.interpret(mesh))
    layer = jnp.asarray(layer, jnp.int32)
    args = (q_MNH, kv_LPCCH, kv_lens_S, table_SN, cu_q_lens, num_seqs, layer)
    if mesh is None or mesh.size == 1:
        return local(*args)
    heads = logical_spec(PAIR_AXES, kv_LPCCH.shape, mesh, RULES)[3]
    q_spec, rest = PartitionSpec(None, heads, None), (PartitionSpec(),) * 5
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, PartitionSpec(None, None, None, heads, None), *rest),
                         out_specs=q_spec, check_vma=False)(*args)


@dataclasses.dataclass(frozen=True)
class RaggedPaged(PagePool):
    """The ragged `jaxrl.kv.kind.CacheKind` for `cfg`, `slots` slots of `max_seq_len` positions, in a pool of
    `kv_cache_tokens` positions (None: slots x `max_seq_len`) in pages of `page` positions (`PagePool`). Its
    decode step is a ragged step of one token a slot (`decode`); `step` takes any `Ragged` batch. One
    compiled step whatever the positions (`chunks` None).

    Raises:
        ValueError: a pool too small for one sequence (`jaxrl.kv.paged.pool_pages`).
    """

    def cache(self, make: MakeBuffer) -> KVCache:
        """{"kv": [L, P, page, 2K, H], "pages": int32 [B, N]}."""
        c = self.cfg
        shape = (c.num_layers, self.num_pages, self.page, 2 * c.num_kv_heads, c.head_dim)
        return {"kv": make(shape, PAIR_AXES), "pages": make((self.slots, -(-self.max_seq_len // self.page)),
                                                            (None, None), jnp.int32)}

    def insert(self, cache: KVCache, prefix_cache: KVCache | None, slot: jax.Array,
               pages: jax.Array | None = None) -> KVCache:
        """A prefill's {"k","v"} [L, 1, T, K, H] written to `pages` (`PageAllocator.assign`'s, int32
        [ceil(T / page)]; 0, the scratch page, where nothing is written); None: nothing to write (shared)."""
        if prefix_cache is None:
            return cache
        k, v = prefix_cache["k"][:, 0], prefix_cache["v"][:, 0]
        layers, t, nk, h = k.shape
        pad = -t % self.page
        kv_LTCH = jnp.stack([k, v], axis=3).reshape(layers, t, 2 * nk, h)
        kv_LTCH = jnp.pad(kv_LTCH, ((0, 0), (0, pad), (0, 0), (0, 0))).astype(cache["kv"].dtype)
        pool = cache["kv"].at[:, pages].set(kv_LTCH.reshape(layers, (t + pad) // self.page, self.page, 2 * nk, h))
        return {**cache, "kv": pool}

    def copy_pages(self, cache: KVCache, src_B: jax.Array, dst_B: jax.Array) -> KVCache:
        """`cache` with pool pages `src_B` copied to `dst_B` (int32 [B] each; 0 to 0 where nothing is copied):
        copy on write (`PageAllocator.step`)."""
        return {**cache, "kv": cache["kv"].at[:, dst_B].set(cache["kv"][:, src_B])}

    def extend_cache(self, cache: KVCache, read_N: jax.Array) -> KVCache:
        """Pages `read_N` (int32 [N]) of every layer as a prefill's dense cache {"k","v"} [L, 1, N * page, K, H]."""
        layers, _, page, c, h = cache["kv"].shape
        kv_LXCH = cache["kv"][:, read_N].reshape(layers, 1, read_N.shape[0] * page, c, h)
        return {"k": kv_LXCH[..., 0::2, :], "v": kv_LXCH[..., 1::2, :]}

    def chunks(self, positions: int) -> None:
        return None

    def decode(self, model, layers, tokens_B, positions_B, cache, chunks, mesh: Mesh):
        """One token a slot (`Ragged.one_each`): hidden states [B, 1, D] and the cache. A free slot's table
        row is scratch entries: it writes and reads the scratch page."""
        hidden_MD, cache = self.step(model, tokens_B, Ragged.one_each(positions_B), cache, mesh, layers)
        return hidden_MD[:, None], cache

    def step(self, model, tokens_M: jax.Array, batch: Ragged, cache: KVCache, mesh: Mesh | None, layers=None):
        """The ragged step over `tokens_M` (int32 [M]) placed by `batch` (`jaxrl.model.ragged.ragged_step`;
        `layers` its unrolled per-layer weights, or None): hidden states [M, D] and the cache with every valid
        token's keys and values in its slot's pages."""
        table_BN = cache["pages"]
        page_M = jnp.where(batch.valid, table_BN[batch.slots, batch.positions // self.page], 0)
        off_M = batch.positions % self.page
        table_SN = table_BN[batch.seq_slots]
        sm_scale = 1.0 / math.sqrt(self.cfg.head_dim)

        def attend(q_MNH, k_MKH, v_MKH, c, layer):
            m, nk, h = k_MKH.shape
            pool = c["kv"]
            kv_MCH = jnp.stack([k_MKH, v_MKH], axis=2).reshape(m, 2 * nk, h).astype(pool.dtype)
            pool = pool.at[layer, page_M, off_M].set(kv_MCH)
            out_MNH = pool_attention(q_MNH.astype(pool.dtype), pool, batch.kv_lens, table_SN, batch.cu_q_lens,
                                     batch.num_seqs, layer, mesh, sm_scale=sm_scale)
            return out_MNH, {**c, "kv": pool}

        return model.ragged(tokens_M, batch.positions, cache, attend, mesh=mesh, layers=layers)
