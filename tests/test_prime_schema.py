"""Differential test against the real `prime` CLI's own Hosted Training config model (prime 0.6.8, a test
dependency): over the seed examples (configs/examples) and mutants of them, every file that prime's
`RLConfig` accepts and the seeds' documented rules allow is accepted by jaxrl (issue 16: prime's
`max_inflight_rollouts`, `env_files`, `[sampling] seed`, `min_tokens`, ... were refused as unknown keys).

prime 0.6.8's package `__init__` imports names that the `prime-sandboxes` verifiers pins does not have,
so its config classes are taken from its installed source (`prime_cli/commands/rl.py`) and run as they
are, without the CLI around them."""

import ast
import copy
import importlib.metadata
import importlib.util
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, Optional

import pydantic
import pytest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from typer.testing import CliRunner

from jaxrl.cli.main import app
from jaxrl.config.schema import RunConfig

EXAMPLES = sorted((Path(__file__).parents[1] / "configs" / "examples").glob("*.toml"))
PRIME_CLASSES = ("EnvConfig", "EvalEnvConfig", "TemperatureSchedulerConfig", "SamplingConfig", "EvalConfig",
                 "ValConfig", "BufferConfig", "WandbConfig", "CheckpointsConfig", "AdaptersConfig",
                 "InfrastructureConfig", "TailscaleConfig", "RLConfig")


@pytest.fixture(scope="module")
def prime_rlconfig() -> type[BaseModel]:
    assert importlib.metadata.version("prime") == "0.6.8", "pip install -e '.[test]' (prime==0.6.8)"
    source = Path(importlib.util.find_spec("prime_cli").submodule_search_locations[0]) / "commands" / "rl.py"
    tree = ast.parse(source.read_text())
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in PRIME_CLASSES]
    assert [c.name for c in classes] == list(PRIME_CLASSES)
    scope = {"os": os, "re": re, "Any": Any, "Dict": dict, "List": list, "Literal": Literal, "Optional": Optional,
             "BaseModel": BaseModel, "ConfigDict": ConfigDict, "Field": Field, "field_validator": field_validator,
             "model_validator": model_validator, "__name__": "prime_rl_config"}
    exec(compile(ast.Module(body=classes, type_ignores=[]), str(source), "exec"), scope)  # noqa: S102
    return scope["RLConfig"]


def prime_accepts(rlconfig: type[BaseModel], data: dict) -> bool:
    """What `prime rl run` does with a parsed file: drop the deprecated `trajectory_strategy`, validate."""
    data = {k: v for k, v in data.items() if k != "trajectory_strategy"}
    try:
        rlconfig.model_validate(data)
    except pydantic.ValidationError:
        return False
    return True


