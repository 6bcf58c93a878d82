"""The output head for training: the projection onto the vocabulary and the log-softmax, fused, with a
custom VJP, so that no [tokens, V] array is ever materialised and each token needs two vocabulary matmuls.

For a token with final hidden state h [D], projection W [D, V], inverse temperature s and target y:

    l = s * (h @ W)                     scaled logits [V]
    logp_y = l_y - logsumexp(l)         the target's logprob
    entropy = logsumexp(l) - sum(p * l) of p = softmax(l)

The gradient of `logp_y` with respect to h is `s * (W[:, y] - W @ p)`: the gradient of logsumexp is the
softmax (the softmax minus the one-hot, for the log-softmax at y). It does not depend on the cotangent
arriving from the loss, which only scales it per token, so the forward pass computes it along with the
logits, from the same probabilities (`W @ p`, the second matmul), and keeps it as the residual [M, D];
the backward pass is one multiply. The plain formulation (`jax.checkpoint` over a chunk, as
`jaxrl.rl.train` had) runs the [C, D] x [D, V] matmul three times: forward, rematerialised forward, and
the backward's transposed product. The entropy's gradient is `-s W (p (l - logsumexp(l) + entropy))`
(d entropy / d l_v = -p_v (l_v - logsumexp(l) + entropy)), a third matmul, only with `entropy_grad`.

Each chunk of C tokens visits the vocabulary in blocks of v entries (the online softmax of Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax", as flash attention does over keys, Dao et al.
2022), so that the [C, v] logits and the block of W stay in cache; on a CPU the whole [C, V] logits of a
chunk did not, and the matmuls ran at about 60% of the rate of blocked ones. Relative to the running
maximum m of the logits seen so far, a chunk carries

    S = sum_v exp(l_v - m)              so logsumexp(l) = m + log S
    T = sum_v exp(l_v - m) (l_v - m)    so sum(p * l) = m + T / S and entropy = log S - T / S
    A = sum_v exp(l_v - m) W[:, v]      so W @ p = A / S
    R = sum_v exp(l_v - m) (l_v - m) W[:, v]   (entropy_grad) so the entropy's gradient is
                                        -s (R / S - (T / S) (A / S))

and a new maximum m' rescales each by exp(m - m') and moves (l_v - m) by (m - m'): T' = exp(m - m')
(T + (m - m') S), R' = exp(m - m') (R + (m - m') A). The maximum starts at the target's logit l_y (read
directly as h . W[:, y]), finite and no larger than the true maximum, so no `-inf - -inf` arises; the
last block holds the remainder of V, so no padding or mask enters the sums.

Full fine-tuning also differentiates the projection W (`w_grad`): `dW = s * h (onehot(y) - p)` summed
over tokens needs each chunk's probabilities again in the backward pass, so that path is the plain one,
autodiff through a rematerialised chunk (`jax.checkpoint`), still one chunk's logits at a time.

Letters as in `jaxrl.model.decoder`: M tokens, C tokens per chunk, J chunks, v vocabulary entries per block
(a lowercase letter is a slice of its capital's axis), W rows of the second matmul (C, or 2C with the
entropy's gradient).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

# Tokens per chunk of the head: the default, and the least `jaxrl.rl.cpu` picks on CPU, where chunks and
# vocabulary blocks are sized by in-process A/Bs (docs/benchmarks.md, 2026-11-24 and 2026-11-25).
TOKENS_PER_CHUNK = 256


def token_logprobs(w_DV: jax.Array, h_MD: jax.Array, targets_M: jax.Array, scale_M: jax.Array, *,
                   entropy_grad: bool = False, w_grad: bool = False,
                   chunk: int = TOKENS_PER_CHUNK, block: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Logprob of each target under `softmax(scale * (h @ w))` and that distribution's entropy, without
    materialising more than `chunk` x `block` logits at a time (`chunk` x V with `w_grad`).

    Args:
        w_DV: the output projection [D, V] (`decoder.unembed_matrix`), any float dtype. Frozen unless
            `w_grad` (LoRA trains adapters only).
        h_MD: final-norm hidden states [M, D] in w's dtype; differentiable.
        targets_M: int32 token ids [M].
        scale_M: float32 inverse temperatures [M] (not differentiable).
        entropy_grad: (static) make the entropy differentiable too, at the cost of a third vocabulary
            matmul in the forward pass; without it a gradient through the entropy raises.
        w_grad: (static) make `w_DV` differentiable too (full fine-tuning): the plain, rematerialised
            chunk (`_plain_chunk`), in which every output is differentiable.
        chunk: (static) tokens per chunk.
        block: (static) vocabulary entries per block of the online softmax (the last block takes the
            remainder of V); None: the whole vocabulary in one block.

    Returns:
        (logp_M, entropy_M), both float32 [M].

    Raises:
        ValueError (at trace time): a gradient is asked of `w_DV` without `w_grad`, of `scale_M`, or of
            the entropy without `entropy_grad` (and without `w_grad`).
    """
    n, d = h_MD.shape
    c = min(chunk, n)
    pad = (-n) % c
    h_JCD = jnp.pad(h_MD, ((0, pad), (0, 0))).reshape(-1, c, d)
    y_JC = jnp.pad(targets_M, (0, pad)).reshape(-1, c)
    s_JC = jnp.pad(scale_M.astype(jnp.float32), (0, pad), constant_values=1.0).reshape(-1, c)
    if w_grad:
        s_JC = jax.lax.stop_gradient(s_JC)
        logp_JC, entropy_JC = jax.lax.map(jax.checkpoint(partial(_plain_chunk, w_DV)), (h_JCD, y_JC, s_JC))
    else:
        logp_JC, entropy_JC = _fused(entropy_grad, block or w_DV.shape[1], w_DV, h_JCD, y_JC, s_JC)
    return logp_JC.reshape(-1)[:n], entropy_JC.reshape(-1)[:n]


