"""Causal self-attention for training and prefill, one function over several implementations.

`attention(q, k, v, ...)` is what the model calls (`jaxrl.model.decoder`); `jaxrl.model.kernels.attention_kernel`
picks how it runs, from the platform of the mesh's devices (`jaxrl.model.kernels`, the one module that
reads the platform):

  * "einsum": the reference, and the CPU path. float32 scores [B, K, G, T, S] and their softmax,
    materialised (T x S per head), masked by position (`mask`). Below `kernels.MIN_KERNEL_T` tokens every
    platform runs it.
  * "splash": on TPU (heads of a multiple of 128), JAX's Pallas splash attention
    (`jax.experimental.pallas.ops.tpu.splash_attention`, the kernel MaxText and Tunix train with): blocks of
    `block` queries and keys, causal blocks above the diagonal skipped, packed rows by `SegmentIds`,
    grouped-query attention native, its own custom VJP (no second-order AD). Run inside `shard_map`, heads
    on `tensor` and the batch on the mesh axes the `batch` rule maps to, one kernel per chip over its heads.
    On CPU it runs in Pallas interpret mode (tests only: slow).
  * "cudnn": on GPU, `jax.nn.dot_product_attention(implementation="cudnn")` (cuDNN flash attention),
    for rows of one segment in bfloat16 or float16 with a head dim of at most 128 and a multiple of 8.
  * "xla": on GPU otherwise, `jax.nn.dot_product_attention(implementation="xla")` with the mask.

The engine's decode step attends over its KV cache as the cache's kind does (`jaxrl.kv`, picked by
`jaxrl.kv.pick`).

The kernels mask by index (query i sees keys j <= i of its segment); the einsum by position (`mask`:
keys at a position <= the query's). The two agree wherever each segment's positions count up by one
from its first token, as training (`jaxrl.rl.train`: 0..T-1 per row, or from 0 per packed sample) and
prefill (0..T-1) guarantee. They differ only on padding that shares a segment with nothing real
(`jaxrl.rl.sft.pack`'s segment 0 at position 0): such queries attend to the padding before them
instead of all of it, outputs no loss reads and no real token sees.

Letters as in `jaxrl.model.decoder` (B batch, T queries, S keys = T, N query heads, K kv heads, G = N / K,
H head dim).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import Mesh, PartitionSpec

from jaxrl.model import kernels
from jaxrl.model.kernels import IMPLEMENTATIONS, MIN_KERNEL_T, Implementation
from jaxrl.parallel.sharding import RULES, logical_spec

KERNEL_BLOCKS = (512, 256, 128)  # splash's block sizes, the largest dividing T first (MaxText uses 512)
LANE = 128  # splash runs T padded up to a multiple of this (`padded_length`)
RESIDUALS = "attention_residuals"  # the checkpoint name of splash's saved output and logsumexp (`remat_policy`)


def padded_length(t: int) -> int:
    """T as splash runs it: `t` rounded up to a multiple of `LANE` (a prefill bucket of 4095 tokens runs
    as 4096; the padding keys come after every real query, so causality keeps them out)."""
    return -(-t // LANE) * LANE


def kernel_block(t: int) -> int | None:
    """Splash's query and key block for T = `t` tokens: the largest of `KERNEL_BLOCKS` that divides
    `padded_length(t)`; None when `t` < `MIN_KERNEL_T` (then the einsum runs)."""
    if t < MIN_KERNEL_T:
        return None
    return next(b for b in KERNEL_BLOCKS if padded_length(t) % b == 0)


def mask(positions_BT: jax.Array, key_pos_BS: jax.Array, segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Which keys each query attends to, bool [B, T, S]: those at a position <= its own (causal) and, with
    `segment_ids_BT` (int32 [B, T], self-attention only, so S = T), of its own segment, so the samples
    packed into one row never see each other (each sample's positions count from 0)."""
    mask_BTS = key_pos_BS[:, None, :] <= positions_BT[:, :, None]
    if segment_ids_BT is not None:
        mask_BTS &= segment_ids_BT[:, None, :] == segment_ids_BT[:, :, None]
    return mask_BTS


