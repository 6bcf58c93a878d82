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
residual [N, D]; the backward pass is one multiply. The plain formulation (`jax.checkpoint` over a chunk,
as `jaxrl.rl.train` had) runs the [C, D] x [D, V] matmul three times: forward, rematerialised forward,
and the backward's transposed product.

Letters as in `jaxrl.model.qwen3`; N tokens, C tokens per chunk, M chunks.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

TOKENS_PER_CHUNK = 256


def token_logprobs(w_DV: jax.Array, h_ND: jax.Array, targets_N: jax.Array, scale_N: jax.Array, *,
                   entropy_grad: bool = False,
                   chunk: int = TOKENS_PER_CHUNK) -> tuple[jax.Array, jax.Array]:
    """Logprob of each target under `softmax(scale * (h @ w))` and that distribution's entropy, without
    materialising more than `chunk` tokens' logits at a time.

    Args:
        w_DV: the output projection [D, V] (`qwen3.unembed_matrix`), any float dtype. Frozen: it cannot
            be differentiated (LoRA trains adapters only).
        h_ND: final-norm hidden states [N, D] in w's dtype; the one differentiable input.
        targets_N: int32 token ids [N].
        scale_N: float32 inverse temperatures [N] (not differentiable).
        entropy_grad: (static) make the entropy differentiable too, at the cost of a third vocabulary
            matmul per chunk in the forward pass; without it a gradient through the entropy raises.
        chunk: (static) tokens per chunk.

    Returns:
        (logp_N, entropy_N), both float32 [N].

    Raises:
        ValueError (at trace time): a gradient is asked of `w_DV`, of `scale_N`, or of the entropy
            without `entropy_grad`.
    """
    n, d = h_ND.shape
    c = min(chunk, n)
    pad = (-n) % c
    h_MCD = jnp.pad(h_ND, ((0, pad), (0, 0))).reshape(-1, c, d)
    y_MC = jnp.pad(targets_N, (0, pad)).reshape(-1, c)
    s_MC = jnp.pad(scale_N.astype(jnp.float32), (0, pad), constant_values=1.0).reshape(-1, c)
    logp_MC, entropy_MC = _fused(entropy_grad, w_DV, h_MCD, y_MC, s_MC)
    return logp_MC.reshape(-1)[:n], entropy_MC.reshape(-1)[:n]


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
    rows_XV = p_CV if not entropy_grad else jnp.concatenate(
        [p_CV, p_CV * (logits_CV - lse_C[:, None] + entropy_C[:, None])])
    back_XD = jnp.einsum("XV,DV->XD", rows_XV.astype(w_DV.dtype), w_DV).astype(jnp.float32)
    target_CD = jnp.take(w_DV, y_C, axis=1).T.astype(jnp.float32)
    dlogp_CD = s_C[:, None] * (target_CD - back_XD[: len(y_C)])
    dentropy_CD = -s_C[:, None] * back_XD[len(y_C):] if entropy_grad else None
    return logp_C, entropy_C, dlogp_CD, dentropy_CD


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(entropy_grad: bool, w_DV, h_MCD, y_MC, s_MC):
    logp, entropy, _, _ = jax.lax.map(partial(_chunk_forward, w_DV, entropy_grad), (h_MCD, y_MC, s_MC))
    return logp, entropy


def _fused_fwd(entropy_grad: bool, w_DV, h_MCD, y_MC, s_MC):
    for name, arg in (("the output projection", w_DV), ("the inverse temperature", s_MC)):
        if arg.perturbed:
            raise ValueError(f"head.token_logprobs: {name} is not differentiable")
    logp, entropy, dlogp, dentropy = jax.lax.map(partial(_chunk_forward, w_DV.value, entropy_grad),
                                                 (h_MCD.value, y_MC.value, s_MC.value))
    dtype = h_MCD.value.dtype  # the residuals in h's dtype: its cotangent's, and half the bytes in bf16
    return (logp, entropy), (dlogp.astype(dtype), None if dentropy is None else dentropy.astype(dtype))


def _fused_bwd(entropy_grad: bool, res, cotangents):
    dlogp_MCD, dentropy_MCD = res
    g_logp, g_entropy = cotangents
    dh = jnp.zeros(dlogp_MCD.shape, jnp.float32)
    if not isinstance(g_logp, SymbolicZero):
        dh = dh + g_logp[..., None] * dlogp_MCD.astype(jnp.float32)
    if not isinstance(g_entropy, SymbolicZero):
        if not entropy_grad:
            raise ValueError("head.token_logprobs: a gradient through the entropy needs entropy_grad=True")
        dh = dh + g_entropy[..., None] * dentropy_MCD.astype(jnp.float32)
    return None, dh.astype(dlogp_MCD.dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
