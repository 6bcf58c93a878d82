"""The training knobs, in sub-tables of `[jax]`: `[jax.loss]` (the policy objective, its aggregation,
the KL penalty to the reference policy, the teacher's weight and the entropy bonus), `[jax.advantage]` (rewards to
advantages) and `[jax.optim]` (the optimizer and its learning-rate schedule).

They live under `[jax]` because the Hosted Training schema has none of them: a Hosted file runs
unchanged, and every default reproduces what jaxrl trained before these tables existed (prime-rl's
masked importance-sampling loss, a mean-only group baseline, constant-rate AdamW clipped at norm 1).
The formulas are in `jaxrl.rl.losses` and `jaxrl.rl.train`; docs/algorithms.md tabulates them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from jaxrl.config.base import Table

LossType = Literal["is", "ppo", "gspo", "cispo"]
Aggregation = Literal["token_mean", "sequence_mean", "sequence_sum"]
KlEstimator = Literal["k1", "k2", "k3"]
AdvantageEstimator = Literal["mean", "std", "rloo"]
Schedule = Literal["constant", "linear", "cosine"]


def _ratio_bound(value: float) -> float:
    if value < 1:
        raise ValueError(f"{value} must be >= 1: it bounds the ratio itself, 1 + eps_high (DAPO's eps_high "
                         f"0.28 is clip_high = 1.28)")
    return value


class LossConfig(Table):
    """`[jax.loss]`: the policy loss (`jaxrl.rl.losses.policy_loss`). Every ratio below is the per-token
    importance ratio `exp(logp_trainer - logp_engine)` against the engine that sampled the token."""

    type: LossType = "is"
    """The policy objective. "is": prime-rl's masked importance sampling (tokens whose ratio leaves
    [mask_low, mask_high] are dropped, the ratio weights the gradient through a stop-gradient).
    "ppo": the PPO clipped surrogate (Schulman et al. 2017) as GRPO uses it (Shao et al. 2024), with
    separate low and high clip bounds (DAPO's clip-higher, Yu et al. 2025) and an optional dual clip
    (Ye et al. 2020). "gspo": the same clip on a sequence-level ratio, the geometric mean of the token
    ratios (Zheng et al. 2025). "cispo": the importance weight clipped to [clip_low, clip_high] and
    stop-gradiented, so no token loses its gradient (MiniMax-M1, 2025). Default "is"."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one number. "token_mean": sum over the batch's loss tokens divided by
    their count (DAPO's token-level loss). "sequence_mean": each sequence's token mean, then the mean
    over sequences (GRPO as published; GSPO). "sequence_sum": each sequence's token sum divided by
    `aggregation_length`, then the mean over sequences (Dr.GRPO, Liu et al. 2025: no length bias).
    Default "token_mean"."""
    aggregation_length: int | None = Field(None, ge=1)
    """Dr.GRPO's constant for "sequence_sum", in tokens. Default None: `[sampling] max_tokens`, else
    `[jax] seq_len`."""
    mask_low: float = Field(0.125, ge=0)
    """"is": tokens whose ratio is below this are masked out of the loss. Default 0.125 (prime-rl)."""
    mask_high: float = Field(8.0, ge=0)
    """"is": tokens whose ratio is above this are masked out; >= mask_low. Default 8.0 (prime-rl)."""
    mismatch_kl_coef: float = Field(1e-3, ge=0)
    """"is": weight of the `(log ratio)^2` term on kept tokens, which keeps the trainer near the engine
    that sampled (prime-rl). Default 1e-3."""
    clip_low: float = Field(0.8, ge=0, le=1)
    """"ppo", "gspo", "cispo": lower bound of the clipped ratio, `1 - eps_low`, in [0, 1]. Default 0.8
    (PPO's eps = 0.2). GSPO's paper used 1 - 3e-4."""
    clip_high: Annotated[float, AfterValidator(_ratio_bound)] = 1.2
    """"ppo", "gspo", "cispo": upper bound of the clipped ratio, `1 + eps_high`, >= 1 and >= clip_low.
    Default 1.2; DAPO's clip-higher is 1.28, GSPO's paper 1 + 4e-4, CISPO's (ScaleRL) about 5."""
    dual_clip: float | None = Field(None, gt=1)
    """"ppo": dual clip constant c > 1 (Ye et al. 2020): on tokens with a negative advantage the loss is
    capped at `-c * A`, so a ratio far above 1 cannot blow it up. Default None: off."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference policy (the base model: LoRA off, or the frozen initial
    weights in full fine-tuning), aggregated like the policy loss; > 0 costs one more forward pass per
    step and reports `policy/ref_kl`. Default 0 (off)."""
    kl_estimator: KlEstimator = "k3"
    """Per-token estimator of KL(policy || reference) on the sampled tokens (Schulman 2020,
    "Approximating KL Divergence"), with `log r = logp_ref - logp`: "k1" `-log r`, "k2"
    `(log r)^2 / 2`, "k3" `r - 1 - log r` (GRPO's). Default "k3"."""
    teacher_tau: float = Field(0.0, ge=0)
    """Weight of the teacher's per-token advantage `sg[log p_teacher(t) - log p_student(t)]` on each sampled
    token t (on-policy distillation: the reverse KL to the teacher on the student's own samples; Thinking
    Machines 2025, prime-rl's `teacher_tau`), added to `adv_tau` times the reward advantage and trained
    through `type`'s loss; needs `[jax.teacher]`; reports `teacher/kl` and `teacher/advantage`. The teacher
    is scored at temperature 1, the student at its sampling temperature. Default 0 (off)."""
    adv_tau: float = Field(1.0, ge=0)
    """Weight of the reward advantage (prime-rl's `adv_tau`); 0 with `teacher_tau > 0` is pure distillation
    (rewards are still logged, and no group is dropped for equal rewards). Default 1.0."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus: the loss is lowered by this times the aggregated per-token entropy of
    the policy's full distribution (at the sampling temperature). Default 0 (off)."""

    @model_validator(mode="after")
    def _bounds(self) -> LossConfig:
        if self.mask_low > self.mask_high:
            raise ValueError(f"mask_low {self.mask_low} must be <= mask_high {self.mask_high}")
        return self


class AdvantageConfig(Table):
    """`[jax.advantage]`: how rewards become advantages (`jaxrl.rl.losses.advantages`). Groups are the
    `rollouts_per_example` rollouts of one example; failed rollouts are left out of their group."""

    estimator: AdvantageEstimator = "mean"
    """"mean": `r - mean(group)` (prime-rl; Dr.GRPO). "std": `(r - mean(group)) / (std(group) + 1e-6)`
    (GRPO, Shao et al. 2024; population std). "rloo": `r - mean(the group's other rollouts)`
    (REINFORCE leave-one-out, Ahmadian et al. 2024); 0 for a group of one. Default "mean"."""
    reward_min: float | None = None
    """Rewards below this are raised to it before the advantages (the logged `reward/*` metrics stay
    raw). Default None: no lower clip."""
    reward_max: float | None = None
    """Rewards above this are lowered to it; >= reward_min. Default None: no upper clip."""
    batch_normalize: bool = False
    """After the group baseline, normalise the batch's advantages to mean 0 and std 1 (over every
    trained rollout of the step; REINFORCE++-baseline, Hu et al. 2025). Default false."""

    @model_validator(mode="after")
    def _range(self) -> AdvantageConfig:
        if self.reward_min is not None and self.reward_max is not None and self.reward_min > self.reward_max:
            raise ValueError(f"reward_min {self.reward_min} must be <= reward_max {self.reward_max}")
        return self


class OptimConfig(Table):
    """`[jax.optim]`: AdamW (Loshchilov & Hutter 2019) on the trained weights, at the top-level
    `learning_rate`, with global-norm gradient clipping and a learning-rate schedule over `max_steps`
    (`jaxrl.rl.train.learning_rate`); the rate of each step is logged as `optim/lr`."""

    schedule: Schedule = "constant"
    """After warmup: "constant"; "linear" decay towards 0 at `max_steps`; "cosine" decay towards 0 at
    `max_steps` (Loshchilov & Hutter 2017). Default "constant"."""
    warmup_steps: int = Field(0, ge=0)
    """Steps over which the rate rises linearly to `learning_rate` (step k of n runs at k/n of it);
    < max_steps. Default 0."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay. Default 0."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """Adam's first-moment decay, in [0, 1). Default 0.9."""
    beta2: float = Field(0.999, ge=0, lt=1)
    """Adam's second-moment decay, in [0, 1). Default 0.999."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are scaled down to this global L2 norm when above it (`optim/grad_norm` is logged before
    clipping). Default 1.0."""

