"""The output head for training: the projection onto the vocabulary and the log-softmax, fused, with a
custom VJP, so that no [tokens, V] array outlives its chunk and each chunk needs two vocabulary matmuls.

For a token with final hidden state h [D], projection W [D, V], inverse temperature s and target y:

    l = s * (h @ W)                     scaled logits [V]
    logp_y = l_y - logsumexp(l)         the target's logprob
    entropy = logsumexp(l) - sum(p * l) of p = softmax(l)

The gradient of `logp_y` with respect to h is `s * (W[:, y] - W @ p)`: the gradient of logsumexp is the
softmax (the softmax minus the one-hot, for the log-softmax at y). It does not depend on the cotangent
arriving from the loss, which only scales it per token, so the forward pass computes it right after the
logits, from the same chunk of probabilities (`p @ W.T`, the second matmul), and keeps it as the
residual [M, D]; the backward pass is one multiply. The plain formulation (`jax.checkpoint` over a chunk,
as `jaxrl.rl.train` had) runs the [C, D] x [D, V] matmul three times: forward, rematerialised forward,
and the backward's transposed product.

Full fine-tuning also differentiates the projection W (`w_grad`): `dW = s * h (onehot(y) - p)` summed
over tokens needs each chunk's probabilities again in the backward pass, so that path is the plain one,
autodiff through a rematerialised chunk (`jax.checkpoint`), still one chunk's logits at a time.

Letters as in `jaxrl.model.qwen3`: M tokens, C tokens per chunk, J chunks, W rows of the second matmul.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

TOKENS_PER_CHUNK = 256


def token_logprobs(w_DV: jax.Array, h_MD: jax.Array, targets_M: jax.Array, scale_M: jax.Array, *,
                   entropy_grad: bool = False, w_grad: bool = False,
                   chunk: int = TOKENS_PER_CHUNK) -> tuple[jax.Array, jax.Array]:
    """Logprob of each target under `softmax(scale * (h @ w))` and that distribution's entropy, without
    materialising more than `chunk` tokens' logits at a time.

    Args:
        w_DV: the output projection [D, V] (`qwen3.unembed_matrix`), any float dtype. Frozen unless
            `w_grad` (LoRA trains adapters only).
        h_MD: final-norm hidden states [M, D] in w's dtype; differentiable.
        targets_M: int32 token ids [M].
        scale_M: float32 inverse temperatures [M] (not differentiable).
        entropy_grad: (static) make the entropy differentiable too, at the cost of a third vocabulary
            matmul per chunk in the forward pass; without it a gradient through the entropy raises.
        w_grad: (static) make `w_DV` differentiable too (full fine-tuning): the plain, rematerialised
            chunk (`_plain_chunk`), in which every output is differentiable.
        chunk: (static) tokens per chunk.

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
        logp_JC, entropy_JC = _fused(entropy_grad, w_DV, h_JCD, y_JC, s_JC)
    return logp_JC.reshape(-1)[:n], entropy_JC.reshape(-1)[:n]


def _plain_chunk(w_DV, xs):
    """One chunk's (logp_C, entropy_C) by plain jnp ops, for autodiff through `w_DV` and `h_CD`."""
    h_CD, y_C, s_C = xs
    logits_CV = jnp.einsum("CD,DV->CV", h_CD, w_DV).astype(jnp.float32) * s_C[:, None]
    lse_C = jax.nn.logsumexp(logits_CV, axis=-1)
    logp_C = jnp.take_along_axis(logits_CV, y_C[:, None], axis=-1)[:, 0] - lse_C
    p_CV = jnp.exp(logits_CV - lse_C[:, None])
    return logp_C, lse_C - jnp.sum(p_CV * logits_CV, axis=-1)


def _chunk_forward(w_DV, entropy_grad: bool, xs):
    """One chunk: (logp_C, entropy_C, dlogp/dh [C, D], dentropy/dh [C, D] or None)."""
    h_CD, y_C, s_C = xs
    logits_CV = jnp.einsum("CD,DV->CV", h_CD, w_DV).astype(jnp.float32) * s_C[:, None]
    top_C = jnp.max(logits_CV, axis=-1)
    e_CV = jnp.exp(logits_CV - top_C[:, None])
    total_C = jnp.sum(e_CV, axis=-1)
    lse_C = top_C + jnp.log(total_C)
    p_CV = e_CV / total_C[:, None]
    logp_C = jnp.take_along_axis(logits_CV, y_C[:, None], axis=-1)[:, 0] - lse_C
    entropy_C = lse_C - jnp.sum(p_CV * logits_CV, axis=-1)
    # d logp_y / d logits = onehot(y) - p; d entropy / d logits = -p * (log p + entropy)
    rows_WV = p_CV if not entropy_grad else jnp.concatenate(
        [p_CV, p_CV * (logits_CV - lse_C[:, None] + entropy_C[:, None])])
    back_WD = jnp.einsum("WV,DV->WD", rows_WV.astype(w_DV.dtype), w_DV).astype(jnp.float32)
    target_CD = jnp.take(w_DV, y_C, axis=1).T.astype(jnp.float32)
    dlogp_CD = s_C[:, None] * (target_CD - back_WD[: len(y_C)])
    dentropy_CD = -s_C[:, None] * back_WD[len(y_C):] if entropy_grad else None
    return logp_C, entropy_C, dlogp_CD, dentropy_CD


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(entropy_grad: bool, w_DV, h_JCD, y_JC, s_JC):
    logp, entropy, _, _ = jax.lax.map(partial(_chunk_forward, w_DV, entropy_grad), (h_JCD, y_JC, s_JC))
    return logp, entropy


def _fused_fwd(entropy_grad: bool, w_DV, h_JCD, y_JC, s_JC):
    for name, arg in (("the output projection", w_DV), ("the inverse temperature", s_JC)):
        if arg.perturbed:
            raise ValueError(f"head.token_logprobs: {name} is not differentiable")
    logp, entropy, dlogp, dentropy = jax.lax.map(partial(_chunk_forward, w_DV.value, entropy_grad),
                                                 (h_JCD.value, y_JC.value, s_JC.value))
    dtype = h_JCD.value.dtype  # the residuals in h's dtype: its cotangent's, and half the bytes in bf16
    return (logp, entropy), (dlogp.astype(dtype), None if dentropy is None else dentropy.astype(dtype))


def _fused_bwd(entropy_grad: bool, res, cotangents):
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
