"""What several test files share: the tiny-run config builder, the one way to start `jaxrl` in a subprocess
(waited for, or in the background with its output in a log), the metrics reader, a weight update in the middle of a
request, and the tiny trainer with its random batches. Test files import from here, never from each other."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[1]
# wall-clock metrics, and the engine's counts of its own work (`Engine.metrics`: prompts prefilled since the engine
# started, which a resumed run restarts and an engine group over processes, which does not share a group's
# prefill, counts differently)
NOT_REPRODUCIBLE = ("time/", "tokens_per_s", "engine/")


# --- a tiny run's config --------------------------------------------------------------------------------------

def run_toml(model: Path, output_dir: Path, *, name: str = "e2e", max_steps: int = 1, batch_size: int = 8,
             rollouts_per_example: int = 4, learning_rate: float | None = 1e-2, max_tokens: int = 8,
             decode_slots: int = 8, checkpoint_interval: int | None = 1, synchronous: bool = True, extra: str = "",
             tables: str = "", jax_extra: str = "", sampling: str = "", env: str = 'id = "jaxrl/lowercase"') -> str:
    """The TOML of a tiny run of `model` (a local HF folder) on one `[[env]]` (lowercase unless `env` says
    otherwise), writing under `output_dir`: 8 rollouts of 8 tokens per step, LoRA rank 4, seq_len 128, 8 decode
    slots.

    synchronous: `max_async_level = 0` and `oversampling_factor = 1`, so the run and its resume are reproducible
    token for token; False leaves the schema's defaults (or what `extra` sets).
    extra: top-level lines; tables: whole tables placed before `[jax]`; jax_extra: lines of `[jax]`;
    sampling: more lines of `[sampling]`; checkpoint_interval: `[checkpoints] interval`, None for no `[checkpoints]`
    table; learning_rate: None for the schema's default."""
    sync = "max_async_level = 0  # synchronous: reproducible token for token\noversampling_factor = 1" \
        if synchronous else ""
    lr = f"learning_rate = {learning_rate}" if learning_rate is not None else ""
    checkpoints = f"[checkpoints]\ninterval = {checkpoint_interval}\n" if checkpoint_interval is not None else ""
    return f"""
name = "{name}"
model = "jaxrl/qwen3-tiny"
max_steps = {max_steps}
batch_size = {batch_size}
rollouts_per_example = {rollouts_per_example}
{lr}
{sync}
{extra}

[sampling]
max_tokens = {max_tokens}
{sampling}

[[env]]
{env}

{checkpoints}
{tables}

[jax]
model_path = "{model}"
output_dir = "{output_dir}"
seq_len = 128
lora_rank = 4
decode_slots = {decode_slots}
{jax_extra}
"""


