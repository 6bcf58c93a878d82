"""Every numeric field's whole domain is checked by `jaxrl validate`, so that a config that validates does
not fail later for a reason validation could have seen (issue 16: `[buffer] seed = -1` died after model
load with a numpy traceback; `temperature = inf` failed the pre-flight with a JSON error).

The property test draws configs from the schema itself (every table and field of `RunConfig`, values
at and past each domain's edges) and checks that each is either refused with `file: key: reason` lines
or gets through run set-up: the calls the run loop makes with the config's values before its first
rollout, on the tiny model's shapes, minus loading weights and compiling (`set_up` below)."""

import json
import math
import re
import types
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from typer.testing import CliRunner

from jaxrl.cli.main import app
from jaxrl.config.base import INT_MAX
from jaxrl.config.schema import SEED_MULTIPLIER, ConfigError, RunConfig, load_config
from jaxrl.envs import loader
from jaxrl.inference import wire
from jaxrl.inference.protocol import SamplingParams
from jaxrl.model import hf
from jaxrl.model.modules import init_lora
from jaxrl.rl.buffer import Buffer, BufferState
from jaxrl.rl.producer import in_flight_groups
from jaxrl.rl.rollouts import temperature_at
from jaxrl.rl.train import learning_rate, make_optimizer
from jaxrl.run import resources

BASE = """\
model = "m"

[[env]]
id = "o/env"
"""


def problems_of(tmp_path: Path, text: str) -> str:
    path = tmp_path / "rl.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


@pytest.mark.parametrize(("top", "tables", "expected"), [
    ("", "[sampling]\ntemperature = inf", "sampling.temperature: Input should be a finite number, got inf"),
    ("", "[sampling]\ntemperature = nan", "sampling.temperature: Input should be a finite number, got nan"),
    ("", "[sampling]\ntemperature = 1e39", "sampling.temperature: 1e+39 is beyond float32's range"),
    ("", "[buffer]\nseed = -1", "buffer.seed: Input should be greater than or equal to 0, got -1"),
    ("", "[jax]\nseed = -1", "jax.seed: Input should be greater than or equal to 0, got -1"),
    ("", "[buffer]\nenv_ratios = [1.0, inf]", "buffer.env_ratios.1: Input should be a finite number, got inf"),
    ("", "[jax]\nrollout_timeout = inf", "jax.rollout_timeout: Input should be a finite number, got inf"),
    ("learning_rate = nan", "", "learning_rate: Input should be a finite number, got nan"),
    ("max_steps = 1180591620717411303424", "", "max_steps: 1180591620717411303424 is beyond 2147483647"),
    ("", "[sampling]\nmax_tokens = 2147483648", "sampling.max_tokens: 2147483648 is beyond 2147483647"),
    ("", "[eval]\ninterval = 99999999999", "eval.interval: 99999999999 is beyond 2147483647"),
    ("", "[sampling]\nmin_tokens = 4096", "sampling.min_tokens: 4096 must be < jax.seq_len (4096)"),
    ("rollouts_per_example = 65536\nbatch_size = 65536", "[jax]\nseed = 2147483647",
     "jax.seed: 2147483647 is too large for rollouts_per_example = 65536"),
])
def test_values_that_would_fail_later_are_refused(tmp_path, top, tables, expected):
    message = problems_of(tmp_path, f"{top}\n{BASE}{tables}\n")
    assert f"{tmp_path / 'rl.toml'}: {expected}" in message, message


def test_a_mesh_of_another_device_count_stops_the_run_as_a_config_error(tmp_path, tiny_model_dir):
    """Only the devices tell whether the mesh fits: `jaxrl run` says so before loading the model (this
    test session has 8 emulated devices)."""
    path = tmp_path / "rl.toml"
    path.write_text(f'name = "mesh"\n{BASE}[jax]\nmodel_path = "{tiny_model_dir}"\noutput_dir = "{tmp_path}"\n'
                    f'mesh = {{ fsdp = 3 }}\n')
    out = CliRunner().invoke(app, ["run", str(path)])
    assert out.exit_code == 2, out.output
    assert f"{path}: jax.mesh: mesh " in out.stderr and "needs 3 devices, but 8 are visible" in out.stderr


# -- the property test -------------------------------------------------------------------------------------------

SIZES = {"lora_rank", "seq_len", "decode_slots", "max_tokens", "num_examples"}
"""Fields that size memory in set-up or a run: drawn small, or past the int32 limit (refused)."""
EDGE_INTS = [-(2**63), -(2**31) - 1, -2, -1, 0, 1, 2, 3, 7, 8, 64, INT_MAX, INT_MAX + 1, 2**63, 2**70]
EDGE_FLOATS = [math.inf, -math.inf, math.nan, -1.0, -0.0, 0.0, 1e-9, 0.2, 0.5, 0.8, 1.0, 1.5, 2.0, 4.0, 1e30, 1e39]
STRINGS = {
    "name": ["run", "..", ".", "a/b", "x\x00"],
    "id": ["jaxrl/lowercase", "o/env@1", "bad", "a/b/c"],
    "checkpoint_id": None, "model": None, "model_path": None, "tokenizer_path": None, "output_dir": None,
    "checkpoint_dir": None, "host": None, "env_file": None, "taskset": None, "harness": None, "args": None,
}
"""Candidate strings per field name; None: the field is left to `fixed` (set-up cannot vary it cheaply)."""


