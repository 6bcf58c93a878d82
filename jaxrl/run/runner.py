"""`jaxrl run`: one RL run end to end, on one mesh shared by the trainer and the rollout engine.

Each step: take `batch_size / rollouts_per_example` groups of `rollouts_per_example` rollouts of one
example each, played through the verifiers environment against the in-process rollout server by the
producer (`jaxrl.rl.producer`: groups are generated ahead, while earlier steps train, within
`max_async_level` and `oversampling_factor`), turn rewards into group advantages, take one optimizer
step on the LoRA (in a thread: the event loop goes on playing rollouts), hand the new LoRA to the
engine (policy version = step), log, and checkpoint every `[checkpoints].interval` steps. Starting the
same run again (same output folder and name) resumes from its last complete checkpoint, with the same
step numbering, data position and sampling seeds, so with `max_async_level = 0` it reproduces the
uninterrupted run. SIGTERM or SIGINT (preemption) checkpoints the last complete step and exits;
rollouts in flight are dropped, listed in the checkpoint, and played again first on resume.
Failing rollouts are dropped and counted (`jaxrl.rl.rollouts`); a run whose rollouts mostly fail stops.

Multi-host (one process per host, `jaxrl.parallel.distributed`; synchronous only, `max_async_level = 0`): the
trainer runs on the mesh over every host's
devices; each host runs its own engine, server and environments on its own devices, with the base
weights loaded a second time onto them and the LoRA copied over after each step, and plays a
contiguous share of the step's groups with the seeds one process would use. The rollouts are gathered
to every process, which then computes the metrics, failure verdict and batch exactly as one process
would; only process 0 prints, writes metrics and the run config. Every process takes part in each
checkpoint save and restore (Orbax coordinates them), so `[jax] checkpoint_dir` must be a `gs://` URL
or a folder every host shares. A SIGTERM on any host stops every host after the same step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.markup import escape

from jaxrl.config.schema import ConfigError, RunConfig, load_env_file, resolve_model_path, resolve_tokenizer_path
from jaxrl.envs import loader
from jaxrl.export import exporter
from jaxrl.inference.engine import Engine
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.inference.server import start_server
from jaxrl.model import hf
from jaxrl.model.qwen3 import init_lora, lora_specs, param_specs
from jaxrl.parallel import distributed
from jaxrl.parallel.sharding import batch_shards, make_mesh, spec_shardings
from jaxrl.rl import rollouts
from jaxrl.rl.buffer import Buffer, BufferExhausted, BufferState
from jaxrl.rl.producer import Producer, VersionLog, in_flight_groups
from jaxrl.rl.train import Trainer, TrainState, default_micro_batch, make_batch, make_optimizer
from jaxrl.run import evaluate, resources, wandb_log
from jaxrl.run.checkpoint import Checkpointer, CheckpointError
from jaxrl.run.metrics import MetricsLogger
from jaxrl.run.recovery import (
    Preempted,
    RunError,
    checkpoint_dir_of,
    identity_mismatch,
    model_identity,
    redact,
    resolve_checkpoint_id,
    run_dir_of,
    secret_values,
    stop_on_signals,
    trim_metrics,
)

PREFLIGHT_TIMEOUT_S = 300.0
"""Least time the pre-flight rollout gets: it loads the client's tokenizer, which a step's do not."""


def pad_length(n: int, seq_len: int) -> int:
    """Training width for a longest sample of `n` tokens: the next power of two >= 64, capped at seq_len,
    so the train step compiles for a handful of widths only."""
    width = 64
    while width < n:
        width *= 2
    return min(width, seq_len)


def run(cfg: RunConfig, console: Console | None = None) -> Path:
    """Train `cfg` to `max_steps`, resuming from the run's last complete checkpoint when there is one;
    return the run folder. See the module docstring. Secrets (`env_file` values, secret-named
    environment variables) are replaced by `***` in the messages of the errors below.

    Raises:
        ConfigError: the mesh does not fit the devices, the model folder is missing or unreadable, an
            environment cannot be loaded, or `checkpoint_id` names no checkpoint or one of another model.
        CheckpointError: a checkpoint cannot be written or read (storage down, disk full, another
            model's checkpoint in this run's folder); the run's local files are kept.
        RunError: most rollouts failed (`jaxrl.rl.rollouts.failure_verdict`).
        Preempted: SIGTERM or SIGINT; a checkpoint of the last complete step was saved first.
    """
    console = console or Console(soft_wrap=True, quiet=not distributed.is_primary())
    env_values = load_env_file(cfg.env_file)
    os.environ.update(env_values)
    secrets = secret_values(env_values)
    try:
        return _run(cfg, console, secrets)
    except (RunError, ConfigError) as exc:
        exc.args = tuple(redact(str(a), secrets) if isinstance(a, str) else a for a in exc.args)
        if isinstance(exc, ConfigError):
            exc.problems = [(k, redact(r, secrets)) for k, r in exc.problems]
        raise


def _run(cfg: RunConfig, console: Console, secrets: list[str]) -> Path:
    if jax.process_count() > 1 and cfg.max_async_level:
        raise ConfigError(cfg.source, [("max_async_level", f"{cfg.max_async_level}: generation overlapping training "
                                                           f"is built for one process only; a multi-host run needs "
                                                           f"max_async_level = 0 and oversampling_factor = 1")])
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    jcfg = cfg.jax
    try:
        mesh = make_mesh(jcfg.mesh.model_dump())
    except ValueError as exc:  # a mesh of another device count: only the devices here tell
        raise ConfigError(cfg.source, [("jax.mesh", str(exc))]) from None
    engine_mesh = distributed.local_mesh(mesh)  # this host's devices: its rollout engine's
    dtype = jnp.bfloat16 if jcfg.dtype == "bfloat16" else jnp.float32
    model_path, tokenizer_path = resolve_model_path(cfg), resolve_tokenizer_path(cfg)
    t0 = time.perf_counter()
    try:
        mcfg = hf.load_config(model_path)
        _, base = hf.load_hf(model_path, dtype, shardings=spec_shardings(param_specs(mcfg), mcfg.dims(), mesh))
        engine_base = base if engine_mesh is mesh else hf.load_hf(
            model_path, dtype, shardings=spec_shardings(param_specs(mcfg), mcfg.dims(), engine_mesh))[1]
    except Exception as exc:  # noqa: BLE001 - a missing, truncated or malformed checkpoint, in any layer
        key = "jax.model_path" if jcfg.model_path else "model"
        raise ConfigError(cfg.source, [(key, f"cannot load the model from {model_path}: "
                                             f"{type(exc).__name__}: {exc}")]) from None
    targets = tuple(jcfg.lora_targets)
    lora_sh = spec_shardings(lora_specs(mcfg, jcfg.lora_rank, targets), {**mcfg.dims(), "R": jcfg.lora_rank}, mesh)
    # Through numpy: a device array on one host's device would take a cross-host transfer per leaf.
    lora = jax.device_put(jax.device_get(init_lora(mcfg, jcfg.lora_rank, targets, jax.random.key(jcfg.seed))),
                          lora_sh)
    lora_scale = cfg.lora_alpha / jcfg.lora_rank
    console.print(f"[bold]jaxrl[/] run [cyan]{run_dir}[/]: model {model_path} "
                  f"({sum(x.size for x in jax.tree.leaves(base)) / 1e6:.1f}M params, {jcfg.dtype}), "
                  f"mesh {dict(mesh.shape)}, loaded in {time.perf_counter() - t0:.1f}s")
    if distributed.is_primary():
        exporter.write_run_config(run_dir, cfg)  # what `jaxrl export` reads
    adapters = exporter.RunAdapters(cfg, mcfg, exporter.adapters_dir_of(cfg), console)

    micro = jcfg.micro_batch_size or default_micro_batch(jcfg.seq_len, batch_shards(mesh))
    trainer = Trainer(mcfg, mesh, make_optimizer(cfg.learning_rate), lora_scale=lora_scale, remat=jcfg.remat,
                      micro_batch_size=micro)
    state = trainer.init_state(base, lora)
    identity = model_identity(cfg.model, dataclasses.asdict(mcfg), jcfg.lora_rank, targets)
    loaded = []
    for i, e in enumerate(cfg.env):
        try:
            loaded.append(loader.load_env(e.id, e.args, e.taskset, e.harness))
        except loader.EnvLoadError as exc:
            raise ConfigError(cfg.source, [(f"env.{i}.id", str(exc))]) from None
    eval_envs = evaluate.load_eval_envs(cfg)  # [[eval.env]]
    try:  # classic envs play over the server's /v1/chat/completions
        chat_template = loader.chat_template(loaded + eval_envs, tokenizer_path, model_path)
    except loader.EnvLoadError as exc:
        raise ConfigError(cfg.source, [("env", str(exc))]) from None
    ckpt = Checkpointer(checkpoint_dir_of(cfg), keep=cfg.checkpoints.keep_cloud)
    buffer = Buffer(tuple(len(env.tasks) for env in loaded), cfg.buffer)
    buffer_state = BufferState.fresh(len(loaded))
    start, meta = 0, {}
    if (latest := ckpt.latest_step()) is not None:
        state, meta = _restore(ckpt, latest, state, identity)
        start = int(meta["step"])
        buffer_state = _buffer_state(meta)
        console.print(f"resuming from checkpoint step {start} in {ckpt.directory}")
    elif cfg.checkpoint_id:
        state = trainer.init_state(base, _warm_start(cfg, state, identity, console))
    if distributed.is_primary() and (dropped := trim_metrics(run_dir / "metrics.jsonl", start)):
        console.print(f"dropped {dropped} metrics rows past step {start} (steps run after the last checkpoint)")
    if start >= cfg.max_steps:
        console.print(f"run already complete ({start}/{cfg.max_steps} steps)")
        ckpt.close()
        return run_dir

    wandb_run = wandb_log.start(cfg, run_dir, secrets, console) if distributed.is_primary() else None
    engine = Engine(mcfg, engine_mesh, jcfg.decode_slots, jcfg.seq_len, lora_scale=lora_scale, cache_dtype=dtype)
    engine_lora_sh = spec_shardings(lora_specs(mcfg, jcfg.lora_rank, targets), {**mcfg.dims(), "R": jcfg.lora_rank},
                                    engine_mesh)

    def engine_lora(lora: Any) -> Any:
        """The trainer's LoRA, placed for this host's engine (a collective with several processes)."""
        return lora if engine_mesh is mesh else jax.device_put(distributed.to_host(lora), engine_lora_sh)

    scheduler = Scheduler(engine, {"base": engine_base, "lora": engine_lora(state.lora)}, model_name=cfg.model,
                          seed=jcfg.seed * 1_000_003 + start)
    scheduler.policy_version = start
    versions = VersionLog(scheduler)  # the policy version of each token of the producer's rollouts
    server = start_server(versions, host=jcfg.host, port=jcfg.port, chat_template=chat_template)
    sampling = SamplingParams(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                              top_k=cfg.sampling.top_k,
                              max_tokens=cfg.sampling.max_tokens or jcfg.seq_len - 1)
    client = {"base_url": server.base_url, "model_name": cfg.model, "tokenizer_path": tokenizer_path}
    logger = MetricsLogger(run_dir, cfg.max_steps, start, console, wandb_run) if distributed.is_primary() else None
    groups = cfg.batch_size // cfg.rollouts_per_example
    loop = asyncio.new_event_loop()  # one loop for the run: verifiers' HTTP clients outlive a step
    env_resources = resources.env_resources(cfg.infrastructure.compute_size)
    resources.apply(loop, env_resources)
    in_flight = asyncio.Semaphore(env_resources.max_in_flight) if env_resources.max_in_flight else None
    console.print(env_resources.describe(cfg.infrastructure.compute_size))
    evaluator = evaluate.Evaluator(cfg, loaded, eval_envs, client, sampling, console, secrets, in_flight)  # [eval]
    serving = contextlib.AsyncExitStack()
    done, saved = start, start
    history: list[tuple[int, int]] = []
    n = cfg.rollouts_per_example

    async def play(job: tuple[int, int], first_seed: int) -> list[loader.Rollout]:
        out = await rollouts.collect(loaded, [job], n, client, sampling, first_seed, jcfg.rollout_timeout, in_flight)
        return out[0]

    next_t, resumed = Producer.resumed(meta, start, groups)
    producer = Producer(loop, buffer, buffer_state, play, versions, lambda t: (jcfg.seed * 1_000_003 + t) * n, n,
                        groups, in_flight_groups(cfg.batch_size, n, cfg.oversampling_factor), cfg.max_async_level,
                        start, next_t, resumed, share=distributed.share(groups) if jax.process_count() > 1 else None,
                        last_step=cfg.max_steps)
    train_thread = ThreadPoolExecutor(1, thread_name_prefix="jaxrl-train")  # the loop plays rollouts meanwhile
    serving_tasks: set[asyncio.Task] | None = None  # the tasks running before the first group is launched

    def save(step: int) -> None:
        buf = producer.state
        ckpt.save(step, state, {"step": step, "examples_drawn": list(buf.drawn), "buffer": buf.to_json(),
                                "producer": producer.checkpoint(), "policy_version": step, "identity": identity})

    def train(batch: Any) -> tuple[TrainState, dict[str, float]]:
        new_state, train_metrics = trainer.step(state, base, batch)
        return new_state, {k: float(v) for k, v in jax.device_get(train_metrics).items()}

    try:
        with stop_on_signals() as stop:
            # Rollouts in flight are cancelled at every run's end, not only on a signal.
            loop.set_exception_handler(lambda lp, context: None if isinstance(
                context.get("exception"), asyncio.CancelledError) else lp.default_exception_handler(context))
            t_warm = time.perf_counter()
            buckets = loop.run_until_complete(scheduler.warmup(sampling))
            console.print(f"engine compiled ({buckets} prefill buckets + decode) in "
                          f"{time.perf_counter() - t_warm:.1f}s")
            for env in loaded:  # one interception server and client per env for the whole run
                loop.run_until_complete(serving.enter_async_context(env.serving()))
            loop.run_until_complete(serving.enter_async_context(evaluator.serving()))
            if not cfg.buffer.skip_verification:
                t_check = time.perf_counter()
                failing = loop.run_until_complete(rollouts.preflight(
                    loaded, client, sampling, max(jcfg.rollout_timeout, PREFLIGHT_TIMEOUT_S), in_flight))
                failing = list(dict.fromkeys(line for lines in distributed.all_gather_objects(failing)
                                             for line in lines))
                if failing:
                    raise RunError("pre-flight rollout failed before step 1 (set [buffer] skip_verification = true "
                                   "to skip this check):\n  " + "\n  ".join(failing))
                console.print(f"pre-flight: one rollout of each environment passed in "
                              f"{time.perf_counter() - t_check:.1f}s")
            if start == 0 and (base_metrics := evaluator.run(0, loop, stop)) and logger:
                logger.log(0, base_metrics)  # [eval] eval_base_model: the untrained model, as step 0
            serving_tasks = asyncio.all_tasks(loop)
            producer.refill()
            for step in range(start, cfg.max_steps):
                if distributed.any_process(stop.requested):
                    break
                t_step = time.perf_counter()
                take = loop.create_task(producer.take(step))
                stop.on_signal = lambda take=take: loop.call_soon_threadsafe(take.cancel)
                try:
                    taken = loop.run_until_complete(take)
                except asyncio.CancelledError:
                    taken = None
                except BufferExhausted as exc:
                    raise RunError(f"step {step + 1}: stopping, {exc} (resumes from checkpoint step {saved})") from None
                finally:
                    stop.on_signal = None
                shares = distributed.all_gather_objects(None if taken is None else [
                    [dataclasses.asdict(r) for r in g.rollouts] for g in taken.groups if g.rollouts is not None])
                if any(share is None for share in shares):  # preempted mid-rollouts: redone on resume
                    break
                step_rollouts = [[loader.Rollout(**r) for r in group] for share in shares for group in share]
                jobs = [g.job for g in taken.groups]
                t_rollout = time.perf_counter() - t_step  # the wait: rollouts in flight overlap the previous step
                metrics = rollouts.step_metrics(step_rollouts, [cfg.env[i].display_name for i, _ in jobs],
                                                len(cfg.env) > 1) | taken.metrics(step, n, len(producer.groups))
                kept = [r for group in step_rollouts for r in group if r.ok]
                history.append((len([r for g in step_rollouts for r in g]) - len(kept),
                                sum(len(g) for g in step_rollouts)))
                if verdict := rollouts.failure_verdict(history):
                    errors = "\n  ".join(rollouts.first_errors(step_rollouts))
                    raise RunError(f"step {step + 1}: stopping, {verdict}; fix the environment and run again "
                                   f"(resumes from checkpoint step {saved}). First errors:\n  {errors}")
                if metrics["rollouts/failed"]:
                    first = escape(redact(rollouts.first_errors(step_rollouts, 1)[0], secrets))
                    console.print(f"[yellow]step {step + 1}: {metrics['rollouts/failed']:.0f} rollouts failed and "
                                  f"were dropped[/]; first: {first}", highlight=False)
                keep = producer.record(jobs, [[r.reward for r in g if r.ok] for g in step_rollouts])
                metrics |= buffer.metrics(producer.state, keep)
                trained = [g for g, k in zip(step_rollouts, keep, strict=True) if k]
                trained_ok = [r for g in trained for r in g if r.ok]
                t_train = time.perf_counter()
                samples: list = []
                if trained_ok:
                    advantages = np.concatenate([rollouts.advantages(group) for group in trained])
                    width = pad_length(max(len(r.token_ids) for r in trained_ok), jcfg.seq_len)
                    samples, sample_advantages = loader.training_samples(trained_ok, advantages,
                                                                       cfg.trajectory_strategy)
                    batch = make_batch(samples, sample_advantages, sampling.temperature, width)
                    state, train_metrics = loop.run_until_complete(loop.run_in_executor(train_thread, train, batch))
                    if train_metrics["optim/skipped"]:
                        console.print(f"[yellow]step {step + 1}: loss or gradient not finite; update skipped, "
                                      f"weights unchanged[/]")
                else:  # online difficulty filtering left no group with a reward signal: nothing to learn from
                    train_metrics = {"optim/skipped": 1.0}
                    console.print(f"[yellow]step {step + 1}: every group's rewards were equal (filtered by "
                                  f"[buffer] online_difficulty_filtering); no update[/]")
                scheduler.update_params({"base": engine_base, "lora": engine_lora(state.lora)}, version=step + 1)
                producer.set_version(step + 1)
                now = time.perf_counter()
                sampled = sum(sum(r.loss_mask) for r in kept)
                metrics |= train_metrics | {
                    "time/rollout": t_rollout, "time/train": now - t_train, "time/step": now - t_step,
                    "tokens_per_s": sampled / (now - t_step), "train/samples": float(len(samples)),
                }
                metrics |= evaluator.run(step + 1, loop, stop)  # [eval] / [val] when due, on the new weights
                if logger:
                    logger.log(step + 1, metrics)
                done = step + 1
                if done % cfg.checkpoints.interval == 0 or done == cfg.max_steps or \
                        distributed.any_process(stop.requested):
                    save(done)
                    saved = done
                adapters.after_step(done, state.lora)
            if distributed.any_process(stop.requested):
                if saved != done:
                    save(done)
                ckpt.wait()
                raise Preempted(f"{stop.signal or 'a signal to another host'}: stopped after step {done}; "
                                f"checkpoint step {done} is in {ckpt.directory}. Run the same command again to resume.")
        ckpt.wait()
    finally:
        if logger:
            logger.close()
        train_thread.shutdown()
        producer.cancel()  # rollouts in flight past the last step, or since a failure: dropped
        if serving_tasks is not None:
            loop.run_until_complete(rollouts.settle(serving_tasks, timeout_s=10.0))
        loop.run_until_complete(serving.aclose())
        loop.close()
        server.stop()
        scheduler.stop()
        with contextlib.suppress(Exception):
            ckpt.close()
    console.print(f"done: {cfg.max_steps} steps; metrics in {run_dir / 'metrics.jsonl'}, "
                  f"checkpoints in {ckpt.directory}"
                  + (f", PEFT adapters in {adapters.directory}" if adapters.enabled else ""))
    return run_dir



def _buffer_state(meta: dict) -> BufferState:
    """The buffer state saved in checkpoint metadata; a checkpoint from before `[buffer]` sampling has
    only `examples_drawn`, under round robin, where each environment got one group per example drawn."""
    if "buffer" in meta:
        return BufferState.from_json(meta["buffer"])
    drawn = tuple(int(x) for x in meta["examples_drawn"])
    return BufferState(drawn, drawn, tuple({} for _ in drawn))


def _restore(ckpt: Checkpointer, step: int, like: TrainState, identity: dict) -> tuple[TrainState, dict]:
    """Checkpoint `step` of `ckpt`, after checking it is of this run's model and LoRA shape."""
    meta = ckpt.read_meta(step)
    if problems := identity_mismatch(meta.get("identity"), identity):
        raise CheckpointError(f"checkpoint step {step} in {ckpt.directory} is of a different model or LoRA: "
                              + "; ".join(problems))
    return ckpt.restore(step, like)


def _warm_start(cfg: RunConfig, like: TrainState, identity: dict, console: Console) -> Any:
    """The LoRA of the checkpoint `cfg.checkpoint_id` names. Raises ConfigError (key `checkpoint_id`)
    when there is no such checkpoint or it is of another model."""
    directory, step = resolve_checkpoint_id(cfg)
    try:
        source = Checkpointer(directory, read_only=True)
        step = source.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {directory}")
        restored, _ = _restore(source, step, like, identity)
        source.close()
    except CheckpointError as exc:
        raise ConfigError(cfg.source, [("checkpoint_id", f"{cfg.checkpoint_id!r}: {exc}")]) from None
    console.print(f"warm start: LoRA of checkpoint step {step} in {directory}")
    return restored.lora
