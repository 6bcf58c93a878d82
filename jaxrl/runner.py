"""`jaxrl run`: one RL run end to end, on one mesh shared by the trainer and the rollout engine.

Each step: pick `batch_size / rollouts_per_example` examples, run `rollouts_per_example` rollouts of each
through the verifiers environment against the in-process rollout server, turn rewards into group
advantages, take one optimizer step on the LoRA, hand the new LoRA to the engine (policy version =
step), log, and checkpoint every `[checkpoints].interval` steps. Starting the same run again (same
output folder and name) resumes from its last complete checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from jaxrl import envs, hf, rl
from jaxrl.checkpoint import Checkpointer
from jaxrl.config import ConfigError, RunConfig, load_env_file, resolve_model_path, resolve_tokenizer_path
from jaxrl.engine import Engine
from jaxrl.metrics import MetricsLogger
from jaxrl.model import init_lora, lora_specs, param_specs
from jaxrl.protocol import SamplingParams
from jaxrl.scheduler import Scheduler
from jaxrl.server import start_server
from jaxrl.sharding import make_mesh, spec_shardings
from jaxrl.train import Trainer, make_batch, make_optimizer


def run_dir_of(cfg: RunConfig) -> Path:
    """`<jax.output_dir>/<name>`; the name is `name`, else the config file's stem."""
    name = cfg.name or cfg.source.stem
    return Path(cfg.jax.output_dir).expanduser() / name.replace("/", "_")


def pad_length(n: int, seq_len: int) -> int:
    """Training width for a longest sample of `n` tokens: the next power of two >= 64, capped at seq_len,
    so the train step compiles for a handful of widths only."""
    width = 64
    while width < n:
        width *= 2
    return min(width, seq_len)


class ExampleSampler:
    """Deterministic example order per environment: a fresh seeded permutation each epoch. Its state is
    the number of examples drawn from each environment, saved with every checkpoint."""

    def __init__(self, sizes: list[int], seed: int, drawn: list[int] | None = None) -> None:
        self.sizes, self.seed = sizes, seed
        self.drawn = list(drawn) if drawn else [0] * len(sizes)

    def next(self, env_index: int) -> int:
        n = self.sizes[env_index]
        epoch, pos = divmod(self.drawn[env_index], n)
        self.drawn[env_index] += 1
        order = np.random.default_rng([self.seed, env_index, epoch]).permutation(n)
        return int(order[pos])


def _std(x: np.ndarray) -> float:
    return float(x.std()) if x.size else 0.0