def _draw_value(name: str, annotation, draw) -> object:
    """A value of `annotation` for field `name`, at and past the domain's edges."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _draw_value(name, args[0], draw)
    if origin in (typing.Union, types.UnionType):
        return _draw_value(name, draw(st.sampled_from([a for a in args if a is not type(None)])), draw)
    if origin is typing.Literal:
        return draw(st.sampled_from([*args, "bogus"]))
    if origin is list:
        return [_draw_value(name, args[0], draw) for _ in range(draw(st.integers(0 if name != "env" else 1, 3)))]
    if annotation is bool:
        return draw(st.booleans())
    if annotation is int:
        small = st.integers(-3, 64)
        edges = st.sampled_from([v for v in EDGE_INTS if name not in SIZES or v <= 64 or v > INT_MAX])
        return draw(st.one_of(small, edges))
    if annotation is float:
        return draw(st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(0, 4)))
    return draw(st.sampled_from(STRINGS.get(name) or ["x"]))


def _leaves(model: type[BaseModel], prefix: tuple = ()) -> list[tuple[tuple, object]]:
    """`(path, annotation)` of every field of `model` and its tables, `[[...]]` tables at index 0."""
    out = []
    for name, field in model.model_fields.items():
        if STRINGS.get(name, "") is None or name == "mesh":
            continue
        annotation = field.annotation
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        inner = [a for a in typing.get_args(annotation) if a is not type(None)] if union else [annotation]
        table = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        row = next((typing.get_args(a)[0] for a in inner if typing.get_origin(a) is list and isinstance(
            typing.get_args(a)[0], type) and issubclass(typing.get_args(a)[0], BaseModel)), None)
        if table is not None:
            out += _leaves(table, (*prefix, name))
        elif row is not None:
            out += _leaves(row, (*prefix, name, 0))
        else:
            out.append(((*prefix, name), annotation))
    return out


LEAVES = _leaves(RunConfig)


@st.composite
def configs(draw) -> dict:
    """A valid base config with one to three fields of the schema set to values drawn at and past the
    edges of their domains (so that most draws probe one rule, not ten at once)."""
    data = {"env": [{"id": "jaxrl/lowercase"}], "eval": {"env": [{"id": "jaxrl/lowercase", "name": "e"}]},
            "sampling": {"max_tokens": 8}, "jax": {"seq_len": 64, "lora_rank": 2}}
    for path, annotation in draw(st.lists(st.sampled_from(LEAVES), min_size=1, max_size=3)):
        node = data
        for key in path[:-1]:
            node = node[key] if isinstance(key, int) else node.setdefault(key, {})
        node[path[-1]] = _draw_value(str(path[-1]), annotation, draw)
    return data


def set_up(cfg: RunConfig, model_dir: Path) -> None:
    """What the run loop does with the config's values before its first rollout, without loading weights
    or compiling: the LoRA and its optimizer on the tiny model's shapes, the buffer's first draws, the
    in-flight bound, the environments' CPU share, and the sampling request of a rollout with the largest
    seed the run gives one, as the rollout client sends it and the server parses it."""
    jcfg = cfg.jax
    mcfg = hf.load_config(str(model_dir))
    lora = init_lora(mcfg, jcfg.lora_rank, tuple(jcfg.lora_targets), jax.random.key(jcfg.seed))
    o = jcfg.optim  # as `jaxrl.rl.train.trainer_for` builds the optimizer and its schedule
    tx = make_optimizer(1.0, o.max_grad_norm, o.weight_decay, (o.beta1, o.beta2))
    params = {"base": {}, "lora": lora}
    tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    rates = learning_rate(jnp.array([0, cfg.max_steps - 1]), cfg.learning_rate, o.schedule, o.warmup_steps,
                          cfg.max_steps)
    assert bool(jnp.isfinite(rates).all()), rates
    jax.random.key(cfg.sampling_seed * SEED_MULTIPLIER + cfg.max_steps)  # the engine's base key on resume
    n = cfg.rollouts_per_example
    groups = cfg.batch_size // n
    buffer = Buffer(tuple(5 for _ in cfg.env), cfg.buffer)
    buffer.draw(BufferState.fresh(len(cfg.env)), min(groups, 16))
    in_flight_groups(cfg.batch_size, n, cfg.oversampling_factor)
    resources.env_resources(cfg.infrastructure.compute_size)
    last_group = 4 * cfg.max_steps * math.ceil(groups * cfg.oversampling_factor)
    seed = (cfg.sampling_seed * SEED_MULTIPLIER + last_group) * n + n - 1
    for step in (1, cfg.max_steps):  # the temperature of the first and the last step's groups
        sampling = SamplingParams(temperature=temperature_at(cfg.sampling, step, cfg.max_steps),
                                  top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
                                  repetition_penalty=cfg.sampling.repetition_penalty or 1.0,
                                  min_tokens=cfg.sampling.min_tokens or 0,
                                  max_tokens=cfg.sampling.max_tokens or jcfg.seq_len - 1, seed=seed)
        context = loader.model_context("http://127.0.0.1:1/v1", cfg.model, model_dir, sampling)
        body = json.loads(json.dumps(context.sampling.model_dump(exclude_none=True), allow_nan=False))
        wire.sampling_from(body, prompt_len=1, max_model_len=jcfg.seq_len, clamp_max_tokens=True)  # the run's server


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=configs())
def test_every_drawn_config_is_refused_clearly_or_sets_up(tmp_path, tiny_model_dir, data):
    data |= {"model": "jaxrl/qwen3-tiny"}
    data["jax"] = data.get("jax", {}) | {"model_path": str(tiny_model_dir), "output_dir": str(tmp_path)}
    path = tmp_path / "rl.toml"
    path.write_text(tomli_w.dumps(data))
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        lines = str(exc).splitlines()
        assert lines and all(re.match(rf"{re.escape(str(path))}: [\w.]+: \S", line) for line in lines), str(exc)
        return
    set_up(cfg, tiny_model_dir)
