"""`[sampling]` and `[sampling.temp_scheduler]`: how the policy samples during rollouts (Hosted Training's
tables, with vLLM's sampling options that Hosted passes on)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from jaxrl.config.base import BrokenRules, Table, minus_one_or_positive


class TempSchedulerConfig(Table):
    """`[sampling.temp_scheduler]`: the sampling temperature over steps, from `start_temperature` at step 1
    to `end_temperature` at `total_steps` (then held), linearly or along a half cosine
    (`jaxrl.rl.rollouts.temperature_at`). A group of rollouts samples at the temperature of the step the
    producer is gathering when it starts, and trains at that temperature whichever step takes it."""

    type: Literal["linear", "cosine"] = "linear"
    """"linear" or "cosine". Default "linear"."""
    start_temperature: float = Field(ge=0)
    """Temperature of step 1, >= 0. Required."""
    end_temperature: float = Field(ge=0)
    """Temperature from step `total_steps` on, >= 0. Required."""
    total_steps: int | None = Field(None, ge=1)
    """Steps the schedule spans. Default None: `max_steps`."""


class SamplingConfig(Table):
    """`[sampling]`: how the policy samples during rollouts."""

    max_tokens: int | None = Field(None, ge=1)
    """Max tokens sampled per model turn. Must be < `jax.seq_len`. Default None: only `jax.seq_len` limits."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature, >= 0 (0 = greedy). Default 1.0."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass in (0, 1] (Holtzman et al. 2019); 1.0 = off. Default 1.0. Not in Hosted
    Training."""
    top_k: Annotated[int, minus_one_or_positive("off")] = -1
    """Keep only the k most likely tokens; -1 = off. Default -1. Not in Hosted Training."""
    repetition_penalty: float | None = Field(None, gt=0)
    """Divide the logit of a token already in the prompt or output by this when positive, multiply when
    negative (CTRL, Keskar et al. 2019, as in vLLM), > 0; 1 = off. Default None: off."""
    min_tokens: int | None = Field(None, ge=0)
    """Sample at least this many tokens per turn before a stop token may end it, <= `max_tokens` (vLLM's
    `min_tokens`). Default None: no minimum."""
    seed: int | None = Field(None, ge=0)
    """Seed of rollout sampling, >= 0, in place of `jax.seed` (which then seeds the LoRA initialisation
    only). Default None: `jax.seed`."""
    temp_scheduler: TempSchedulerConfig | None = None
    """`[sampling.temp_scheduler]`: a temperature schedule over the training steps, in place of
    `temperature` for training rollouts (`[eval]`, `[val]` and the pre-flight rollout keep sampling at
    `temperature`, so an eval curve moves only with the weights). Default None: `temperature` throughout."""
    enable_thinking: bool | None = None
    """The chat template's thinking switch (Qwen3's `enable_thinking`). Default None: off, as the
    rollout client has always rendered (`jaxrl.envs.loader.model_context`)."""
    extra_body: dict[str, Any] | None = None
    """Extra fields of Hosted Training's inference requests. Accepted; no effect here (a note says so)."""
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    """Hosted Training's reasoning control, exclusive with `enable_thinking`. Accepted; no effect here
    (Qwen3 has none; a note says so)."""

    @model_validator(mode="after")
    def _rules(self) -> SamplingConfig:
        problems = []
        if self.enable_thinking is not None and self.reasoning_effort is not None:
            problems.append(("sampling.reasoning_effort", "enable_thinking and reasoning_effort cannot both be set"))
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            problems.append(("sampling.min_tokens", f"{self.min_tokens} must be <= max_tokens ({self.max_tokens})"))
        if problems:
            raise BrokenRules(problems)
        return self