def seeds_allow(data: dict) -> bool:
    """The rules the seeds (/work/shared/seeds, the Hosted Training docs) state, read as written:
    counts are positive integers, `batch_size` a multiple of `rollouts_per_example`, `temperature >= 0`,
    env ids `owner/name[@version]` and at least one `[[env]]`, `oversampling_factor` "this many more"
    rollouts (>= 1) and `max_async_level >= oversampling_factor`, `max_tokens` below the sequence length
    (4096 here), `keep_cloud`/`keep_last` N or -1, adapters `interval` 0 or more, eval `num_examples` -1
    or N, thresholds and fractions in [0, 1] with "hard" below "easy", `env_ratios` one per env with
    several envs ("ratio between envs"), `compute_size` S, M or L; the
    learning rate positive. Issue 16's rule: seeds >= 0. vLLM's rules for the sampling fields Hosted
    passes on: `repetition_penalty > 0`, `0 <= min_tokens <= max_tokens`."""
    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    def n_or_all(v: Any) -> bool:
        return isinstance(v, int) and (v == -1 or v >= 1)

    top = data
    if not all(count(top.get(k, 1)) for k in ("max_steps", "batch_size", "rollouts_per_example")):
        return False
    if top.get("batch_size", 128) % top.get("rollouts_per_example", 8):
        return False
    if top.get("learning_rate", 1) <= 0 or not count(top.get("lora_alpha", 1)):
        return False
    oversampling = top.get("oversampling_factor", 2.0)
    if oversampling < 1 or top.get("max_async_level", 2) < oversampling:
        return False
    s = top.get("sampling", {})
    if s.get("temperature", 0) < 0 or not (count(s.get("max_tokens", 1)) and s.get("max_tokens", 1) < 4096):
        return False
    if s.get("repetition_penalty", 1) <= 0 or not 0 <= s.get("min_tokens", 0) <= s.get("max_tokens", 4095):
        return False
    if s.get("seed", 0) < 0 or top.get("buffer", {}).get("seed", 0) < 0:
        return False
    envs = top.get("env", []) + top.get("eval", {}).get("env", [])
    if not top.get("env") or not all(re.fullmatch(r"[\w.-]+/[\w.-]+(@[\w.-]+)?", e["id"]) for e in envs):
        return False
    b = top.get("buffer", {})
    if not all(0 <= b.get(k, 0.5) <= 1 for k in ("easy_threshold", "hard_threshold", "easy_fraction",
                                                  "hard_fraction")):
        return False
    if b.get("hard_threshold", 0.2) > b.get("easy_threshold", 0.8):
        return False
    if len(top["env"]) > 1 and len(b.get("env_ratios", top["env"])) != len(top["env"]):
        return False  # "ratio between envs (multi-env only)": one per env
    if not n_or_all(top.get("checkpoints", {}).get("keep_cloud", 5)) or \
            not n_or_all(top.get("adapters", {}).get("keep_last", 3)) or top.get("adapters", {}).get("interval", 0) < 0:
        return False
    if not n_or_all(top.get("eval", {}).get("num_examples", -1)):
        return False
    return top.get("infrastructure", {}).get("compute_size", "M") in ("S", "M", "L")


MUTATIONS: list[tuple[tuple, Any]] = [
    (("name",), "exp-2"), (("max_steps",), 1), (("max_steps",), 0), (("batch_size",), 64), (("batch_size",), 7),
    (("rollouts_per_example",), 16), (("rollouts_per_example",), 1), (("learning_rate",), 3e-5),
    (("learning_rate",), 0.0), (("lora_alpha",), 32), (("oversampling_factor",), 1.0), (("oversampling_factor",), 0.5),
    (("oversampling_factor",), 4.0), (("max_async_level",), 0), (("max_async_level",), 8),
    (("trajectory_strategy",), "branching"), (("checkpoint_id",), "cp_abc123"), (("env_files",), ["secrets.env"]),
    (("max_inflight_rollouts",), 256), (("max_inflight_rollouts",), 4), (("max_inflight_rollouts",), 64),
    (("cluster_name",), "c1"), (("run_config",), {"a": 1}), (("unknown_key",), 1),
    (("sampling", "max_tokens"), 1), (("sampling", "max_tokens"), 4095), (("sampling", "temperature"), 0.0),
    (("sampling", "temperature"), 0.7), (("sampling", "temperature"), -0.1),
    (("sampling", "repetition_penalty"), 1.1), (("sampling", "min_tokens"), 0), (("sampling", "min_tokens"), 16),
    (("sampling", "seed"), 0), (("sampling", "seed"), 7), (("sampling", "seed"), -3),
    (("sampling", "temp_scheduler"), {"type": "cosine", "start_temperature": 1.0, "end_temperature": 0.3,
                                      "total_steps": 50}),
    (("sampling", "temp_scheduler"), {"start_temperature": 1.2, "end_temperature": 0.6}),
    (("sampling", "extra_body"), {"top_k": 20}), (("sampling", "enable_thinking"), True),
    (("sampling", "enable_thinking"), False), (("sampling", "reasoning_effort"), "high"),
    (("sampling",), {"max_tokens": 256, "enable_thinking": True, "reasoning_effort": "low"}),
    (("env", 0, "max_retries"), 0), (("env", 0, "max_retries"), 3), (("env", 0, "version"), "0.1.2"),
    (("env", 0, "id"), "primeintellect/reverse-text@0.1.3"), (("env", 0, "name"), "rt"),
    (("eval",), {"interval": 10, "env": [{"id": "primeintellect/gsm8k", "max_retries": 2, "version": "1.0",
                                          "num_examples": -1}]}),
    (("eval",), {"num_examples": 5, "rollouts_per_example": 2}), (("val",), {"num_examples": 8, "interval": 2}),
    (("buffer", "seed"), 0), (("buffer", "seed"), 7), (("buffer", "seed"), -1),
    (("buffer", "online_difficulty_filtering"), True), (("buffer", "easy_threshold"), 1.0),
    (("buffer", "hard_threshold"), 0.0), (("buffer", "hard_threshold"), 0.9), (("buffer", "env_ratios"), [1.0]),
    (("checkpoints", "interval"), 5), (("checkpoints", "keep_cloud"), -1), (("checkpoints", "keep_cloud"), 1),
    (("adapters", "interval"), 0), (("adapters", "interval"), 10), (("adapters", "keep_last"), -1),
    (("infrastructure", "compute_size"), "L"), (("infrastructure", "compute_size"), "XL"),
    (("wandb", "project"), "p"), (("tailscale",), {"enabled": False}),
    (("tailscale",), {"enabled": True, "auth_key": "tskey-auth-abc"}), (("tailscale",), {"hostname_prefix": "abc"}),
]


