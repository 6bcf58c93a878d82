"""The environment tables of the run config: `[[env]]` (the training environments), `[buffer]` (which of
their examples are drawn, and online difficulty filtering), and `[eval]` / `[[eval.env]]` and `[val]`
(evaluation during training). `jaxrl.config.schema.RunConfig` holds them and checks the rules that span
tables (distinct display names, one `env_ratios` entry per `[[env]]`, hard_threshold <= easy_threshold)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from jaxrl.config.base import AllOrPositive, EnvId, FolderName, Table


class _EnvTable(Table):
    """The fields `[[env]]` and `[[eval.env]]` share."""

    id: EnvId
    """Environments Hub id, `owner/name` with an optional `@version`. Required."""
    name: FolderName | None = None
    """Display name, to tell apart copies of one environment with different args (it labels metrics
    `eval/<name>/...`, so no '/', '.', '..' or control characters). Default: the id."""
    args: dict[str, Any] = {}
    """Keyword arguments for the environment's `load_environment()`. Default {}."""
    max_retries: int | None = Field(None, ge=0)
    """Times a failed rollout of this environment is played again (with the same seed) before it counts
    as failed, >= 0. Default None: 0."""
    version: str | None = Field(None, min_length=1)
    """Version the installed environment package must have (`jaxrl run` stops otherwise); wins over an
    `@version` in `id`. Default None: the one in `id`, if any."""

    @property
    def display_name(self) -> str:
        """`name`, else `id`: the label of this environment in logs and metrics (`eval/<name>/...`)."""
        return self.name or self.id


class EnvConfig(_EnvTable):
    """`[[env]]`: one training environment."""

    taskset: dict[str, Any] | None = None
    """verifiers v1 taskset table, passed through unchanged. Default None."""
    harness: dict[str, Any] | None = None
    """verifiers v1 harness table, passed through unchanged. Default None."""


class EvalEnvConfig(_EnvTable):
    """`[[eval.env]]`: one eval environment, with optional overrides of the `[eval]` defaults."""

    num_examples: AllOrPositive | None = None
    """Examples to evaluate (-1 = all). Default None: `eval.num_examples`."""
    rollouts_per_example: int | None = Field(None, ge=1)
    """Rollouts per eval example. Default None: `eval.rollouts_per_example`."""


class EvalConfig(Table):
    """`[eval]`: online evaluation during training (`jaxrl.run.evaluate`): each environment's first
    `num_examples` examples of its eval split (its loaded tasks when it has none), with the run's
    `[sampling]`; metrics `eval/<env>/reward/mean`, `eval/<env>/pass@k`, ... in the step's row."""

    interval: int = Field(100, ge=1)
    """Evaluate after every N-th training step. Default 100."""
    num_examples: AllOrPositive = -1
    """Examples per eval environment (-1 = all). Default -1."""
    rollouts_per_example: int = Field(1, ge=1)
    """Rollouts per eval example. Default 1."""
    eval_base_model: bool = True
    """Also evaluate the base (untrained) model, before step 1: a metrics row at step 0. Default true."""
    env: list[EvalEnvConfig] = []
    """`[[eval.env]]` tables, each with a distinct display name. Default []: evaluate on the training
    environments."""


class ValConfig(Table):
    """`[val]`: validation on the training environments' eval splits (their train examples when they have
    none), with the run's `[sampling]` (`jaxrl.run.evaluate`); metrics `val/reward/mean`, ... (and
    `val/<env>/...` with several environments) in the step's row."""

    num_examples: int = Field(64, ge=1)
    """Validation examples per check and training environment (its first ones; fewer when its split is
    smaller). Default 64."""
    rollouts_per_example: int = Field(1, ge=1)
    """Rollouts per validation example. Default 1."""
    interval: int = Field(5, ge=1)
    """Validate every N training steps. Default 5."""


class BufferConfig(Table):
    """`[buffer]`: which examples are sampled, and online difficulty filtering (`jaxrl.rl.buffer`)."""

    online_difficulty_filtering: bool = False
    """Leave out of training the groups whose rewards are all equal (mean exactly 0 or 1 with binary
    rewards: zero advantages), and sample examples by difficulty (the four fields below apply only when
    this is true). Default false."""
    easy_threshold: float = Field(0.8, ge=0, le=1)
    """An example whose latest group's mean reward is >= this is "easy", in [0, 1]. Default 0.8."""
    hard_threshold: float = Field(0.2, ge=0, le=1)
    """An example whose latest group's mean reward is <= this is "hard", in [0, 1], <= easy_threshold.
    Default 0.2."""
    easy_fraction: float = Field(0.0, ge=0, le=1)
    """Share of each environment's easy examples kept in sampling (a seeded choice); the rest are no
    longer drawn. In [0, 1]. Default 0.0."""
    hard_fraction: float = Field(0.0, ge=0, le=1)
    """Share of each environment's hard examples kept in sampling, in [0, 1]. Default 0.0."""
    env_ratios: list[float] | None = None
    """Sampling weight of each `[[env]]`, one per env, >= 0 with a positive sum: the share of groups each
    environment gets; multi-env only (ignored with a single env). Default None: equal shares."""
    skip_verification: bool = False
    """Skip the pre-flight check: one smoke rollout of each environment before step 1, whose failure stops
    the run before any training. Default false."""
    seed: int = Field(42, ge=0)
    """Seed of the example order and of which easy/hard examples are kept, >= 0. Default 42."""
