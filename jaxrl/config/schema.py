"""Run configuration: Prime Hosted Training TOML files, plus one `[jax]` table for what they lack.

One pydantic model per TOML table, mirroring the Hosted Training schema field for field (the environment
tables are in `jaxrl.config.envs`, `[sampling]` in `jaxrl.config.sampling`, the `[jax]` training sub-tables
in `jaxrl.config.algorithms` and `jaxrl.config.teacher`, the field types they share in `jaxrl.config.base`).
Every table forbids unknown keys, TOML types are taken strictly (`batch_size = "8"` is an error, not 8),
and the cross-field rules of the schema are checked at load. `load_config` turns every problem into one
`ConfigError` line `<file>: <dotted.key>: <reason>`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, ValidationError, model_validator

from jaxrl.config.base import (
    AllOrPositive,
    BrokenRules,
    ConfigError,
    FolderName,
    PathStr,
    Table,
    folder_name_problem,
    read_toml,
)
from jaxrl.config.envs import BufferConfig, EnvConfig, EvalConfig, ValConfig
from jaxrl.config.hub import resolve_model
from jaxrl.config.jax_table import JaxConfig
from jaxrl.config.model_path import HubModel, ModelNotFoundError, hub_offline, locate_model
from jaxrl.config.sampling import SamplingConfig
from jaxrl.config.sft import DataError, read_jsonl
from jaxrl.config.teacher import teacher_file_problems, teacher_rules

SEED_MULTIPLIER = 1_000_003
"""Rollout seeds are `(jax.seed * SEED_MULTIPLIER + group number) * rollouts_per_example + i` (the run loop)."""


class WandbConfig(Table):
    """`[wandb]`: Weights & Biases logging (offline, to the run folder, when WANDB_API_KEY is not set)."""

    project: str | None = None
    """W&B project name. Default None (W&B's own default)."""
    entity: str | None = None
    """W&B team or user. Default None (the API key's default entity)."""
    name: str | None = None
    """W&B run name. Default None (the run's `name`)."""


class CheckpointsConfig(Table):
    """`[checkpoints]`: Orbax checkpoints of the training state."""

    interval: int = Field(10, ge=1)
    """Save a checkpoint every N steps. Default 10 (Hosted Training uses a cluster default)."""
    keep_cloud: AllOrPositive = 5
    """Most recent checkpoints kept, locally or on `gs://` (-1 = all); older ones are deleted once a newer
    one is complete. Default 5."""


class AdaptersConfig(Table):
    """`[adapters]`: the LoRA as PEFT adapter folders during a run (`jaxrl.run.adapters.RunAdapters`), in
    `<output_dir>/<name>/adapters/step_<n>`, or `<checkpoint_dir>/<name>/adapters/step_<n>` (a folder or
    `gs://`) when `[jax] checkpoint_dir` is set."""

    interval: int = Field(0, ge=0)
    """Export the adapter every N steps and after the last (0 = only after the last step). Default 0."""
    keep_last: AllOrPositive = 3
    """Adapters kept (-1 = all). Default 3."""


class InfrastructureConfig(Table):
    """`[infrastructure]`: environment container resources on Hosted Training; here, the CPU share of the
    environments, which run in the trainer's process (`jaxrl.run.resources`)."""

    compute_size: Literal["S", "M", "L"] = "M"
    """CPU the environments get, scaled to this machine's cores C: worker threads for env work (the run
    loop's default executor, used by `asyncio.to_thread`) S max(1, C//4), M max(2, C//2), L max(4, C);
    rollouts in flight at once S 8*C, M 32*C, L no limit. Default "M"."""


class TailscaleConfig(Table):
    """`[tailscale]`: Hosted Training's tailnet sidecar for environment servers. Accepted; no effect here
    (a note says so)."""

    enabled: bool = False
    """Join the environment servers to a tailnet. Default false."""
    auth_key: str | None = None
    """Tailscale auth key. Default None."""
    hostname_prefix: str = "prime-hosted-training"
    """Sidecar hostname prefix. Default "prime-hosted-training"."""


class RunConfig(Table):
    """A whole run: a Hosted Training TOML file plus the optional `[jax]` table."""

    name: FolderName | None = None
    """Display name of the run and its folder `<jax.output_dir>/<name>`: one folder name (no '/', '.',
    '..' or control characters). Default None: the config file's name without `.toml`."""
    model: str
    """Hugging Face model id (or a local folder, see `jax.model_path`). Required."""
    max_steps: int = Field(100, ge=1)
    """Training steps; each consumes one batch. Default 100."""
    batch_size: int = Field(128, ge=1)
    """Rollouts per training batch; a multiple of `rollouts_per_example`. Default 128."""
    rollouts_per_example: int = Field(8, ge=1)
    """Rollouts per dataset example (the GRPO group size). Default 8."""
    trajectory_strategy: Literal["interleaved", "branching"] = "interleaved"
    """How a multi-turn trace becomes training samples: "interleaved" (one sample per trace, every turn's
    sampled tokens masked in) or "branching" (one sample per turn: that turn's prompt and completion, only
    the completion masked in; each with its trace's advantage). Default "interleaved"."""
    learning_rate: float = Field(1e-4, gt=0)
    """Peak learning rate of the trained weights (the LoRA factors, or every weight with `[jax] finetune =
    "full"`). Default 1e-4."""
    lora_alpha: int = Field(16, ge=1)
    """LoRA alpha; updates are scaled by `lora_alpha / jax.lora_rank`. Default 16."""
    oversampling_factor: float = Field(2.0, ge=1)
    """Rollouts in flight per `batch_size` rollouts (whole groups, rounded up); a step trains on the first
    groups to finish (`jaxrl.rl.producer`). Default 2.0."""
    max_async_level: int = Field(2, ge=0)
    """Max policy versions the oldest token of a trained rollout may lag the trainer (older groups are
    dropped); >= `oversampling_factor`. 0 (jaxrl's addition, with `oversampling_factor = 1`): synchronous,
    generation waits for each step's update, and a run is reproducible token for token. Default 2."""
    env_file: list[PathStr] = []
    """.env files with secrets, relative to the config file (absolute after `load_config`, with
    `env_files` appended). Default []."""
    env_files: list[PathStr] = []
    """Hosted Training's newer name for `env_file`: more .env files, read after those. Default []."""
    max_inflight_rollouts: int | None = Field(None, ge=1)
    """Rollouts in flight at once (whole groups, rounded up; at least one batch), in place of
    `oversampling_factor` (which becomes `max_inflight_rollouts / batch_size`, and need not be <=
    `max_async_level`: groups that lag more are dropped); >= `rollouts_per_example`, not with
    `oversampling_factor`. Default None: `oversampling_factor` decides."""
    cluster_name: str | None = None
    """Hosted Training's cluster. Accepted; no effect here (a note says so)."""
    run_config: dict[str, Any] = {}
    """Hosted Training's raw run settings. Accepted; no effect here (a note says so)."""
    checkpoint_id: PathStr | None = None
    """Checkpoint whose LoRA weights a new run starts from (optimizer, step and data position start
    fresh): `"<run>"` (its latest checkpoint) or `"<run>/<step>"`, a run under the same checkpoint root,
    or a path (absolute, `./`/`../` relative to this file, or `gs://`) to a run's checkpoint folder or
    to one step's folder. It must be of the same model and LoRA shape. Ignored when the run already
    has checkpoints of its own (it resumes from them). Default None."""
    sampling: SamplingConfig = SamplingConfig()
    """`[sampling]`. Default: all its defaults."""
    env: list[EnvConfig] = []
    """`[[env]]` training environments; at least one, except in an SFT config (`[jax.sft]`), where they are
    only what `[eval]` and `[val]` play."""
    wandb: WandbConfig | None = None
    """`[wandb]`. Default None: no W&B logging."""
    eval: EvalConfig | None = None
    """`[eval]`. Default None: no online evaluation."""
    val: ValConfig | None = None
    """`[val]`. Default None: no validation."""
    buffer: BufferConfig = BufferConfig()
    """`[buffer]`. Default: all its defaults (no difficulty filtering)."""
    checkpoints: CheckpointsConfig = CheckpointsConfig()
    """`[checkpoints]`. Default: all its defaults."""
    adapters: AdaptersConfig = AdaptersConfig()
    """`[adapters]`. Default: all its defaults."""
    infrastructure: InfrastructureConfig = InfrastructureConfig()
    """`[infrastructure]`. Default: all its defaults."""
    tailscale: TailscaleConfig | None = None
    """`[tailscale]`. Accepted; no effect here."""
    jax: JaxConfig = JaxConfig()
    """`[jax]`, the one table Hosted Training does not have. Default: all its defaults."""

    _source: Path | None = None  # the file loaded, set by `load_config`; a pydantic private attribute

    @property
    def source(self) -> Path:
        """The file this config was loaded from, absolute (`<config>` when built in code)."""
        return self._source or Path("<config>")

    @property
    def sampling_seed(self) -> int:
        """The seed rollout sampling counts from: `[sampling] seed`, else `[jax] seed`."""
        return self.jax.seed if self.sampling.seed is None else self.sampling.seed

    @property
    def config_dir(self) -> Path:
        """Folder of the config file; relative paths in it are resolved from here (cwd when built in code)."""
        return self._source.parent if self._source else Path.cwd()

    @model_validator(mode="after")
    def _cross_field_rules(self) -> RunConfig:
        problems = []
        if self.max_inflight_rollouts is not None:
            if "oversampling_factor" in self.model_fields_set:
                problems.append(("max_inflight_rollouts", "set max_inflight_rollouts or oversampling_factor, not both"))
            elif self.max_inflight_rollouts < self.rollouts_per_example:
                problems.append(("max_inflight_rollouts", f"{self.max_inflight_rollouts} must be >= "
                                                          f"rollouts_per_example ({self.rollouts_per_example})"))
            else:
                self.oversampling_factor = self.max_inflight_rollouts / self.batch_size
        if self.batch_size % self.rollouts_per_example:
            problems.append(("batch_size", f"{self.batch_size} is not divisible by rollouts_per_example "
                                           f"({self.rollouts_per_example})"))
        if self.max_async_level == 0 and self.oversampling_factor != 1:
            problems.append(("oversampling_factor", f"{self.oversampling_factor} must be 1 with max_async_level = 0 "
                                                    f"(synchronous: a rollout beyond the batch would be stale at "
                                                    f"the next step)"))
        elif 0 < self.max_async_level < self.oversampling_factor and self.max_inflight_rollouts is None:
            problems.append(("max_async_level", f"{self.max_async_level} must be >= oversampling_factor "
                                                f"({self.oversampling_factor})"))
        if self.jax.kv_cache_tokens is not None and self.jax.kv_cache_tokens < self.jax.seq_len:
            problems.append(("jax.kv_cache_tokens", f"{self.jax.kv_cache_tokens} must be >= jax.seq_len "
                                                    f"({self.jax.seq_len}): one sequence must fit the pool"))
        if self.jax.kv_reuse_turns and self.jax.kv_cache_tokens is None:
            problems.append(("jax.kv_reuse_turns", "needs the paged cache: set [jax] kv_cache_tokens"))
        if self.sampling.max_tokens is not None and self.sampling.max_tokens >= self.jax.seq_len:
            problems.append(("sampling.max_tokens", f"{self.sampling.max_tokens} must be < jax.seq_len "
                                                    f"({self.jax.seq_len}); raise [jax] seq_len"))
        if self.sampling.max_tokens is None and (self.sampling.min_tokens or 0) >= self.jax.seq_len:
            problems.append(("sampling.min_tokens", f"{self.sampling.min_tokens} must be < jax.seq_len "
                                                    f"({self.jax.seq_len}), the most a turn can sample"))
        problems += self._sft_rules()
        loss = self.jax.loss
        problems += teacher_rules(self.jax.teacher, loss.teacher_tau, loss.adv_tau, self.jax.sft is not None)
        names = [e.display_name for e in self.env]
        for i, name in enumerate(names):
            if name in names[:i]:
                problems.append((f"env.{i}.name", f"{name!r} is also the name of env.{names.index(name)}; give "
                                                  f"each [[env]] a distinct `name` (it labels its metrics)"))
        eval_names = [e.display_name for e in self.eval.env] if self.eval else []
        for i, name in enumerate(eval_names):
            if name in eval_names[:i]:
                problems.append((f"eval.env.{i}.name", f"{name!r} is also the name of eval.env."
                                                       f"{eval_names.index(name)}; give each [[eval.env]] a "
                                                       f"distinct `name` (it labels its metrics)"))
        buf = self.buffer
        if buf.hard_threshold > buf.easy_threshold:
            problems.append(("buffer.hard_threshold", f"{buf.hard_threshold} must be <= easy_threshold "
                                                      f"({buf.easy_threshold})"))
        if buf.env_ratios is not None:
            if len(self.env) > 1 and len(buf.env_ratios) != len(self.env):
                problems.append(("buffer.env_ratios", f"has {len(buf.env_ratios)} entries for "
                                                      f"{len(self.env)} [[env]] tables"))
            if any(r < 0 for r in buf.env_ratios) or sum(buf.env_ratios) <= 0:
                problems.append(("buffer.env_ratios", "entries must be >= 0 with a positive sum"))
        if self.sampling_seed * SEED_MULTIPLIER * self.rollouts_per_example + 4 * self.max_steps * self.batch_size * \
                self.oversampling_factor >= 2**63:
            key = "jax.seed" if self.sampling.seed is None else "sampling.seed"
            problems.append((key, f"{self.sampling_seed} is too large for rollouts_per_example = "
                                         f"{self.rollouts_per_example}: rollout seeds (seed * {SEED_MULTIPLIER} + "
                                         f"group) * rollouts_per_example must stay below 2**63"))
        if self.jax.output_dir.startswith("gs://"):
            problems.append(("jax.output_dir", "must be a local folder (metrics are written there); "
                                               "put checkpoints on gs:// with [jax] checkpoint_dir"))
        if len(set(self.jax.lora_targets)) != len(self.jax.lora_targets):
            problems.append(("jax.lora_targets", "lists a projection twice"))
        if self.jax.finetune == "full":
            problems += _lora_only_fields(self)
        epochs = self.jax.sft is not None and self.jax.sft.epochs is not None  # max_steps known with the data
        if self.jax.optim.warmup_steps and self.jax.optim.warmup_steps >= self.max_steps and not epochs:
            problems.append(("jax.optim.warmup_steps", f"{self.jax.optim.warmup_steps} must be < max_steps "
                                                       f"({self.max_steps})"))
        if problems:
            raise BrokenRules(problems)
        return self


    def _sft_rules(self) -> list[tuple[str, str]]:
        """Without `[jax.sft]`, at least one `[[env]]`; with it, `epochs` or `max_steps`, not both, and
        without `[[env]]`, `[eval]` needs `[[eval.env]]` and `[val]` is refused (both would have nothing
        to play)."""
        problems = []
        if self.jax.sft is not None and self.jax.sft.epochs is not None and "max_steps" in self.model_fields_set:
            problems.append(("jax.sft.epochs", "set [jax.sft] epochs or max_steps, not both"))
        if self.env:
            return problems
        if self.jax.sft is None:
            return [("env", "required key is missing (at least one [[env]]; only an SFT config, with "
                            "[jax.sft], may have none)")]
        if self.eval is not None and not self.eval.env:
            problems.append(("eval", "plays the [[env]] environments by default, and this SFT config has none; "
                                     "add [[eval.env]] tables or [[env]]"))
        if self.val is not None:
            problems.append(("val", "plays the [[env]] environments, and this SFT config has none"))
        return problems


def _lora_only_fields(cfg: RunConfig) -> list[tuple[str, str]]:
    """A problem for each LoRA setting a `[jax] finetune = "full"` config sets away from its default: it
    would have no effect. (Defaults pass: a saved run config, `run_config.json`, holds every field.)"""
    why = 'has no effect with [jax] finetune = "full" (every weight trains, there is no LoRA); remove it'
    keys = [f"jax.{k}" for k in ("lora_rank", "lora_targets")
            if getattr(cfg.jax, k) != JaxConfig.model_fields[k].get_default(call_default_factory=True)]
    keys += [k for k in ("lora_alpha", "adapters")
             if getattr(cfg, k) != RunConfig.model_fields[k].get_default(call_default_factory=True)]
    return [(k, why + ("; `jaxrl export` writes the whole model" if k == "adapters" else "")) for k in keys]


def load_config(path: str | Path) -> RunConfig:
    """Read, validate and resolve a TOML run config. `env_file` entries become absolute paths (relative
    ones are taken from the config file's folder). Raises ConfigError listing every problem found."""
    path = Path(path)
    data = read_toml(path)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(path, _problems(exc)) from None
    cfg._source = path.resolve()
    if cfg.name is None and (problem := folder_name_problem(path.stem)):
        raise ConfigError(path, [("name", f"not set, and the file's name {problem}; set name")])
    found, missing = [], []
    for key in ("env_file", "env_files"):
        for i, p in enumerate(getattr(cfg, key)):
            file = (cfg.config_dir / Path(p).expanduser()).resolve()
            found.append(str(file))
            if not file.is_file():
                what = ("a folder, not a .env file" if file.is_dir() else
                        "not a regular file (a device or a pipe)" if file.exists() else "file not found")
                missing.append((f"{key}.{i}", f"{what}: {file}"))
    if cfg.jax.sft is not None:
        data = (cfg.config_dir / Path(cfg.jax.sft.data).expanduser()).resolve()
        cfg.jax.sft.data = str(data)
        try:
            read_jsonl(data)  # every line, so a bad one is named before anything loads
        except FileNotFoundError:
            missing.append(("jax.sft.data", f"file not found: {data}"))
        except (OSError, DataError) as exc:
            missing.append(("jax.sft.data", str(exc)))
    missing += teacher_file_problems(cfg.jax.teacher, cfg.config_dir, _local_tokenizer(cfg))
    if missing:
        raise ConfigError(path, missing)
    cfg.env_file, cfg.env_files = found, []
    return cfg


def _local_tokenizer(cfg: RunConfig) -> str | None:
    """The student's tokenizer folder when it is on this machine without the network, else None."""
    if cfg.jax.teacher is None:
        return None
    if cfg.jax.tokenizer_path is not None:
        return str(cfg.config_dir / Path(cfg.jax.tokenizer_path).expanduser())
    try:
        found = locate_model_path(cfg)
    except ConfigError:
        return None  # the run says why the model is missing
    return found if isinstance(found, str) and not found.startswith("gs://") else None


def no_effect_notes(cfg: RunConfig) -> list[str]:
    """One `<key>: <why>` line per Hosted Training field set in `cfg` that has no effect in a local run
    (they address Prime's cloud or its inference server)."""
    notes = []
    cloud = "addresses Prime's cloud; no effect in a local run"
    if cfg.cluster_name is not None:
        notes.append(f"cluster_name: {cloud}")
    if cfg.run_config:
        notes.append(f"run_config: {cloud}")
    if cfg.tailscale is not None:
        notes.append(f"tailscale: {cloud} (environments run in the trainer's process)")
    if cfg.sampling.extra_body:
        notes.append("sampling.extra_body: extra fields of Hosted Training's inference requests; no effect here")
    if cfg.sampling.reasoning_effort is not None:
        notes.append("sampling.reasoning_effort: Qwen3 has no reasoning effort control; no effect here "
                     "(enable_thinking is its switch)")
    return notes


def resolve_model_path(cfg: RunConfig) -> str:
    """The checkpoint folder (or `gs://` URL) to load weights from: `jax.model_path`, else `model`, each
    found as a `gs://` URL, a local folder (relative to the config file) or an HF id in the local HF cache,
    else downloaded from the Hub at `jax.model_revision` (`jaxrl.config.hub.resolve_model`).
    Raises ConfigError naming every place looked in, or why the download failed."""
    key, where = ("jax.model_path", cfg.jax.model_path) if cfg.jax.model_path else ("model", cfg.model)
    try:
        return resolve_model(where, cfg.config_dir, cfg.jax.model_revision)
    except ModelNotFoundError as exc:
        raise ConfigError(cfg.source, [(key, str(exc))]) from None


def locate_model_path(cfg: RunConfig) -> str | HubModel:
    """Where `resolve_model_path` would find the weights, without the network: a folder, `gs://` URL or
    cached snapshot, or the `HubModel` it would download. Raises ConfigError as it does, also for a
    `HubModel` while HF_HUB_OFFLINE is set (`resolve_model_path` would refuse to download it)."""
    key, where = ("jax.model_path", cfg.jax.model_path) if cfg.jax.model_path else ("model", cfg.model)
    try:
        found = locate_model(where, cfg.config_dir, cfg.jax.model_revision)
    except ModelNotFoundError as exc:
        raise ConfigError(cfg.source, [(key, str(exc))]) from None
    if isinstance(found, HubModel) and hub_offline():
        raise ConfigError(cfg.source, [(key, f"{found.offline_refusal()} (and there is no folder "
                                             f"{cfg.config_dir / where})")])
    return found


def resolve_tokenizer_path(cfg: RunConfig) -> str:
    """The tokenizer folder: `jax.tokenizer_path` (relative to the config file), else the model's."""
    if cfg.jax.tokenizer_path is None:
        return resolve_model_path(cfg)
    folder = cfg.config_dir / Path(cfg.jax.tokenizer_path).expanduser()
    if not folder.is_dir():
        raise ConfigError(cfg.source, [("jax.tokenizer_path", f"{cfg.jax.tokenizer_path!r} is not a folder")])
    return str(folder.resolve())


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    """Turn pydantic errors into `(dotted key, reason)` pairs in the words of a TOML file."""
    problems = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, BrokenRules):
            problems += cause.problems
        elif err["type"] == "extra_forbidden":
            problems.append((key, _unknown_key(err["loc"])))
        elif err["type"] == "missing":
            problems.append((key, "required key is missing"))
        elif err["type"] == "value_error":  # raised by our own validators, which quote the value
            problems.append((key, err["msg"].removeprefix("Value error, ")))
        else:
            problems.append((key, f"{err['msg']}, got {repr(err['input'])[:60]}"))
    return problems


def _unknown_key(loc: tuple[str | int, ...]) -> str:
    table: type[BaseModel] | None = RunConfig
    for part in loc[:-1]:
        if table is not None and isinstance(part, str):
            field = table.model_fields.get(part)
            table = _model_in(field.annotation) if field else None
    if table is None:
        return "unknown key"
    if table is RunConfig and loc[-1] in JaxConfig.model_fields:
        return f"unknown key (it belongs in the [jax] table: jax.{loc[-1]})"
    known = list(table.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
    return f"unknown key ({hint})"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in get_args(annotation) if (m := _model_in(arg))), None)