def mutants() -> list[tuple[str, dict]]:
    """Each seed example as it is, then with each of `MUTATIONS` applied alone."""
    corpus = []
    for path in EXAMPLES:
        seed = tomllib.loads(path.read_text())
        corpus.append((path.stem, seed))
        for keys, value in MUTATIONS:
            data = copy.deepcopy(seed)
            node = data
            for key in keys[:-1]:
                node = node[key] if isinstance(key, int) else node.setdefault(key, {})
            node[keys[-1]] = value
            corpus.append((f"{path.stem}: {'.'.join(map(str, keys))} = {value!r}", data))
    return corpus


def jaxrl_problems(data: dict) -> str | None:
    try:
        RunConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        return str(exc)
    return None


def test_every_file_prime_accepts_and_the_seeds_allow_is_accepted(prime_rlconfig):
    corpus = mutants()
    both = [(label, data) for label, data in corpus if prime_accepts(prime_rlconfig, data) and seeds_allow(data)]
    refused = [(label, jaxrl_problems(data)) for label, data in both if jaxrl_problems(data)]
    assert not refused, "\n".join(f"{label}: {why}" for label, why in refused)
    assert len(corpus) == len(EXAMPLES) * (len(MUTATIONS) + 1) and len(both) > len(corpus) // 2
    # the rules discriminate: files prime refuses, and files prime accepts that the seeds do not allow
    assert any(not prime_accepts(prime_rlconfig, d) for _, d in corpus)
    assert any(prime_accepts(prime_rlconfig, d) and not seeds_allow(d) for _, d in corpus)


def test_every_seed_example_is_accepted_by_prime_too(prime_rlconfig):
    for path in EXAMPLES:
        assert prime_accepts(prime_rlconfig, tomllib.loads(path.read_text())), path


