"""RL math as pure functions: rewards to advantages, the policy losses, their aggregation, the KL
penalty to a reference policy. Options come from `[jax.advantage]` and `[jax.loss]`
(`jaxrl.config.algorithms`); each function names the paper or project its formula is from.

Token arrays are [B, T] (B samples, T positions aligned with the trained targets); `mask_BT` is True on
the sampled tokens the loss is taken over. `logp_BT` (the trainer's logprobs, differentiable) and
`inference_logp_BT` (the engine's, which sampled) give each token's importance ratio
`exp(logp - inference_logp)`. Advantages are float32 [B] (one per sequence, from rewards) or [B, T] (per
token: with a teacher's term, `teacher_advantages`), broadcast by `broadcast_advantages`. Per-token loss functions
return [B, T] values that `aggregate` reduces,
so every loss composes with every aggregation, and a caller that computes logprobs in pieces
(micro-batches, fused kernels) only has to hand these arrays over.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config.algorithms import AdvantageConfig, LossConfig

STD_EPS = 1e-6
"""Added to a standard deviation before dividing by it (GRPO's advantages, batch normalisation)."""
DEFAULT_ADVANTAGE = AdvantageConfig()
DEFAULT_LOSS = LossConfig()


def group_advantages(rewards: np.ndarray, rollouts_per_example: int, estimator: str = "mean") -> np.ndarray:
    """Advantages of rollouts in groups of `rollouts_per_example` (one example each), stored contiguously.

    "mean": `A_i = r_i - mean(r)` (prime-rl; Dr.GRPO, Liu et al. 2025). "std": `(r_i - mean(r)) /
    (std(r) + STD_EPS)`, population std (GRPO, Shao et al. 2024, DeepSeekMath). "rloo":
    `r_i - mean(r_j, j != i)` = `n / (n - 1) * (r_i - mean(r))` (Ahmadian et al. 2024, "Back to Basics:
    Revisiting REINFORCE Style Optimization"); 0 when n = 1.

    Args:
        rewards: float [G * rollouts_per_example].
    Returns:
        float32 [G * rollouts_per_example].
    Raises:
        ValueError: the length is not a multiple of `rollouts_per_example`.
    """
    r = np.asarray(rewards, dtype=np.float32)
    if r.size % rollouts_per_example:
        raise ValueError(f"{r.size} rewards do not split into groups of {rollouts_per_example}")
    g = r.reshape(-1, rollouts_per_example)
    centred = g - g.mean(axis=1, keepdims=True)
    match estimator:
        case "mean":
            out = centred
        case "std":
            out = centred / (g.std(axis=1, keepdims=True) + STD_EPS)
        case "rloo":
            n = rollouts_per_example
            out = centred * (n / (n - 1)) if n > 1 else np.zeros_like(g)
        case _:
            raise ValueError(f"unknown advantage estimator {estimator!r}")
    return out.reshape(-1).astype(np.float32)


def advantages(groups: list[np.ndarray], cfg: AdvantageConfig = DEFAULT_ADVANTAGE) -> np.ndarray:
    """The advantages of one step's trained groups (each a float array of its successful rollouts'
    rewards), concatenated in order: rewards clipped to `[reward_min, reward_max]`, the group baseline
    of `cfg.estimator` (`group_advantages`), then, with `batch_normalize`, the whole batch normalised to
    mean 0 and std 1 (REINFORCE++-baseline, Hu et al. 2025, "REINFORCE++").

    Returns:
        float32 [sum of the group sizes].
    """
    out = []
    for rewards in groups:
        r = np.asarray(rewards, np.float32)
        if cfg.reward_min is not None or cfg.reward_max is not None:
            r = np.clip(r, cfg.reward_min, cfg.reward_max)
        out.append(group_advantages(r, r.size, cfg.estimator) if r.size else r)
    adv = np.concatenate(out) if out else np.zeros(0, np.float32)
    if cfg.batch_normalize and adv.size:
        adv = (adv - adv.mean()) / (adv.std() + STD_EPS)
    return adv.astype(np.float32)


def broadcast_advantages(advantages: jax.Array) -> jax.Array:
    """Advantages as [B, 1] (one per sequence, broadcast over its tokens) or [B, T] (per token, as with a
    teacher's term) from float32 [B] or [B, T]."""
    return advantages if advantages.ndim == 2 else advantages[:, None]


def importance_sampling_loss(logp_BT: jax.Array, inference_logp_BT: jax.Array, advantages_B: jax.Array,
                             mask_low: float, mask_high: float, mismatch_kl_coef: float
                             ) -> tuple[jax.Array, jax.Array]:
    """prime-rl's masked importance sampling (PrimeIntellect-ai/prime-rl, `trainer/rl/loss.py`):

        ratio = exp(logp - logp_inference);  keep = mask_low <= ratio <= mask_high
        loss  = keep * (-stop_grad(ratio) * A * logp + mismatch_kl_coef * (logp - logp_inference)^2)

    Returns:
        per-token loss float32 [B, T], and `clipped` float32 [B, T] (1 where the ratio masked the token).
    """
    log_ratio = logp_BT - inference_logp_BT
    ratio = jnp.exp(log_ratio)
    keep = ((ratio >= mask_low) & (ratio <= mask_high)).astype(jnp.float32)
    pg = -jax.lax.stop_gradient(ratio) * broadcast_advantages(advantages_B) * logp_BT
    return keep * (pg + mismatch_kl_coef * log_ratio**2), 1.0 - keep


def clipped_surrogate_loss(logp_BT: jax.Array, inference_logp_BT: jax.Array, advantages_B: jax.Array,
                           clip_low: float, clip_high: float, dual_clip: float | None = None
                           ) -> tuple[jax.Array, jax.Array]:
    """The PPO clipped surrogate (Schulman et al. 2017) per token, as GRPO uses it (Shao et al. 2024),
    with DAPO's decoupled bounds (clip-higher: `clip_high - 1 > 1 - clip_low`, Yu et al. 2025) and the
    dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"):

        loss = max(-ratio * A, -clip(ratio, clip_low, clip_high) * A)
        loss = min(loss, -dual_clip * A)    where A < 0, when dual_clip is set

    Returns:
        per-token loss float32 [B, T], and `clipped` float32 [B, T] (1 where a clipped branch is the one
        taken, so the token has no gradient).
    """
    a = broadcast_advantages(advantages_B)
    ratio = jnp.exp(logp_BT - inference_logp_BT)
    unclipped = -ratio * a
    bounded = -jnp.clip(ratio, clip_low, clip_high) * a
    loss = jnp.maximum(unclipped, bounded)
    clipped = bounded > unclipped
    if dual_clip is not None:
        cap = -dual_clip * a
        capped = (a < 0) & (cap < loss)
        loss = jnp.where(capped, cap, loss)
        clipped = clipped | capped
    return loss, clipped.astype(jnp.float32)


def gspo_loss(logp_BT: jax.Array, inference_logp_BT: jax.Array, advantages_B: jax.Array, mask_BT: jax.Array,
              clip_low: float, clip_high: float) -> tuple[jax.Array, jax.Array]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the clipped surrogate on the
    sequence-level ratio, the geometric mean of the sequence's token ratios,

        s_b    = exp(mean over b's loss tokens of (logp - logp_inference))
        loss_b = max(-s_b * A_b, -clip(s_b, clip_low, clip_high) * A_b)

    given to each of b's loss tokens (so "sequence_mean" aggregation gives the paper's mean over
    sequences).

    Returns:
        per-token loss float32 [B, T], and `clipped` float32 [B, T] (1 on every token of a clipped
        sequence).
    """
    mask = mask_BT.astype(jnp.float32)
    log_s_B = jnp.sum(mask * (logp_BT - inference_logp_BT), axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
    s_B1 = jnp.exp(log_s_B)[:, None]
    a = broadcast_advantages(advantages_B)
    unclipped = -s_B1 * a
    bounded = -jnp.clip(s_B1, clip_low, clip_high) * a
    loss = jnp.maximum(unclipped, bounded)
    clipped = (bounded > unclipped).astype(jnp.float32)
    return jnp.broadcast_to(loss, mask.shape), jnp.broadcast_to(clipped, mask.shape)


def cispo_loss(logp_BT: jax.Array, inference_logp_BT: jax.Array, advantages_B: jax.Array, clip_low: float,
               clip_high: float) -> tuple[jax.Array, jax.Array]:
    """CISPO (MiniMax-M1, 2025, "Scaling Test-Time Compute Efficiently with Lightning Attention"): the
    importance weight is clipped and stop-gradiented, so every token keeps a policy-gradient term:

        loss = -stop_grad(clip(ratio, clip_low, clip_high)) * A * logp

    Returns:
        per-token loss float32 [B, T], and `clipped` float32 [B, T] (1 where the weight was clipped).
    """
    ratio = jnp.exp(logp_BT - inference_logp_BT)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, clip_low, clip_high))
    clipped = (ratio < clip_low) | (ratio > clip_high)
    return -weight * broadcast_advantages(advantages_B) * logp_BT, clipped.astype(jnp.float32)


def teacher_advantages(logp_BT: jax.Array, teacher_logp_BT: jax.Array) -> jax.Array:
    """On-policy distillation's per-token advantage `sg[log p_teacher(t) - log p_student(t)]` of each sampled
    token t: the negative of the reverse KL's single-sample estimate, so that maximising it lowers
    KL(student || teacher) on the student's own samples (Thinking Machines, "On-Policy Distillation",
    2025; prime-rl's `teacher_kl`). Stop-gradient: an advantage, not a loss. float32 [B, T]."""
    return jax.lax.stop_gradient(teacher_logp_BT - logp_BT)


def kl_penalty(logp_BT: jax.Array, ref_logp_BT: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(policy || reference) from tokens the policy sampled, with
    `log r = ref_logp - logp` (Schulman 2020, "Approximating KL Divergence"): "k1" `-log r`, "k2"
    `(log r)^2 / 2`, "k3" `exp(log r) - 1 - log r` (>= 0; GRPO's penalty). The reference is held
    constant (stop-gradient). float32 [B, T]."""
    log_r = jax.lax.stop_gradient(ref_logp_BT) - logp_BT
    match estimator:
        case "k1":
            return -log_r
        case "k2":
            return 0.5 * log_r**2
        case "k3":
            return jnp.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}")


def sft_loss(logp_BT: jax.Array, mask_BT: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Supervised fine-tuning's loss: the negative log-likelihood of the target tokens where `mask_BT` is
    True (the assistant's), a mean over those tokens (token-mean, as prime-rl's and TRL's SFT losses),
    0.0 with none. `logp_BT`: float32 log p(target) at temperature 1. Returns the float32 scalar loss and
    no metrics ({}; the step reports it as `loss`)."""
    mask = mask_BT.astype(jnp.float32)
    return -jnp.sum(logp_BT * mask) / jnp.maximum(mask.sum(), 1.0), {}


def aggregate(values_BT: jax.Array, mask_BT: jax.Array, how: str, length: int | None = None) -> jax.Array:
    """One scalar from per-token values over `mask_BT`.

    "token_mean": sum over every loss token / their count (DAPO, Yu et al. 2025; prime-rl).
    "sequence_mean": each sequence's token mean, then the mean over sequences with a loss token (GRPO,
    Shao et al. 2024). "sequence_sum": each sequence's token sum / `length`, then that mean over
    sequences (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training": a constant divisor,
    no length bias).

    Raises:
        ValueError: an unknown `how`, or "sequence_sum" without `length`.
    """
    mask = mask_BT.astype(jnp.float32)
    per_seq_B = jnp.sum(mask * values_BT, axis=1)
    tokens_B = mask.sum(axis=1)
    sequences = jnp.maximum(jnp.sum(tokens_B > 0), 1)
    match how:
        case "token_mean":
            return jnp.sum(mask * values_BT) / jnp.maximum(mask.sum(), 1.0)
        case "sequence_mean":
            return jnp.sum(per_seq_B / jnp.maximum(tokens_B, 1.0)) / sequences
        case "sequence_sum":
            if length is None:
                raise ValueError("sequence_sum aggregation needs a length")
            return jnp.sum(per_seq_B) / (length * sequences)
    raise ValueError(f"unknown aggregation {how!r}")


def policy_loss(logp_BT: jax.Array, inference_logp_BT: jax.Array, advantages_B: jax.Array,
                loss_mask_BT: jax.Array, cfg: LossConfig = DEFAULT_LOSS, *, entropy_BT: jax.Array | None = None,
                ref_logp_BT: jax.Array | None = None,
                teacher_logp_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """The loss `cfg` describes (`[jax.loss]`): the policy objective of `cfg.type` on the advantages
    `adv_tau * A + teacher_tau * teacher_advantages(logp, teacher_logp)` (prime-rl's; the teacher term only
    with `teacher_tau > 0`, so that without one the loss is computed as before the term existed), plus
    `kl_coef * kl_penalty(logp, ref_logp)`, minus `entropy_coef * entropy`, each aggregated by
    `cfg.aggregation` over the loss tokens. The defaults are prime-rl's loss exactly.

    Args:
        logp_BT: float32 trainer logprobs of the sampled tokens [B, T] (differentiable).
        inference_logp_BT: float32 engine logprobs of the same tokens [B, T].
        advantages_B: float32 [B].
        loss_mask_BT: bool [B, T], True on sampled tokens.
        entropy_BT: float32 [B, T], the policy's entropy at each position (differentiable for the
            bonus to have a gradient); required when `cfg.entropy_coef > 0`.
        ref_logp_BT: float32 [B, T], the reference policy's logprobs of the sampled tokens; required when
            `cfg.kl_coef > 0`.
        teacher_logp_BT: float32 [B, T], the teacher's logprobs of the sampled tokens (0 elsewhere);
            required when `cfg.teacher_tau > 0`.
    Returns:
        scalar loss, and metrics over loss tokens: `policy/clip_fraction` (share of tokens the loss
        masked or clipped), `policy/kl` (mean of `ratio - 1 - log ratio`: the k3 estimator of
        KL(engine || trainer) from tokens the engine sampled, Schulman 2020; prime-rl's `mismatch_kl`),
        `policy/ratio` (mean ratio), `policy/ref_kl` (the mean of `cfg.kl_estimator`) when
        `cfg.kl_coef > 0`, and with `cfg.teacher_tau > 0` `teacher/kl` (the mean of `logp - teacher_logp`,
        the reverse KL's estimate on the sampled tokens) and `teacher/advantage` (the mean of the teacher's
        weighted term).
    Raises:
        ValueError: `entropy_BT`, `ref_logp_BT` or `teacher_logp_BT` missing where `cfg` needs them.
    """
    metrics = {}
    if cfg.adv_tau != 1.0:
        advantages_B = cfg.adv_tau * advantages_B
    if cfg.teacher_tau > 0:
        if teacher_logp_BT is None:
            raise ValueError("teacher_tau > 0 needs the teacher's logprobs")
        teacher_BT = cfg.teacher_tau * teacher_advantages(logp_BT, teacher_logp_BT)
        advantages_B = broadcast_advantages(advantages_B) + teacher_BT  # now per token: [B, T]
        student_minus_teacher = jax.lax.stop_gradient(logp_BT) - teacher_logp_BT
        metrics["teacher/kl"] = aggregate(student_minus_teacher, loss_mask_BT, "token_mean")
        metrics["teacher/advantage"] = aggregate(teacher_BT, loss_mask_BT, "token_mean")
    match cfg.type:
        case "is":
            per_token, clipped = importance_sampling_loss(logp_BT, inference_logp_BT, advantages_B, cfg.mask_low,
                                                          cfg.mask_high, cfg.mismatch_kl_coef)
        case "ppo":
            per_token, clipped = clipped_surrogate_loss(logp_BT, inference_logp_BT, advantages_B, cfg.clip_low,
                                                        cfg.clip_high, cfg.dual_clip)
        case "gspo":
            per_token, clipped = gspo_loss(logp_BT, inference_logp_BT, advantages_B, loss_mask_BT, cfg.clip_low,
                                           cfg.clip_high)
        case "cispo":
            per_token, clipped = cispo_loss(logp_BT, inference_logp_BT, advantages_B, cfg.clip_low, cfg.clip_high)
        case _:
            raise ValueError(f"unknown loss type {cfg.type!r}")
    if cfg.kl_coef > 0:
        if ref_logp_BT is None:
            raise ValueError("kl_coef > 0 needs the reference logprobs")
        kl_BT = kl_penalty(logp_BT, ref_logp_BT, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl_BT
        metrics["policy/ref_kl"] = aggregate(jax.lax.stop_gradient(kl_BT), loss_mask_BT, "token_mean")
    if cfg.entropy_coef > 0:
        if entropy_BT is None:
            raise ValueError("entropy_coef > 0 needs the entropy")
        per_token = per_token - cfg.entropy_coef * entropy_BT
    loss = aggregate(per_token, loss_mask_BT, cfg.aggregation, cfg.aggregation_length)
    log_ratio = jax.lax.stop_gradient(logp_BT - inference_logp_BT)
    ratio = jnp.exp(log_ratio)
    metrics |= {
        "policy/clip_fraction": aggregate(clipped, loss_mask_BT, "token_mean"),
        "policy/kl": aggregate(ratio - 1.0 - log_ratio, loss_mask_BT, "token_mean"),
        "policy/ratio": aggregate(ratio, loss_mask_BT, "token_mean"),
    }
    return loss, metrics