def run(cfg: RunConfig, console: Console | None = None) -> Path:
    """Train `cfg` to `max_steps`; return the run folder. See the module docstring."""
    console = console or Console(soft_wrap=True)
    run_dir = run_dir_of(cfg)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    secrets = load_env_file(cfg.env_file)
    os.environ.update(secrets)

    jcfg = cfg.jax
    mesh = make_mesh(jcfg.mesh.model_dump())
    dtype = jnp.bfloat16 if jcfg.dtype == "bfloat16" else jnp.float32
    model_path, tokenizer_path = resolve_model_path(cfg), resolve_tokenizer_path(cfg)
    t0 = time.perf_counter()
    try:
        mcfg, base = hf.load_hf(model_path, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError(cfg.source, [("jax.model_path" if jcfg.model_path else "model", str(exc))]) from None
    base = jax.device_put(base, spec_shardings(param_specs(mcfg), mcfg.dims(), mesh))
    targets = tuple(jcfg.lora_targets)
    lora_sh = spec_shardings(lora_specs(mcfg, jcfg.lora_rank, targets), {**mcfg.dims(), "R": jcfg.lora_rank}, mesh)
    lora = jax.device_put(init_lora(mcfg, jcfg.lora_rank, targets, jax.random.key(jcfg.seed)), lora_sh)
    lora_scale = cfg.lora_alpha / jcfg.lora_rank
    console.print(f"[bold]jaxrl[/] run [cyan]{run_dir}[/]: model {model_path} "
                  f"({sum(x.size for x in jax.tree.leaves(base)) / 1e6:.1f}M params, {jcfg.dtype}), "
                  f"mesh {dict(mesh.shape)}, loaded in {time.perf_counter() - t0:.1f}s")

    trainer = Trainer(mcfg, mesh, make_optimizer(cfg.learning_rate), lora_scale=lora_scale, remat=jcfg.remat)
    state = trainer.init_state(base, lora)
    ckpt = Checkpointer(str((run_dir / "checkpoints").resolve()), keep=cfg.checkpoints.keep_cloud)
    loaded = []
    for i, e in enumerate(cfg.env):
        try:
            loaded.append(envs.load_env(e.id, e.args, e.taskset, e.harness))
        except envs.EnvLoadError as exc:
            raise ConfigError(cfg.source, [(f"env.{i}.id", str(exc))]) from None
    sampler = ExampleSampler([len(env.tasks) for env in loaded], cfg.buffer.seed)
    start = 0
    if (latest := ckpt.latest_step()) is not None:
        state, meta = ckpt.restore(latest, state)
        start = int(meta["step"])
        sampler = ExampleSampler(sampler.sizes, sampler.seed, meta["examples_drawn"])
        console.print(f"resuming from checkpoint step {start} in {ckpt.directory}")
    if start >= cfg.max_steps:
        console.print(f"run already complete ({start}/{cfg.max_steps} steps)")
        ckpt.close()
        return run_dir

    engine = Engine(mcfg, mesh, jcfg.decode_slots, jcfg.seq_len, lora_scale=lora_scale, cache_dtype=dtype)
    scheduler = Scheduler(engine, {"base": base, "lora": state.lora}, model_name=cfg.model,
                          seed=jcfg.seed * 1_000_003 + start)
    scheduler.policy_version = start
    server = start_server(scheduler, host=jcfg.host, port=jcfg.port)
    sampling = SamplingParams(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                              top_k=cfg.sampling.top_k,
                              max_tokens=cfg.sampling.max_tokens or jcfg.seq_len - 1)
    client = {"base_url": server.base_url, "model_name": cfg.model, "tokenizer_path": tokenizer_path}
    logger = MetricsLogger(run_dir, cfg.max_steps, start, console)
    groups = cfg.batch_size // cfg.rollouts_per_example
    loop = asyncio.new_event_loop()  # one loop for the run: verifiers' HTTP clients outlive a step
    serving = contextlib.AsyncExitStack()
    try:
        for env in loaded:  # one interception server and client per env for the whole run
            loop.run_until_complete(serving.enter_async_context(env.serving()))
        for step in range(start, cfg.max_steps):
            t_step = time.perf_counter()
            jobs = []
            for g in range(groups):
                env_i = (step * groups + g) % len(loaded)
                jobs.append((env_i, sampler.next(env_i)))
            # Each rollout gets its own seed from (run seed, step, group, index), so a run (and its resume)
            # samples the same tokens whatever order requests reach the engine in.
            first_seed = (jcfg.seed * 1_000_003 + step * groups) * cfg.rollouts_per_example
            rollouts = loop.run_until_complete(_rollouts(loaded, cfg, jobs, client, sampling, first_seed))
            t_rollout = time.perf_counter() - t_step
            metrics = _train_step_metrics(rollouts, cfg, [cfg.env[i].display_name for i, _ in jobs])
            kept = [r for group in rollouts for r in group if r.ok]
            if not kept:
                raise RuntimeError(f"step {step + 1}: every rollout failed; first error: "
                                   f"{next(r.error for g in rollouts for r in g)}")
            advantages = np.concatenate([_advantages(group) for group in rollouts])
            width = pad_length(max(len(r.token_ids) for r in kept), jcfg.seq_len)
            batch = make_batch([(r.token_ids, r.loss_mask, r.logprobs) for r in kept], advantages, sampling.temperature,
                               width)
            t_train = time.perf_counter()
            state, train_metrics = trainer.step(state, base, batch)
            scheduler.update_params({"base": base, "lora": state.lora}, version=step + 1)
            train_metrics = {k: float(v) for k, v in jax.device_get(train_metrics).items()}
            now = time.perf_counter()
            sampled = sum(sum(r.loss_mask) for r in kept)
            metrics |= train_metrics | {
                "time/rollout": t_rollout, "time/train": now - t_train, "time/step": now - t_step,
                "tokens_per_s": sampled / t_rollout,
            }
            logger.log(step + 1, metrics)
            if (step + 1) % cfg.checkpoints.interval == 0 or step + 1 == cfg.max_steps:
                ckpt.save(step + 1, state, {"step": step + 1, "examples_drawn": sampler.drawn,
                                            "policy_version": step + 1})
    finally:
        logger.close()
        loop.run_until_complete(serving.aclose())
        loop.close()
        server.stop()
        scheduler.stop()
        with contextlib.suppress(Exception):
            ckpt.close()
    console.print(f"done: {cfg.max_steps} steps; metrics in {logger.path}, checkpoints in {ckpt.directory}")
    return run_dir


def _advantages(group: list[envs.Rollout]) -> np.ndarray:
    """Group advantages over the group's successful rollouts (failed ones are dropped)."""
    rewards = np.array([r.reward for r in group if r.ok], np.float32)
    return rl.group_advantages(rewards, rewards.size) if rewards.size else rewards


async def _rollouts(loaded: list[envs.LoadedEnv], cfg: RunConfig, jobs: list[tuple[int, int]],
                    client: dict[str, Any], sampling: SamplingParams, first_seed: int) -> list[list[envs.Rollout]]:
    n = cfg.rollouts_per_example
    return await asyncio.gather(*[
        envs.run_group(loaded[env_i], example, n, sampling=dataclasses.replace(sampling, seed=first_seed + g * n),
                       **client)
        for g, (env_i, example) in enumerate(jobs)
    ])


def _train_step_metrics(rollouts: list[list[envs.Rollout]], cfg: RunConfig, names: list[str]) -> dict[str, float]:
    flat = [r for g in rollouts for r in g]
    ok = [r for r in flat if r.ok]
    rewards = np.array([r.reward for r in ok], np.float32)
    out = {
        "reward/mean": float(rewards.mean()) if rewards.size else float("nan"),
        "reward/std": _std(rewards),
        "seq_len": float(np.mean([len(r.token_ids) for r in ok])) if ok else 0.0,
        "is_truncated": float(np.mean([r.is_truncated for r in ok])) if ok else 0.0,
        "rollouts/failed": float(len(flat) - len(ok)),
    }
    if len(cfg.env) > 1:
        for name in sorted(set(names)):
            r = np.array([x.reward for g, n in zip(rollouts, names, strict=True) if n == name for x in g if x.ok])
            out[f"reward/{name}/mean"] = float(r.mean()) if r.size else float("nan")
    return out
