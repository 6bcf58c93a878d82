"""`jaxrl gepa run`'s settings: `configs/gepa/*.toml` as verifiers' `vf-gepa` reads them, and the same
settings from `prime gepa run` / `vf-gepa`'s flags, validated into one `GepaConfig` (so a file and its flags
give the same run).

    model = "assets/qwen3-tiny"          # -m: local model folder / jaxrl run or checkpoint, or an endpoint's model
    reflection_model = "..."             # -M: default `model` (served once when local)
    api_base_url = "..."                 # -b, api_key_var = "..." -k, endpoints_path = "..." -e
    run_dir = "outputs/gepa/lowercase"   # -o; relative paths in the file are taken from its folder

    [[env]]                              # exactly one; [env] too
    env_id = "jaxrl/echo-word"           # or Hosted Training's `id`
    env_args = { num_eval_examples = 8 } # or `args`

    [gepa]                               # vf-gepa's: max_calls (-B), minibatch_size, perfect_score, state_columns,
    max_calls = 500                      # num_train (-n), num_val (-N), max_concurrent (-c), seed
    [sampling]                           # -S: a run config's [sampling] keys
    [jax]                                # jaxrl's additions: seq_len, decode_slots, reflection_max_tokens,
                                         # max_failed_proposals

Unknown keys, wrong types and out-of-range values are errors naming the file (or "flags") and the key
(`jaxrl.config.schema.ConfigError`); this module imports no JAX.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from jaxrl.config.base import Table
from jaxrl.config.schema import ConfigError, SamplingConfig, read_toml

FLAGS = "flags"
"""The `source` of a config built from flags alone, as errors name it."""


class GepaEnvConfig(Table):
    """`[[env]]`: the environment whose system prompt is optimised."""

    env_id: str = Field(min_length=1)
    """An installed environment's id (`owner/name` or `name`); Hosted Training's `id` is accepted too."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """`load_environment` / taskset arguments; Hosted Training's `args` is accepted too."""

    @model_validator(mode="before")
    @classmethod
    def _hosted_spelling(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for hosted, ours in (("id", "env_id"), ("args", "env_args")):
            if hosted in data:
                if ours in data:
                    raise ValueError(f"set {ours} or {hosted}, not both")
                data[ours] = data.pop(hosted)
        return data


class GepaSearchConfig(Table):
    """`[gepa]`: the search (vf-gepa's keys and defaults)."""

    max_calls: int = Field(500, ge=1)
    """Rollout budget (gepa's max_metric_calls), -B. Default 500."""
    minibatch_size: int = Field(3, ge=1)
    """Train examples per reflection, --minibatch-size. Default 3."""
    perfect_score: float | None = None
    """A minibatch whose every score reaches this is not reflected on. Default None: every one is."""
    state_columns: list[str] = Field(default_factory=list)
    """Extra rollout state fields shown to the reflection model (classic envs: state keys; v1: trace info
    or task data fields)."""
    num_train: int = Field(100, ge=1)
    """Train examples (reflection minibatches come from them), -n. Default 100."""
    num_val: int = Field(50, ge=1)
    """Validation examples (every accepted candidate is scored on them; the Pareto frontier), -N. Default 50."""
    max_concurrent: int = Field(32, ge=1)
    """Rollouts in flight at once, -c. Default 32."""
    seed: int = Field(0, ge=0)
    """gepa's seed (minibatch order, candidate choice) and the rollouts' sampling seed. Default 0."""


class GepaJaxConfig(Table):
    """`[jax]`: what vf-gepa has no key for."""

    seq_len: int = Field(4096, ge=2)
    """A local model's tokens per sequence (prompt + completion), --seq-len. Default 4096."""
    decode_slots: int = Field(32, ge=1)
    """A local model's sequences decoded at once, --decode-slots. Default 32."""
    reflection_max_tokens: int = Field(2048, ge=1)
    """Tokens of one reflection reply, --reflection-max-tokens; a reply cut there is a failed proposal.
    Default 2048."""
    max_failed_proposals: int = Field(5, ge=1)
    """Failed proposals in a row that stop the run with an error, --max-failed-proposals. Default 5."""


class GepaConfig(Table):
    """A GEPA run: the top-level keys of vf-gepa's TOML and the tables above."""

    model: str = Field(min_length=1)
    """Model of the rollouts, -m."""
    reflection_model: str | None = None
    """Model of the reflection (teacher), -M. Default None: `model`."""
    api_base_url: str | None = None
    """An OpenAI-compatible endpoint for `model` (and `reflection_model`), -b."""
    api_key_var: str | None = None
    """Environment variable holding that endpoint's key, -k."""
    endpoints_path: str = "configs/endpoints.toml"
    """Endpoint aliases (verifiers' endpoints.toml), -e."""
    run_dir: str | None = None
    """Output folder, -o. Default None: `outputs/gepa/<env>--<model>/<time>`."""
    env: list[GepaEnvConfig] = Field(min_length=1, max_length=1)
    """The environment ([[env]] or [env]); exactly one."""
    gepa: GepaSearchConfig = Field(default_factory=GepaSearchConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """The rollouts' sampling, -S."""
    jax: GepaJaxConfig = Field(default_factory=GepaJaxConfig)

    @model_validator(mode="before")
    @classmethod
    def _one_env_table(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("env"), dict):
            data = {**data, "env": [data["env"]]}
        return data


def validate(raw: dict[str, Any], source: str | Path) -> GepaConfig:
    """`raw` (a TOML file's tables, or `from_flags`'s) as a `GepaConfig`.

    Raises:
        ConfigError: one `<source>: <key>: <reason>` line per problem.
    """
    try:
        return GepaConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(source, problems(exc)) from None


def problems(exc: ValidationError) -> list[tuple[str, str]]:
    """pydantic's errors as `(dotted key, reason)` pairs in a TOML file's words."""
    out = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            out.append((key, "unknown key"))
        elif err["type"] == "missing":
            out.append((key, "required key is missing"))
        elif err["type"] == "too_long" and err["loc"] == ("env",):
            out.append((key, "jaxrl gepa optimises one environment's prompt; give one [[env]]"))
        elif err["type"] == "value_error":
            out.append((key, err["msg"].removeprefix("Value error, ")))
        else:
            out.append((key, f"{err['msg']}, got {repr(err.get('input'))[:60]}"))
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """A GEPA TOML file's tables, with `run_dir`, `endpoints_path` and a `model` that is a folder next to the
    file made absolute from the file's folder (vf-gepa does so for the first two).

    Raises:
        ConfigError: the file is missing, unreadable or not TOML.
    """
    path = Path(path)
    raw = read_toml(path)
    here = path.resolve().parent
    for key in ("run_dir", "endpoints_path"):
        if isinstance(raw.get(key), str) and not Path(raw[key]).expanduser().is_absolute():
            raw[key] = str(here / raw[key])
    for key in ("model", "reflection_model"):
        if isinstance(raw.get(key), str) and (here / raw[key]).is_dir():
            raw[key] = str((here / raw[key]).resolve())
    return raw


def from_flags(env_or_config: str, flags: dict[str, Any]) -> GepaConfig:
    """The run of `jaxrl gepa run ENV_OR_CONFIG [flags]`: ENV_OR_CONFIG a `.toml` file (its settings, each
    flag given overriding its key) or an environment id (the flags alone). `flags` maps each flag given
    (None: not given) to its config key, dotted for a table (`gepa.max_calls`, `env_args`, `sampling`).

    Raises:
        ConfigError: naming the file, or "flags", and each bad key.
    """
    given = {k: v for k, v in flags.items() if v is not None}
    if env_or_config.endswith(".toml"):
        raw, source = load_toml(env_or_config), env_or_config
        env = raw.get("env")
        if "env_args" in given and isinstance(env, dict | list):
            envs = [env] if isinstance(env, dict) else env
            raw["env"] = [{**{k: v for k, v in e.items() if k != "args"}, "env_args": given["env_args"]}
                          if isinstance(e, dict) else e for e in envs]
    else:
        raw, source = {"env": [{"env_id": env_or_config, "env_args": given.get("env_args", {})}]}, FLAGS
    given.pop("env_args", None)
    for key, value in given.items():
        table, _, name = key.rpartition(".")
        if table:
            raw[table] = {**(raw.get(table) or {}), name: value}
        elif isinstance(value, dict) and isinstance(raw.get(name), dict):  # -S over [sampling]: key by key
            raw[name] = {**raw[name], **value}
        else:
            raw[name] = value
    return validate(raw, source)