def einsum_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    """Softmax attention (Vaswani et al. 2017) with grouped-query heads (Ainslie et al. 2023), scores
    scaled by 1/sqrt(H) and computed in float32, masked by `mask_BTS` (bool [B, T, S], `mask`).
    q [B, T, N, H], k and v [B, S, K, H]; returns [B, T, N, H] in q's dtype. Also attends over a KV cache
    (S > T, the engine's reference decode in `decoder.forward`)."""
    b, t, n, hd = q_BTNH.shape
    nk = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(b, t, nk, n // nk, hd)
    scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH.astype(q_BTKGH.dtype)).astype(jnp.float32)
    scores_BKGTS = scores_BKGTS / math.sqrt(hd)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, -1e30)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(q_BTNH.dtype)
    attn_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH.astype(q_BTNH.dtype))
    return attn_BTKGH.reshape(b, t, n, hd)


def _splash_kernel(heads: int, t: int, block: int, interpret: bool) -> splash.SplashAttentionKernel:
    """A causal splash kernel over `heads` query heads of `t` tokens, every block (forward, and the
    backward's separate dq and dk/dv kernels) `block` square, its residuals named `RESIDUALS`. Not the
    fused backward: it keeps a dq partial per key block ([T / block, heads, T, H]), scratch quadratic
    in T (4.1 GiB a chip at 32,768 tokens, 8 heads of 128, against 0.26 GiB at 8,192; compiled for v5p).
    Block sizes are explicit: the kernel's tuned defaults read `jax.devices()`, the host's CPU when
    compiling for a TPU topology. Built in the caller's trace (its block tables become that trace's
    constants; the mask's processing is cached by the kernel's module)."""
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    causal = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * heads)
    return splash.make_splash_mha(causal, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  residual_checkpoint_name=RESIDUALS, interpret=interpret)


def _splash_local(q_BTNH, k_BTKH, v_BTKH, seg_BT, *, block: int, interpret: bool) -> jax.Array:
    """Splash attention over the arrays one chip holds: q pre-scaled by 1/sqrt(H) (the kernel has no
    scale), heads moved before T as the kernel takes them, the kernel vmapped over the batch."""
    b, t, n, hd = q_BTNH.shape
    kernel = _splash_kernel(n, t, block, interpret)
    q_BNTH = jnp.swapaxes(q_BTNH * jnp.asarray(1.0 / math.sqrt(hd), q_BTNH.dtype), 1, 2)
    k_BKTH = jnp.swapaxes(k_BTKH.astype(q_BTNH.dtype), 1, 2)
    v_BKTH = jnp.swapaxes(v_BTKH.astype(q_BTNH.dtype), 1, 2)
    if seg_BT is None:
        out_BNTH = jax.vmap(kernel)(q_BNTH, k_BKTH, v_BKTH)
    else:
        out_BNTH = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(q=s, kv=s)))(
            q_BNTH, k_BKTH, v_BKTH, seg_BT)
    return jnp.swapaxes(out_BNTH, 1, 2)


def _kv_repeats(n: int, nk: int, tensor: int) -> int:
    """How many times each kv head is repeated so that the kv heads split over `tensor` chips as the
    query heads do (each chip's query heads then read only its own kv heads): 1 when `tensor` divides
    `nk`; else the fewest r with `tensor` | nk * r and nk * r | n; 0 when there is none (the heads are
    then not split)."""
    if nk % tensor == 0:
        return 1
    r = tensor // math.gcd(nk, tensor)
    return r if n % (nk * r) == 0 else 0


def splash_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
                     segment_ids_BT: jax.Array | None, mesh: Mesh | None, *, block: int | None = None,
                     interpret: bool | None = None) -> jax.Array:
    """Causal splash attention on `mesh` (None: one device), q [B, T, N, H], k and v [B, T, K, H] ->
    [B, T, N, H] in q's dtype; `segment_ids_BT` int32 [B, T] or None (one segment a row).

    T is padded to `padded_length(T)` at the end (zeros, and the last segment id for the padding), and the
    padding's outputs dropped. Inside `shard_map`: the batch over the mesh axes of the `batch` rule that
    divide B, the query and kv heads over `tensor` (kv heads repeated when `tensor` does not divide them,
    `_kv_repeats`), T whole. `block`: the kernel's block (default `kernel_block(T)`); `interpret`: Pallas
    interpret mode (default: on a CPU mesh).

    Raises:
        ValueError: T < `MIN_KERNEL_T`, or a `block` that does not divide the padded T.
    """
    b, t, n, hd = q_BTNH.shape
    tp = padded_length(t)
    block = block or kernel_block(t)
    if block is None or tp % block:
        raise ValueError(f"splash attention needs a block (a multiple of 128) dividing T = {tp}; got {block}")
    if tp != t:
        pad = [(0, 0), (0, tp - t), (0, 0), (0, 0)]
        q_BTNH, k_BTKH, v_BTKH = (jnp.pad(x, pad) for x in (q_BTNH, k_BTKH, v_BTKH))
        if segment_ids_BT is not None:
            segment_ids_BT = jnp.pad(segment_ids_BT, [(0, 0), (0, tp - t)], mode="edge")
    return _splash_sharded(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, mesh, block, interpret)[:, :t]