def _plain_chunk(w_DV, xs):
    """One chunk's (logp_C, entropy_C) by plain jnp ops, for autodiff through `w_DV` and `h_CD`."""
    h_CD, y_C, s_C = xs
    logits_CV = jnp.einsum("CD,DV->CV", h_CD, w_DV).astype(jnp.float32) * s_C[:, None]
    lse_C = jax.nn.logsumexp(logits_CV, axis=-1)
    logp_C = jnp.take_along_axis(logits_CV, y_C[:, None], axis=-1)[:, 0] - lse_C
    p_CV = jnp.exp(logits_CV - lse_C[:, None])
    return logp_C, lse_C - jnp.sum(p_CV * logits_CV, axis=-1)


def _chunk_forward(w_VD, block: int, grads: int, xs):
    """One chunk of C tokens, the vocabulary visited `block` entries at a time with an online softmax.

    Args:
        w_VD: the projection as [V, D] rows (each block a contiguous slice).
        block: (static) vocabulary entries per block; the last block holds the remainder of V.
        grads: (static) 0: values only; 1: also dlogp/dh; 2: also dentropy/dh.
        xs: (h_CD in w's dtype, y_C int32, s_C float32).

    Returns:
        (logp_C, entropy_C, dlogp/dh [C, D] or None, dentropy/dh [C, D] or None), float32.
    """
    h_CD, y_C, s_C = xs
    c, d = h_CD.shape
    target_CD = jnp.take(w_VD, y_C, axis=0)
    ly_C = s_C * jnp.einsum("CD,CD->C", h_CD, target_CD, preferred_element_type=jnp.float32)
    # the running max starts at the target's logit: finite and never above the max, so no -inf - -inf
    carry = (ly_C, jnp.zeros_like(ly_C), jnp.zeros_like(ly_C), jnp.zeros((c * max(grads, 1), d), jnp.float32))
    step = partial(_block_step, h_CD, s_C, grads)
    block = min(block, len(w_VD))
    n_full, rest = divmod(len(w_VD), block)
    carry = jax.lax.fori_loop(
        0, n_full, lambda i, cr: step(cr, jax.lax.dynamic_slice_in_dim(w_VD, i * block, block)), carry)
    if rest:
        carry = step(carry, w_VD[n_full * block:])
    m_C, sum_C, tilt_C, acc_WD = carry
    lse_C = m_C + jnp.log(sum_C)
    mean_C = tilt_C / sum_C  # sum_v p_v (l_v - m)
    entropy_C = jnp.log(sum_C) - mean_C
    if not grads:
        return ly_C - lse_C, entropy_C, None, None
    wp_CD = acc_WD[:c] / sum_C[:, None]  # W p
    dlogp_CD = s_C[:, None] * (target_CD.astype(jnp.float32) - wp_CD)
    dentropy_CD = None
    if grads == 2:  # -s W (p (l - lse + entropy)) = -s (W (p (l - m)) - mean W p)
        dentropy_CD = -s_C[:, None] * (acc_WD[c:] / sum_C[:, None] - mean_C[:, None] * wp_CD)
    return ly_C - lse_C, entropy_C, dlogp_CD, dentropy_CD