def write_run_config(path: Path, model: Path, **kwargs) -> Path:
    """`run_toml(model, path.parent / "runs", **kwargs)` written to `path`; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_toml(model, path.parent / "runs", **kwargs))
    return path


def shrink(text: str, replacements: list[tuple[str, str]]) -> str:
    """`text` with each `old` replaced by `new`, every `old` required to be there exactly once (a shipped config
    that changed under a test fails loudly instead of running at full size)."""
    for old, new in replacements:
        assert text.count(old) == 1, f"{old!r} is not in the config exactly once"
        text = text.replace(old, new)
    return text


# --- `jaxrl` in a subprocess ----------------------------------------------------------------------------------

def subprocess_env(devices: int = 1, **env: str) -> dict[str, str]:
    """This process's environment (with the session's compilation cache, see conftest.py) for a JAX subprocess
    that sees `devices` emulated CPU devices, plus `env`. The session's other XLA flags are kept, so a perturbed
    run (docs/developing.md: e.g. `XLA_FLAGS=--xla_cpu_max_isa=AVX`) reaches subprocesses too."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
    return os.environ | {"XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])} | env


def jaxrl(*args, devices: int = 1, timeout: float = 900, stdin: str | None = None, cwd: Path | None = None,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m jaxrl ARGS` run to its end (stdout and stderr captured apart, as text) with
    `subprocess_env(devices)`, or `env` when given."""
    return subprocess.run([sys.executable, "-m", "jaxrl", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, input=stdin, cwd=cwd, env=env or subprocess_env(devices))


def spawn(*args, log: Path, devices: int = 1, cwd: Path | None = None, **env: str) -> subprocess.Popen:
    """`python -m jaxrl ARGS` in the background with `subprocess_env(devices, **env)`, stdout and stderr to
    `log`."""
    return subprocess.Popen([sys.executable, "-m", "jaxrl", *map(str, args)], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=subprocess_env(devices, **env), cwd=cwd)


def start(cfg: Path, log: Path, devices: int = 1, **env: str) -> subprocess.Popen:
    """`jaxrl run cfg` in the background, from cfg's folder (see `spawn`)."""
    return spawn("run", cfg, log=log, devices=devices, cwd=cfg.parent, **env)


def start_pair(cfg: Path, log_dir: Path, name: str) -> list[subprocess.Popen]:
    """`jaxrl run cfg` as processes 0 and 1 of a 2 x 4-device run joined on 127.0.0.1 through the JAX_*
    variables (see `start`); their logs are `<log_dir>/<name>-<pid>.log`."""
    from gcs_fixtures import free_port

    port = free_port()
    return [start(cfg, log_dir / f"{name}-{pid}.log", devices=4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                  JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid)) for pid in range(2)]


def wait_for(proc: subprocess.Popen, log: Path, text: str, timeout: float = 600) -> None:
    """Until `text` is in `log`; fails if the process exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"exited {proc.returncode} before {text!r}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout}s:\n{log.read_text()}"
        time.sleep(0.05)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 900) -> tuple[int, str]:
    """(exit code, the log's text) once `proc` has exited."""
    proc.wait(timeout)
    return proc.returncode, log.read_text()


# --- what a run wrote -----------------------------------------------------------------------------------------

def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of `<run_dir>/metrics.jsonl`, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def reproducible(rows: list[dict]) -> list[dict]:
    """`rows` without their wall-clock metrics and engine work counts (`NOT_REPRODUCIBLE`)."""
    return [{k: v for k, v in r.items() if not k.startswith(NOT_REPRODUCIBLE)} for r in rows]


# --- the rollout server, recorded ----------------------------------------------------------------------------

SERVED_MODEL = "policy"  # the model name the recording server answers to


class Recording:
    """The real scheduler behind the server, recording each request's prompt ids, completion, logprobs
    and seed in `calls` (a test that reads it sets it to [] first)."""

    def __init__(self, scheduler):
        self.scheduler, self.model_name, self.max_model_len = scheduler, SERVED_MODEL, scheduler.max_model_len
        self.calls: list[tuple[list[int], list[int], list[float], int | None]] = []

    async def generate(self, prompt_ids, params, *args, **kwargs):
        out = await self.scheduler.generate(prompt_ids, params, *args, **kwargs)
        self.calls.append((list(prompt_ids), list(out.token_ids), list(out.logprobs), params.seed))
        return out


class Scripted:
    """A backend that answers with the texts queued in `replies` (one per request, in order; tokenized, then the
    template's end-of-turn id), token i with logprob -0.25 - i / 100, each handed over through `on_token` when
    given; records each request's prompt ids in `prompts`. For tests whose model must say something exact."""

    model_name = "scripted"
    max_model_len = 2048

    def __init__(self, template):
        self.template = template  # jaxrl.inference.template.ChatTemplate
        self.replies: list[str] = []
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, params, on_token=None):
        from jaxrl.inference.protocol import Completion

        self.prompts.append(list(prompt_ids))
        ids = self.template.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
        ids.append(self.template.stop_token_ids[0])
        lps = [-0.25 - i / 100 for i in range(len(ids))]
        for t, lp in zip(ids, lps, strict=True):
            if on_token is not None:
                on_token(t, lp)
        return Completion(ids, lps, "stop", [0] * len(ids))


# --- new weights in the middle of a request -------------------------------------------------------------------

def generate_with_an_update(sched, prompt: list[int], sampling, new_params, when):
    """`sched.generate(prompt, sampling)` (a `jaxrl.inference.scheduler.Scheduler`) run to its end, with
    `sched.update_params(new_params, version=1)` called as soon as `when()` is true (polled every millisecond
    while the request decodes); the scheduler is stopped after. Returns the request's `Completion`."""
    import asyncio

    async def go():
        task = asyncio.ensure_future(sched.generate(prompt, sampling))
        while not when():
            await asyncio.sleep(0.001)
        sched.update_params(new_params, version=1)
        return await task

    try:
        return asyncio.run(go())
    finally:
        sched.stop()


def version_switch(completion, old: np.ndarray) -> int:
    """The index of `completion`'s first token of policy version 1 (`generate_with_an_update`), once its versions
    are checked to go from 0 to 1 without going back, and its logprobs against `old` (the old weights' logprob
    of each of its tokens, from a full forward pass): the same before the switch (atol 1e-4, the old weights
    scored them), over 90% of them more than 1e-3 off after it (the new weights scored them)."""
    v = np.array(completion.policy_versions)
    switch = int(np.argmax(v == 1))
    assert v[0] == 0 and v[-1] == 1 and (np.diff(v) >= 0).all(), v
    np.testing.assert_allclose(completion.logprobs[:switch], old[:switch], atol=1e-4)
    assert np.mean(np.abs(np.array(completion.logprobs[switch:]) - old[switch:]) > 1e-3) > 0.9
    return switch

# --- the tiny trainer ------------------------------------------------------------------------------------------

def random_batch(seed: int = 0, b: int = 8, t: int = 24, vocab: int = 128, pad_to: int = 32):
    """A `Batch` of `b` random samples of 8 to `t - 1` tokens over `vocab` (prompt at least 2 tokens, the rest
    sampled with logprobs in [-6, -3]), random advantages, temperature 1, padded to `pad_to`."""
    from jaxrl.rl.train import make_batch

    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(b):
        n = int(rng.integers(8, t))
        ids = rng.integers(0, vocab, n).tolist()
        prompt = int(rng.integers(2, n - 2))
        mask = [i >= prompt for i in range(n)]
        lps = [float(-rng.uniform(3, 6)) if m else 0.0 for m in mask]
        samples.append((ids, mask, lps))
    adv = rng.normal(size=b).astype(np.float32)
    return make_batch(samples, adv, temperature=1.0, pad_to=pad_to)


def tiny_model_config():
    """The tiny dense Qwen3 of the trainer tests: vocab 128, hidden 32, MLP 64, 2 layers, 4 q / 2 kv heads of 8."""
    from jaxrl.model.config import ModelConfig

    return ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8)


def tiny_trainer(cfg, mesh, tx=None, rank: int = 4, **trainer_kwargs):
    """(base weights, Trainer, TrainState) for model `cfg` on `mesh`: random base (key 0) and fresh LoRA (key 1)
    of `rank` on every target, placed by their specs; the optimizer `tx` (default: `make_optimizer(1e-2)`),
    lora_scale 2; `trainer_kwargs`: more `Trainer` fields."""
    from jaxrl.model import modules
    from jaxrl.model.blocks import LORA_TARGETS
    from jaxrl.parallel.sharding import spec_shardings
    from jaxrl.rl.train import Trainer, make_optimizer

    targets = tuple(LORA_TARGETS)
    base = modules.init_params(cfg, jax.random.key(0))
    base = jax.device_put(base, spec_shardings(modules.param_specs(cfg), cfg.dims(), mesh))
    lora = modules.init_lora(cfg, rank, targets, jax.random.key(1))
    lora = jax.device_put(lora, spec_shardings(modules.lora_specs(cfg, rank, targets), {**cfg.dims(), "R": rank}, mesh))
    trainer = Trainer(cfg, mesh, tx or make_optimizer(1e-2), lora_scale=2.0, **trainer_kwargs)
    return base, trainer, trainer.init_state(base, lora)