def _splash_sharded(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, mesh, block, interpret) -> jax.Array:
    """`splash_attention` on T a multiple of `block`: one kernel per chip inside `shard_map`."""
    n = q_BTNH.shape[2]
    interpret = kernels.interpret(mesh) if interpret is None else interpret
    local = functools.partial(_splash_local, block=block, interpret=interpret)
    if mesh is None or mesh.size == 1:
        return local(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)
    nk = k_BTKH.shape[2]
    tensor = mesh.shape.get("tensor", 1)
    reps = _kv_repeats(n, nk, tensor) if n % tensor == 0 else 0
    if reps > 1:
        k_BTKH, v_BTKH = (jnp.repeat(x, reps, axis=2) for x in (k_BTKH, v_BTKH))
    heads = "heads" if reps else None
    q_spec = logical_spec(("batch", None, heads, None), q_BTNH.shape, mesh, RULES)
    kv_spec = logical_spec(("batch", None, heads, None), k_BTKH.shape, mesh, RULES)
    seg_spec = PartitionSpec(q_spec[0], None)
    if segment_ids_BT is None:
        return jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec, check_vma=False)(q_BTNH, k_BTKH, v_BTKH)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                         check_vma=False)(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)


def attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, positions_BT: jax.Array,
              segment_ids_BT: jax.Array | None = None, mesh: Mesh | None = None,
              impl: Implementation | None = None, mask_BTS: jax.Array | None = None) -> jax.Array:
    """Causal self-attention of training and prefill: q [B, T, N, H], k and v [B, T, K, H] (N a multiple
    of K) -> [B, T, N, H] in q's dtype.

    Args:
        positions_BT: int32 positions of the tokens (the einsum's mask; the kernels mask by index, which
            agrees where positions count up by one within each segment: see the module docstring).
        segment_ids_BT: int32 [B, T]: a query attends only to keys of its own segment (rows packing
            several samples). None: one segment a row.
        mesh: the mesh the arrays live on; its platform picks the implementation
            (`jaxrl.model.kernels.attention_kernel`).
            None: the einsum, unless `impl` says otherwise.
        impl: force one of `IMPLEMENTATIONS` (tests, and `jaxrl compile`'s comparisons).
        mask_BTS: the einsum's mask (`mask`), when the caller built it once for all layers.

    Raises:
        ValueError: an unknown `impl`, or "splash" below `MIN_KERNEL_T` tokens.
    """
    _, t, _, hd = q_BTNH.shape
    if impl is None:
        impl = kernels.attention_kernel(kernels.platform_of(mesh), t, q_BTNH.dtype, hd, segment_ids_BT is not None)
    match impl:
        case "einsum":
            if mask_BTS is None:
                mask_BTS = mask(positions_BT, positions_BT, segment_ids_BT)
            return einsum_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS)
        case "splash":
            return splash_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, mesh)
        case "cudnn":
            return jax.nn.dot_product_attention(q_BTNH, k_BTKH.astype(q_BTNH.dtype), v_BTKH.astype(q_BTNH.dtype),
                                                is_causal=True, implementation="cudnn")
        case "xla":
            if mask_BTS is None:
                mask_BTS = mask(positions_BT, positions_BT, segment_ids_BT)
            return jax.nn.dot_product_attention(q_BTNH, k_BTKH.astype(q_BTNH.dtype), v_BTKH.astype(q_BTNH.dtype),
                                                mask=mask_BTS[:, None], implementation="xla")
        case _:
            raise ValueError(f"unknown attention implementation {impl!r}; expected one of {IMPLEMENTATIONS}")


def remat_policy(impl: Implementation):
    """What a rematerialised layer keeps for its backward pass (`jax.checkpoint`'s policy): with splash,
    the kernel's output and logsumexp (`RESIDUALS`, [B, N, T] and [B, T, N, H] a layer), so the backward
    pass does not run the forward kernel a second time; otherwise nothing (every activation recomputed)."""
    if impl == "splash":
        return jax.checkpoint_policies.save_only_these_names(RESIDUALS)
    return jax.checkpoint_policies.nothing_saveable
