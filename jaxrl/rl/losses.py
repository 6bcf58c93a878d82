"""RL math: group advantages and the policy loss, as pure functions.

Sources: the group-relative advantage without std normalisation and the masked importance-sampling
loss follow prime-rl (PrimeIntellect-ai/prime-rl, `trainer/rl/loss.py`): the importance ratio
`exp(logp_trainer - logp_inference)` weights a policy-gradient term through a stop-gradient, tokens whose
ratio left `[mask_low, mask_high]` are masked out, and a small `(log ratio)^2` term keeps the trainer
close to the policy that sampled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """`A_i = r_i - mean(r over i's group)` (GRPO's baseline without std division, as in prime-rl).

    Args:
        rewards: float [G * group_size], groups stored contiguously.
    Returns:
        float32 [G * group_size].
    Raises:
        ValueError: the length is not a multiple of `group_size`.
    """
    r = np.asarray(rewards, dtype=np.float32)
    if r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    g = r.reshape(-1, group_size)
    return (g - g.mean(axis=1, keepdims=True)).reshape(-1)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """mask_low / mask_high: bounds on the per-token importance ratio; tokens outside are masked.
    kl_coef: weight of the `(log ratio)^2` term."""

    mask_low: float = 0.125
    mask_high: float = 8.0
    kl_coef: float = 1e-3


def policy_loss(logp_BT: jax.Array, inference_logp_BT: jax.Array, advantages_B: jax.Array,
                loss_mask_BT: jax.Array, cfg: LossConfig = LossConfig()) -> tuple[jax.Array, dict]:
    """Masked importance-sampling policy-gradient loss (prime-rl), normalised per loss token.

    Per sampled token t of sample b:
        ratio = exp(logp - logp_inference)
        keep  = mask_low <= ratio <= mask_high
        loss  = keep * (-stop_grad(ratio) * A_b * logp + kl_coef * (logp - logp_inference)^2)
    summed over kept tokens and divided by the number of loss tokens in the batch.

    Args:
        logp_BT: float32 trainer logprobs of the sampled tokens [B, T] (differentiable).
        inference_logp_BT: float32 engine logprobs of the same tokens [B, T].
        advantages_B: float32 [B].
        loss_mask_BT: bool [B, T], True on sampled tokens.
    Returns:
        scalar loss, and metrics over loss tokens: `policy/clip_fraction` (share masked by the ratio),
        `policy/kl` (mean of `ratio - 1 - log ratio`: the k3 estimator of KL(engine || trainer) from
        tokens the engine sampled, Schulman 2020 "Approximating KL Divergence"; prime-rl's
        `mismatch_kl`; >= 0 per token, unlike the k1 mean of `-log ratio`), `policy/ratio` (mean ratio).
    """
    mask = loss_mask_BT.astype(jnp.float32)
    n = jnp.maximum(mask.sum(), 1.0)
    log_ratio = logp_BT - inference_logp_BT
    ratio = jnp.exp(log_ratio)
    keep = mask * ((ratio >= cfg.mask_low) & (ratio <= cfg.mask_high))
    pg = -jax.lax.stop_gradient(ratio) * advantages_B[:, None] * logp_BT
    loss = jnp.sum(keep * (pg + cfg.kl_coef * log_ratio**2)) / n
    metrics = {
        "policy/clip_fraction": jnp.sum(mask - keep) / n,
        "policy/kl": jnp.sum(mask * (ratio - 1.0 - log_ratio)) / n,
        "policy/ratio": jnp.sum(mask * ratio) / n,
    }
    return loss, metrics