def _block_step(h_CD, s_C, grads: int, carry, w_vD):
    """Fold one block of v vocabulary entries into the running sums of `_chunk_forward`.

    The carry, float32, relative to the running max m_C of the logits seen so far: (m_C, sum exp(l - m),
    sum exp(l - m) (l - m), and the [C or 2C, D] accumulators sum exp(l - m) w_v and (with grads 2)
    sum exp(l - m) (l - m) w_v). A new max m' rescales each sum by exp(m - m') and shifts (l - m) by m - m'
    (Milakov & Gimelshein 2018, as flash attention's accumulator, Dao et al. 2022).
    """
    m_C, sum_C, tilt_C, acc_WD = carry
    l_Cv = s_C[:, None] * jnp.einsum("CD,vD->Cv", h_CD, w_vD, preferred_element_type=jnp.float32)
    new_C = jnp.maximum(m_C, jnp.max(l_Cv, axis=-1))
    shift_C, rel_Cv = m_C - new_C, l_Cv - new_C[:, None]
    decay_C = jnp.exp(shift_C)
    e_Cv = jnp.exp(rel_Cv)
    tilt_C = decay_C * (tilt_C + shift_C * sum_C) + jnp.sum(e_Cv * rel_Cv, axis=-1)
    sum_C = decay_C * sum_C + jnp.sum(e_Cv, axis=-1)
    if grads:
        rows_Wv = e_Cv if grads == 1 else jnp.concatenate([e_Cv, e_Cv * rel_Cv])
        if grads == 2:
            c = len(m_C)
            acc_WD = jnp.concatenate([acc_WD[:c], acc_WD[c:] + shift_C[:, None] * acc_WD[:c]])
            decay_C = jnp.concatenate([decay_C, decay_C])
        acc_WD = decay_C[:, None] * acc_WD + jnp.einsum("Wv,vD->WD", rows_Wv.astype(w_vD.dtype), w_vD,
                                                        preferred_element_type=jnp.float32)
    return new_C, sum_C, tilt_C, acc_WD


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(entropy_grad: bool, block: int, w_DV, h_JCD, y_JC, s_JC):
    logp, entropy, _, _ = jax.lax.map(partial(_chunk_forward, w_DV.T, block, 0), (h_JCD, y_JC, s_JC))
    return logp, entropy


def _fused_fwd(entropy_grad: bool, block: int, w_DV, h_JCD, y_JC, s_JC):
    for name, arg in (("the output projection", w_DV), ("the inverse temperature", s_JC)):
        if arg.perturbed:
            raise ValueError(f"head.token_logprobs: {name} is not differentiable")
    logp, entropy, dlogp, dentropy = jax.lax.map(partial(_chunk_forward, w_DV.value.T, block, 1 + entropy_grad),
                                                 (h_JCD.value, y_JC.value, s_JC.value))
    dtype = h_JCD.value.dtype  # the residuals in h's dtype: its cotangent's, and half the bytes in bf16
    return (logp, entropy), (dlogp.astype(dtype), None if dentropy is None else dentropy.astype(dtype))


def _fused_bwd(entropy_grad: bool, block: int, res, cotangents):
    dlogp_JCD, dentropy_JCD = res
    g_logp, g_entropy = cotangents
    dh = jnp.zeros(dlogp_JCD.shape, jnp.float32)
    if not isinstance(g_logp, SymbolicZero):
        dh = dh + g_logp[..., None] * dlogp_JCD.astype(jnp.float32)
    if not isinstance(g_entropy, SymbolicZero):
        if not entropy_grad:
            raise ValueError("head.token_logprobs: a gradient through the entropy needs entropy_grad=True")
        dh = dh + g_entropy[..., None] * dentropy_JCD.astype(jnp.float32)
    return None, dh.astype(dlogp_JCD.dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