def test_hosted_fields_with_no_effect_here_are_accepted_with_a_note(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text('model = "m"\ncluster_name = "c1"\n[sampling]\nreasoning_effort = "low"\nextra_body = { a = 1 }\n'
                    '[[env]]\nid = "o/e"\n[tailscale]\nenabled = false\n[run_config]\nx = 1\n'
                    '[jax]\nmodel_path = "."\n')  # a folder: validate exits 2 for a model `run` cannot find
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    for key in ("cluster_name", "run_config", "tailscale", "sampling.extra_body", "sampling.reasoning_effort"):
        assert f"note: {path}: {key}: " in result.stderr, result.stderr


def test_max_inflight_rollouts_and_env_files_mean_what_they_say(tmp_path):
    (tmp_path / "a.env").write_text("A=1\n")
    (tmp_path / "b.env").write_text("B=2\n")
    path = tmp_path / "rl.toml"
    path.write_text('model = "m"\nbatch_size = 16\nrollouts_per_example = 4\nmax_inflight_rollouts = 40\n'
                    'env_file = ["a.env"]\nenv_files = ["b.env"]\n[sampling]\nseed = 5\n[[env]]\nid = "o/e"\n')
    from jaxrl.config.schema import load_config
    from jaxrl.rl.producer import in_flight_groups

    cfg = load_config(path)
    assert cfg.oversampling_factor == 2.5 and in_flight_groups(cfg.batch_size, 4, cfg.oversampling_factor) == 10
    assert cfg.env_file == [str(tmp_path / "a.env"), str(tmp_path / "b.env")]
    assert cfg.sampling_seed == 5 and cfg.jax.seed == 0
    path.write_text(path.read_text().replace("env_files = [\"b.env\"]", "env_files = [\"c.env\"]"))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and f"{path}: env_files.0: file not found" in result.stderr


def test_repetition_penalty_min_tokens_and_enable_thinking_reach_both_rollout_clients(tiny_model_dir):
    """v1 environments: the Qwen3 renderer's switch and the request's sampling fields; classic ones: the
    chat request's `chat_template_kwargs`, `repetition_penalty` and `min_tokens` (left out when unset)."""
    from types import SimpleNamespace

    from jaxrl.envs import classic, loader
    from jaxrl.inference.protocol import SamplingParams

    sampling = SamplingParams(repetition_penalty=1.3, max_tokens=8, min_tokens=3)
    context = loader.model_context("http://127.0.0.1:1/v1", "m", tiny_model_dir, sampling, enable_thinking=True)
    assert context.client.renderer.enable_thinking is True
    assert context.sampling.model_dump()["repetition_penalty"] == 1.3
    assert context.sampling.wire_args()["min_tokens"] == 3  # what the train client sends as sampling_params
    assert loader.model_context("http://127.0.0.1:1/v1", "m", tiny_model_dir, sampling).client.renderer \
        .enable_thinking is False
    args = classic.sampling_args(SimpleNamespace(sampling_args=None), sampling, 0, enable_thinking=True)
    assert args["extra_body"]["chat_template_kwargs"] == {"enable_thinking": True}
    assert args["extra_body"]["repetition_penalty"] == 1.3 and args["extra_body"]["min_tokens"] == 3
    plain = classic.sampling_args(SimpleNamespace(sampling_args=None), SamplingParams(), 0)
    assert not {"chat_template_kwargs", "repetition_penalty", "min_tokens"} & set(plain["extra_body"])
    assert "min_tokens" not in loader.model_context("http://127.0.0.1:1/v1", "m", tiny_model_dir,
                                                    SamplingParams()).sampling.wire_args()


def test_an_env_version_pin_is_checked_against_the_installed_package():
    from jaxrl.envs import loader

    assert loader.installed_version("echo_word") == "0.1.0"
    args = {"num_train_examples": 2, "num_eval_examples": 0}
    assert loader.load_env("jaxrl/echo-word@0.1.0", args).tasks
    assert loader.load_env("jaxrl/echo-word@9", args, version="0.1.0").tasks  # `version` wins, as in prime
    with pytest.raises(loader.EnvLoadError, match="version 9.9 is pinned, but the installed package is version 0.1.0"):
        loader.load_env("jaxrl/echo-word", args, version="9.9")
    with pytest.raises(loader.EnvLoadError, match="version 2 is pinned"):
        loader.load_env("jaxrl/echo-word@2", args)
