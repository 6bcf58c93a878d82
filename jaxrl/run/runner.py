"""`jaxrl run`: one RL run end to end, on one mesh shared by the trainer and the rollout engine.

Each step: take `batch_size / rollouts_per_example` groups of `rollouts_per_example` rollouts of one
example each, played through the verifiers environment against the in-process rollout server by the
producer (`jaxrl.rl.producer`: groups are generated ahead, while earlier steps train, within
`max_async_level` and `oversampling_factor`), turn rewards into group advantages, take one optimizer
step on the LoRA, or on every weight with `[jax] finetune = "full"` (in a thread: the event loop goes on
playing rollouts), hand the new LoRA (or weights) to the engine (policy version = step), log, and
checkpoint every `[checkpoints].interval` steps. Starting the same run again (same output folder and
name) resumes from its last complete checkpoint, with the same step numbering, data position and
sampling seeds, so with `max_async_level = 0` it reproduces the uninterrupted run. SIGTERM or SIGINT
(preemption) checkpoints the last complete step and exits; rollouts in flight are dropped, listed in
the checkpoint, and played again first on resume.
Failing rollouts are dropped and counted (`jaxrl.rl.rollouts`); a run whose rollouts mostly fail stops.

Multi-host (one process per host, `jaxrl.parallel.distributed`): the trainer runs on the mesh over every
host's devices; each host runs its own server and environments and plays the groups it owns (one
producer state agreed between the processes, `jaxrl.rl.producer`, so every async setting works) with the
seeds one process would use. Each host runs its own engine on its own devices, with the base weights
loaded a second time onto them and the LoRA copied over after each step, unless the model does not fit
one host (`[jax] engine_hosts`): then a group of hosts steps one engine over their devices in lockstep
(`jaxrl.inference.lockstep`), and every device program that spans hosts runs while that engine is
paused (`distributed.fenced`). The step's rollouts are gathered to every process, which then computes
the metrics, failure verdict and batch exactly as one process would; only process 0 prints, writes
metrics and the run config. Every process takes part in each checkpoint save and restore (Orbax
coordinates them), so `[jax] checkpoint_dir` must be a `gs://` URL or a folder every host shares. A
SIGTERM on any host stops every host after the same step.
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
from jax.sharding import Mesh
from rich.console import Console
from rich.markup import escape

from jaxrl.compile import report
from jaxrl.compile.programs import ProgramTooLarge
from jaxrl.config.env_file import load_env_file
from jaxrl.config.schema import ConfigError, RunConfig, resolve_model_path, resolve_tokenizer_path
from jaxrl.envs import loader
from jaxrl.inference.engine import Engine
from jaxrl.inference.lockstep import GroupScheduler
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.inference.server import start_server
from jaxrl.model import hf
from jaxrl.model.modules import init_lora, lora_specs, param_specs
from jaxrl.model.qwen3 import ModelConfig
from jaxrl.parallel import distributed
from jaxrl.parallel.sharding import make_mesh, spec_shardings
from jaxrl.rl import rollouts
from jaxrl.rl.buffer import Buffer, BufferExhausted, BufferState
from jaxrl.rl.producer import Producer, VersionLog, in_flight_groups
from jaxrl.rl.samples import training_samples
from jaxrl.rl.train import TrainState, make_batch, trainer_for
from jaxrl.run import evaluate, resources, wandb_log
from jaxrl.run.adapters import RunAdapters
from jaxrl.run.checkpoint import Checkpointer
from jaxrl.run.errors import Preempted, RunError
from jaxrl.run.identity import model_identity, restore_newest, warm_start_state
from jaxrl.run.layout import METRICS, adapters_dir_of, checkpoint_dir_of, run_dir_of, write_run_config
from jaxrl.run.metrics import MetricsLogger, trim_metrics
from jaxrl.run.redaction import redact, secret_values
from jaxrl.run.signals import StopRequest, stop_on_signals

PREFLIGHT_TIMEOUT_S = 300.0
"""Least time the pre-flight rollout gets: it loads the client's tokenizer, which a step's do not."""


def pad_length(n: int, seq_len: int) -> int:
    """Training width for a longest sample of `n` tokens: the next power of two >= 64, capped at seq_len,
    so the train step compiles for a handful of widths only."""
    width = 64
    while width < n:
        width *= 2
    return min(width, seq_len)


def run(cfg: RunConfig, console: Console | None = None, run_class: type[Run] | None = None) -> Path:
    """Train `cfg` to `max_steps`, resuming from the run's last complete checkpoint when there is one;
    return the run folder. See the module docstring. Secrets (`env_file` values, secret-named
    environment variables) are replaced by `***` in the messages of the errors below. `run_class`: the
    phases to run (default `Run`; `jaxrl.run.sft.SftRun` for an SFT config).

    Raises:
        ConfigError: the mesh does not fit the devices, the model folder is missing or unreadable, an
            environment cannot be loaded, or `checkpoint_id` names no checkpoint or one of another model.
        CheckpointError: a checkpoint cannot be written or read (storage down, disk full, another
            model's checkpoint in this run's folder); the run's local files are kept.
        RunError: most rollouts failed (`jaxrl.rl.rollouts.failure_verdict`).
        Preempted: SIGTERM or SIGINT; a checkpoint of the last complete step was saved first.
    """
    console = console or Console(soft_wrap=True, quiet=not distributed.is_primary())
    env_values = load_env_file(cfg.env_file, cfg.source)
    os.environ.update(env_values)
    secrets = secret_values(env_values)
    try:
        return (run_class or Run)(cfg, console, secrets).run()
    except (RunError, ConfigError) as exc:
        exc.args = tuple(redact(str(a), secrets) if isinstance(a, str) else a for a in exc.args)
        if isinstance(exc, ConfigError):
            exc.problems = [(k, redact(r, secrets)) for k, r in exc.problems]
        raise


@dataclasses.dataclass
class Step:
    """One step's data as it moves through the phases. `step` counts from 0 (the step it trains is logged
    as `step + 1`, the policy version it publishes). `groups`: the step's groups of rollouts, from every
    process, in launch order, with `jobs` their `(env index, example index)` and `temperatures` what
    each sampled at; `trained`: those `judge` kept for training, with `trained_temperatures`. Times are
    `time.perf_counter()` seconds."""

    step: int
    t_start: float
    jobs: list[tuple[int, int]]
    groups: list[list[loader.Rollout]]
    temperatures: list[float]
    metrics: dict[str, float]
    trained: list[list[loader.Rollout]] = dataclasses.field(default_factory=list)
    trained_temperatures: list[float] = dataclasses.field(default_factory=list)


class Run:
    """One run, in phases (the model is prime-rl's orchestrator: one method per phase).

    `setup` loads the model, the LoRA, the environments and the last checkpoint; `start` the engine, its
    server and the rollout producer; `preflight` compiles the engine, serves the environments, plays one
    rollout of each and evaluates the base model. Then each step is `gather` (its groups, from the
    producer and every process) -> `judge` (metrics, failure verdict, difficulty filter) -> `train` (one
    optimizer step) -> `publish` (the new LoRA to the engine) -> `record` (eval, metrics, checkpoint,
    adapters); `close` stops what `start` started. `run` drives them. A phase to add is a method here,
    called from `run` or `step`, reading the attributes the phases above it set.
    """

    def __init__(self, cfg: RunConfig, console: Console, secrets: list[str]) -> None:
        self.cfg, self.console, self.secrets = cfg, console, secrets
        self.rollouts_per_example = cfg.rollouts_per_example
        self.groups_per_step = cfg.batch_size // cfg.rollouts_per_example
        self.run_dir = run_dir_of(cfg)
        self.primary = distributed.is_primary()
        self.history: list[tuple[int, int]] = []  # (failed, played) rollouts per step: the failure verdict's
        self.stop: StopRequest | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.serving_tasks: set[asyncio.Task] | None = None  # the tasks running before the first group

    def run(self) -> Path:
        """All phases; return the run folder. Raises what `jaxrl.run.runner.run` documents."""
        self.setup()
        if self.start_step >= self.cfg.max_steps:
            self.console.print(f"run already complete ({self.start_step}/{self.cfg.max_steps} steps)")
            self.ckpt.close()
            return self.run_dir
        self.start()
        try:
            with stop_on_signals() as self.stop:
                self.preflight()
                self.producer.refill()
                for step in range(self.start_step, self.cfg.max_steps):
                    if distributed.any_process(self.stop.requested) or not self.step(step):
                        break
                if distributed.any_process(self.stop.requested):
                    self.preempted()
            self.ckpt.wait()
        finally:
            self.close()
        self.console.print(f"done: {self.cfg.max_steps} steps; metrics in {self.run_dir / METRICS}, "
                           f"checkpoints in {self.ckpt.directory}"
                           + (f", PEFT adapters in {self.adapters.directory}" if self.adapters.enabled else ""))
        return self.run_dir

    def step(self, step: int) -> bool:
        """One step's phases; False when a signal stopped it before its rollouts were in."""
        if (s := self.gather(step)) is None:
            return False
        self.judge(s)
        s.metrics |= self.train(s)
        self.publish(s.step + 1)
        self.record(s)
        return True

    # -- setup ---------------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Load the model, the LoRA, the trainer state, the environments and the last checkpoint; sets
        `start_step` (the first step to run) and `meta` (that checkpoint's metadata, {} when none)."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.load_model()
        if self.primary:
            write_run_config(self.run_dir, cfg)  # what `jaxrl export` reads
        self.adapters = RunAdapters(cfg, self.mcfg, adapters_dir_of(cfg), self.console)
        self.init_training()
        self.load_envs()
        self.ckpt = Checkpointer(checkpoint_dir_of(cfg), keep=cfg.checkpoints.keep_cloud)
        self.buffer = Buffer(tuple(len(env.tasks) for env in self.envs), cfg.buffer)
        self.resume_or_warm_start()
        self.buffer_state = BufferState.from_meta(self.meta) if self.meta else BufferState.fresh(len(self.envs))
        self.done = self.saved = self.start_step  # last step run; last step checkpointed
        if self.primary and (dropped := trim_metrics(self.run_dir / METRICS, self.start_step)):
            self.console.print(f"dropped {dropped} metrics rows past step {self.start_step} "
                               f"(steps run after the last checkpoint)")

    def init_training(self, objective: str = "rl") -> None:
        """The trainer (`[jax.loss]`, `[jax.optim]`; `objective` "sft" for `jaxrl sft`), a fresh train state
        (a new LoRA, or in full fine-tuning the loaded weights), the model identity checkpoints carry, and
        `base`, the train step's: the frozen base, or in full fine-tuning the KL reference (the starting
        weights in `[jax] dtype`, kept only with an RL `kl_coef > 0`; else None, freeing them)."""
        cfg = self.cfg
        self.trainer = trainer_for(cfg, self.mcfg, self.mesh, self.lora_scale, self.micro_batch, objective)
        self.state = self.trainer.init_state(self.base, None if self.full else self.init_lora())
        if self.full:
            self.base = self.engine_weights(self.base) if objective == "rl" and cfg.jax.loss.kl_coef > 0 else None
        self.identity = model_identity(cfg.model, dataclasses.asdict(self.mcfg), cfg.jax.lora_rank,
                                       tuple(cfg.jax.lora_targets), cfg.jax.finetune)

    def resume_or_warm_start(self) -> None:
        """Restore the run's last complete checkpoint (`start_step`, `meta`: its step and metadata), else
        start from `checkpoint_id`'s LoRA or weights (a fresh optimizer) or from step 0 (`meta` {})."""
        self.start_step, self.meta = 0, {}
        if (restored := restore_newest(self.ckpt, self.state, self.identity, self.console)) is not None:
            self.state, self.meta = restored
            self.start_step = int(self.meta["step"])
            self.console.print(f"resuming from checkpoint step {self.start_step} in {self.ckpt.directory}")
        elif self.cfg.checkpoint_id:
            warm = warm_start_state(self.cfg, self.state, self.identity, self.console)
            self.state = self.trainer.init_state(warm.base, None) if self.full else \
                self.trainer.init_state(self.base, warm.lora)

    def load_model(self) -> None:
        """The base weights on the trainer's mesh (`base`; float32 in full fine-tuning, the master
        weights) and on the mesh of this host's rollout engine (`engine_base`: the same arrays with one
        process, or when the engine spans every process; unused in full fine-tuning, where
        `engine_params` places the trained weights; the engine's processes are `engine_group`). Raises
        ConfigError (key `model`, `jax.model_path` or `jax.engine_hosts`) when the checkpoint cannot be
        loaded or the engine group does not divide the processes."""
        cfg, jcfg = self.cfg, self.cfg.jax
        try:
            self.mesh = make_mesh(jcfg.mesh.model_dump())
        except ValueError as exc:  # a mesh of another device count: only the devices here tell
            raise ConfigError(cfg.source, [("jax.mesh", str(exc))]) from None
        self.dtype = jnp.bfloat16 if jcfg.dtype == "bfloat16" else jnp.float32
        self.full = jcfg.finetune == "full"
        trained_dtype = jnp.float32 if self.full else self.dtype
        self.model_path, self.tokenizer_path = resolve_model_path(cfg), resolve_tokenizer_path(cfg)
        t0 = time.perf_counter()
        try:
            self.mcfg = mcfg = hf.load_config(self.model_path)
            self.micro_batch = report.startup_micro_batch(cfg, mcfg, self.mesh, self.console.print)
            self.engine_group = _engine_group(cfg, mcfg, self.mesh, self.console, self.micro_batch)
            self.engine_mesh = distributed.group_mesh(self.mesh, self.engine_group)  # its rollout engine's devices
            self.base = hf.load_hf(self.model_path, trained_dtype,
                                   shardings=spec_shardings(param_specs(mcfg), mcfg.dims(), self.mesh))[1]
            self.engine_base = self.base if self.engine_mesh is self.mesh or self.full else hf.load_hf(
                self.model_path, self.dtype, shardings=spec_shardings(param_specs(mcfg), mcfg.dims(),
                                                                      self.engine_mesh))[1]
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a missing, truncated or malformed checkpoint, in any layer
            key = "jax.model_path" if jcfg.model_path else "model"
            raise ConfigError(cfg.source, [(key, f"cannot load the model from {self.model_path}: "
                                                 f"{type(exc).__name__}: {exc}")]) from None
        self.lora_scale = cfg.lora_alpha / jcfg.lora_rank
        self.console.print(f"[bold]jaxrl[/] run [cyan]{self.run_dir}[/]: model {self.model_path} "
                           f"({sum(x.size for x in jax.tree.leaves(self.base)) / 1e6:.1f}M params, {jcfg.dtype}), "
                           f"mesh {dict(self.mesh.shape)}, loaded in {time.perf_counter() - t0:.1f}s")

    def engine_weights(self, weights: Any) -> Any:
        """Base weights in the engine's dtype: `weights` themselves, or (full fine-tuning in bfloat16)
        a cast copy with the same shardings."""
        same = all(x.dtype == self.dtype for x in jax.tree.leaves(weights))
        return weights if same else jax.tree.map(lambda x: x.astype(self.dtype), weights)

    def lora_shardings(self, mesh: Mesh) -> Any:
        """Shardings of the LoRA factors on `mesh`."""
        jcfg = self.cfg.jax
        return spec_shardings(lora_specs(self.mcfg, jcfg.lora_rank, tuple(jcfg.lora_targets)),
                              {**self.mcfg.dims(), "R": jcfg.lora_rank}, mesh)

    def init_lora(self) -> Any:
        """Fresh LoRA factors (from `[jax] seed`) on the trainer's mesh."""
        jcfg = self.cfg.jax
        # Through numpy: a device array on one host's device would take a cross-host transfer per leaf.
        lora = init_lora(self.mcfg, jcfg.lora_rank, tuple(jcfg.lora_targets), jax.random.key(jcfg.seed))
        return jax.device_put(jax.device_get(lora), self.lora_shardings(self.mesh))

    def load_envs(self) -> None:
        """The training environments (`envs`), the eval ones (`eval_envs`) and the chat template the server
        renders classic environments' chats with. Raises ConfigError (key `env.<i>.id` or `env`)."""
        self.envs = []
        for i, e in enumerate(self.cfg.env):
            try:
                env = loader.load_env(e.id, e.args, e.taskset, e.harness, e.version)
                self.envs.append(dataclasses.replace(env, max_retries=e.max_retries or 0))
            except loader.EnvLoadError as exc:
                raise ConfigError(self.cfg.source, [(f"env.{i}.id", str(exc))]) from None
        self.eval_envs = evaluate.load_eval_envs(self.cfg)  # [[eval.env]]
        try:  # classic envs play over the server's /v1/chat/completions
            self.chat_template = loader.chat_template(self.envs + self.eval_envs, self.tokenizer_path,
                                                      self.model_path)
        except loader.EnvLoadError as exc:
            raise ConfigError(self.cfg.source, [("env", str(exc))]) from None

    def start(self) -> None:
        """Start the W&B run, the engine and its scheduler and server, the event loop, the evaluator and the
        rollout producer; `close` stops them."""
        self.start_serving()
        cfg = self.cfg
        n, groups, seed = self.rollouts_per_example, self.groups_per_step, cfg.sampling_seed
        next_t, resumed = Producer.resumed(self.meta, self.start_step, groups)
        self.producer = Producer(self.loop, self.buffer, self.buffer_state, self.play, self.versions,
                                 lambda t: (seed * 1_000_003 + t) * n,
                                 lambda step: rollouts.temperature_at(cfg.sampling, step + 1, cfg.max_steps), n, groups,
                                 in_flight_groups(cfg.batch_size, n, cfg.oversampling_factor), cfg.max_async_level,
                                 self.start_step, next_t, resumed, last_step=cfg.max_steps,
                                 processes=jax.process_count(), index=jax.process_index(),
                                 gather=distributed.Exchange().gather if jax.process_count() > 1 else None)
        self.train_thread = ThreadPoolExecutor(1, thread_name_prefix="jaxrl-train")  # the loop plays meanwhile

    def start_serving(self) -> None:
        """Start the W&B run, the engine and its scheduler and server (`versions`: the policy version of
        each token they sample), the metrics logger, the event loop and the evaluator."""
        cfg, jcfg = self.cfg, self.cfg.jax
        wandb_run = wandb_log.start(cfg, self.run_dir, self.secrets, self.console) if self.primary else None
        engine = Engine(self.mcfg, self.engine_mesh, jcfg.decode_slots, jcfg.seq_len, lora_scale=self.lora_scale,
                        cache_dtype=self.dtype, kv_cache_tokens=jcfg.kv_cache_tokens)
        self.engine_lora_sh = self.lora_shardings(self.engine_mesh)
        seed, hosts = cfg.sampling_seed * 1_000_003 + self.start_step, len(self.engine_group)
        self.console.print(f"rollout engine: one over {hosts} processes (engine_hosts = {hosts})" if hosts > 1
                           else "rollout engine: one per process")
        if hosts > 1:
            self.scheduler = GroupScheduler(engine, self.engine_params(), cfg.model,
                                            distributed.Exchange(self.engine_group), seed=seed)
            distributed.set_fence(self.scheduler.paused)  # device programs spanning hosts pause it
        else:
            self.scheduler = Scheduler(engine, self.engine_params(), model_name=cfg.model, seed=seed)
        self.scheduler.policy_version = self.start_step
        self.versions = versions = VersionLog(self.scheduler)  # each sampled token's policy version
        self.server = start_server(versions, host=jcfg.host, port=jcfg.port, chat_template=self.chat_template,
                                   clamp_max_tokens=True)
        self.sampling = SamplingParams(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                                       top_k=cfg.sampling.top_k,
                                       repetition_penalty=cfg.sampling.repetition_penalty or 1.0,
                                       min_tokens=cfg.sampling.min_tokens or 0,
                                       max_tokens=cfg.sampling.max_tokens or jcfg.seq_len - 1)
        self.client = {"base_url": self.server.base_url, "model_name": cfg.model, "tokenizer_path": self.tokenizer_path,
                       "enable_thinking": cfg.sampling.enable_thinking}
        self.logger = MetricsLogger(self.run_dir, cfg.max_steps, self.start_step, self.console,
                                    wandb_run) if self.primary else None
        self.loop = loop = asyncio.new_event_loop()  # one loop for the run: verifiers' HTTP clients outlive a step
        env_resources = resources.env_resources(cfg.infrastructure.compute_size)
        resources.apply(loop, env_resources)
        self.in_flight = asyncio.Semaphore(env_resources.max_in_flight) if env_resources.max_in_flight else None
        self.console.print(env_resources.describe(cfg.infrastructure.compute_size))
        self.evaluator = evaluate.Evaluator(cfg, self.envs, self.eval_envs, self.client, self.sampling, self.console,
                                            self.secrets, self.in_flight)  # [eval]
        self.serving = contextlib.AsyncExitStack()

    def engine_params(self) -> dict[str, Any]:
        """The engine's parameters: its base weights and the trainer's LoRA, or in full fine-tuning the
        trained weights in `[jax] dtype` and no LoRA, placed for this host's engine (a collective with
        several processes)."""
        if self.full:
            weights = self.engine_weights(self.state.base)
            if self.engine_mesh is not self.mesh:
                weights = jax.device_put(distributed.to_host(weights), spec_shardings(
                    param_specs(self.mcfg), self.mcfg.dims(), self.engine_mesh))
            return {"base": weights, "lora": None}
        lora = self.state.lora
        if self.engine_mesh is not self.mesh:
            lora = jax.device_put(distributed.to_host(lora), self.engine_lora_sh)
        return {"base": self.engine_base, "lora": lora}

    async def play(self, job: tuple[int, int], first_seed: int, temperature: float) -> list[loader.Rollout]:
        """The `rollouts_per_example` rollouts of one group at `temperature` (the producer's `play`)."""
        jcfg = self.cfg.jax
        sampling = dataclasses.replace(self.sampling, temperature=temperature)
        out = await rollouts.collect(self.envs, [job], self.rollouts_per_example, self.client, sampling,
                                     first_seed, jcfg.rollout_timeout, self.in_flight)
        return out[0]

    # -- pre-flight ------------------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Compile the engine, serve the environments for the run, play one rollout of each environment
        (unless `[buffer] skip_verification`) and evaluate the base model (`[eval] eval_base_model`, as
        step 0). Raises RunError when a pre-flight rollout fails on any process."""
        cfg, loop, console = self.cfg, self.loop, self.console
        self.serve_envs()
        if not cfg.buffer.skip_verification:
            t_check = time.perf_counter()
            failing = loop.run_until_complete(rollouts.preflight(
                self.envs, self.client, self.sampling, max(cfg.jax.rollout_timeout, PREFLIGHT_TIMEOUT_S),
                self.in_flight))
            failing = list(dict.fromkeys(line for lines in distributed.all_gather_objects(failing) for line in lines))
            if failing:
                raise RunError("pre-flight rollout failed before step 1 (set [buffer] skip_verification = true "
                               "to skip this check):\n  " + "\n  ".join(failing))
            console.print(f"pre-flight: one rollout of each environment passed in "
                          f"{time.perf_counter() - t_check:.1f}s")
        self.evaluate_base()

    def serve_envs(self) -> None:
        """Compile the engine and serve the environments (training and eval) for the whole run."""
        loop = self.loop
        # Rollouts in flight are cancelled at every run's end, not only on a signal.
        loop.set_exception_handler(lambda lp, context: None if isinstance(
            context.get("exception"), asyncio.CancelledError) else lp.default_exception_handler(context))
        t_warm = time.perf_counter()
        buckets = loop.run_until_complete(self.scheduler.warmup(self.sampling))
        self.console.print(f"engine compiled ({buckets} prefill buckets + decode) in "
                           f"{time.perf_counter() - t_warm:.1f}s")
        for env in self.envs:  # one interception server and client per env for the whole run
            loop.run_until_complete(self.serving.enter_async_context(env.serving()))
        loop.run_until_complete(self.serving.enter_async_context(self.evaluator.serving()))

    def evaluate_base(self) -> None:
        """`[eval] eval_base_model`: the untrained model as a step-0 metrics row (on a fresh run only);
        then note the tasks running before any group (`close` settles them)."""
        if self.start_step == 0 and (base_metrics := self.evaluator.run(0, self.loop, self.stop)) and self.logger:
            self.logger.log(0, base_metrics)
        self.serving_tasks = asyncio.all_tasks(self.loop)

    # -- each step ----------------------------------------------------------------------------------------

    def gather(self, step: int) -> Step | None:
        """Wait for step `step`'s groups from the producer and gather each from the process that played it;
        None when a signal came first (its rollouts are played again on resume). Raises RunError when the
        buffer has no example left to draw."""
        loop, stop = self.loop, self.stop
        t_start = time.perf_counter()
        several = jax.process_count() > 1  # then a signal rides the producer's gather and stops every process
        take = loop.create_task(self.producer.take(step, (lambda: stop.requested) if several else None))
        stop.on_signal = None if several else lambda: loop.call_soon_threadsafe(take.cancel)
        try:
            taken = loop.run_until_complete(take)
        except asyncio.CancelledError:
            taken = None
        except BufferExhausted as exc:
            raise RunError(f"step {step + 1}: stopping, {exc} ({self.ckpt.resume_note()})") from None
        finally:
            stop.on_signal = None
        shares = distributed.all_gather_objects(None if taken is None else [
            [g.t, [dataclasses.asdict(r) for r in g.rollouts]] for g in taken.groups if g.rollouts is not None])
        if any(share is None for share in shares):  # preempted mid-rollouts: redone on resume
            return None
        played = {t: group for share in shares for t, group in share}
        groups = [[loader.Rollout(**r) for r in played[g.t]] for g in taken.groups]
        metrics = taken.metrics(step, self.rollouts_per_example, self.producer.playing)
        # the wait: rollouts in flight overlap the previous step
        metrics["time/rollout"] = time.perf_counter() - t_start
        return Step(step, t_start, [g.job for g in taken.groups], groups, [g.temperature for g in taken.groups],
                    metrics)

    def judge(self, s: Step) -> None:
        """The step's rollout metrics, the failure verdict over the run so far (RunError when most rollouts
        fail), and the groups to train on (`s.trained`: online difficulty filtering, `[buffer]`)."""
        cfg, groups = self.cfg, s.groups
        s.metrics = rollouts.step_metrics(groups, [cfg.env[i].display_name for i, _ in s.jobs],
                                          len(cfg.env) > 1) | s.metrics
        s.metrics |= self.scheduler.engine.metrics()  # a paged KV cache's prefix hits and pages in use
        played = sum(len(g) for g in groups)
        self.history.append((played - sum(r.ok for g in groups for r in g), played))
        if verdict := rollouts.failure_verdict(self.history):
            errors = "\n  ".join(rollouts.first_errors(groups))
            raise RunError(f"step {s.step + 1}: stopping, {verdict}; fix the environment and run again "
                           f"({self.ckpt.resume_note()}). First errors:\n  {errors}")
        if s.metrics["rollouts/failed"]:
            first = escape(redact(rollouts.first_errors(groups, 1)[0], self.secrets))
            self.console.print(f"[yellow]step {s.step + 1}: {s.metrics['rollouts/failed']:.0f} rollouts failed and "
                               f"were dropped[/]; first: {first}", highlight=False)
        keep = self.producer.record(s.jobs, [[r.reward for r in g if r.ok] for g in groups])
        s.metrics |= self.buffer.metrics(self.producer.state, keep)
        s.trained = [g for g, k in zip(groups, keep, strict=True) if k]
        s.trained_temperatures = [t for t, k in zip(s.temperatures, keep, strict=True) if k]

    def train(self, s: Step) -> dict[str, float]:
        """One optimizer step on `s.trained`'s successful rollouts once the last save is complete (else
        CheckpointError), in the train thread; returns its metrics (`optim/*`, `train/samples`, `time/train`)."""
        cfg, loop, t_train = self.cfg, self.loop, time.perf_counter()
        self.ckpt.wait()  # the last save, written while this step's rollouts played: none trains past a lost one
        trained_ok = [r for g in s.trained for r in g if r.ok]
        if not trained_ok:  # online difficulty filtering left no group with a reward signal: nothing to learn from
            self.console.print(f"[yellow]step {s.step + 1}: every group's rewards were equal (filtered by "
                               f"[buffer] online_difficulty_filtering); no update[/]")
            return {"optim/skipped": 1.0, "time/train": time.perf_counter() - t_train, "train/samples": 0.0}
        advantages = rollouts.advantages(s.trained, cfg.jax.advantage)
        temperatures = np.array([t for g, t in zip(s.trained, s.trained_temperatures, strict=True)
                                 for r in g if r.ok], np.float32)  # what each rollout sampled at
        width = pad_length(max(len(r.token_ids) for r in trained_ok), cfg.jax.seq_len)
        samples, source = training_samples(trained_ok, cfg.trajectory_strategy)
        batch = make_batch(samples, advantages[source], temperatures[source], width)
        self.state, metrics = loop.run_until_complete(loop.run_in_executor(self.train_thread, self._train, batch))
        if metrics["optim/skipped"]:
            self.console.print(f"[yellow]step {s.step + 1}: loss or gradient not finite; update skipped, "
                               f"weights unchanged[/]")
        return metrics | {"time/train": time.perf_counter() - t_train, "train/samples": float(len(samples))}

    def _train(self, batch: Any) -> tuple[TrainState, dict[str, float]]:
        with distributed.fenced():  # the train step spans every host
            new_state, metrics = self.trainer.step(self.state, self.base, batch)
            return new_state, {k: float(v) for k, v in jax.device_get(metrics).items()}

    def publish(self, version: int) -> None:
        """Hand the trainer's LoRA (or weights) to the engine as policy `version`; the next groups play it."""
        self.scheduler.update_params(self.engine_params(), version=version)
        self.producer.set_version(version)

    def record(self, s: Step) -> None:
        """Step timings, eval / val when due (on the new weights), the metrics row, the checkpoint when due
        (every `[checkpoints] interval` steps, the last step, or a signal on any process) and the PEFT
        adapters when due."""
        cfg = self.cfg
        now = time.perf_counter()
        sampled = sum(sum(r.loss_mask) for g in s.groups for r in g if r.ok)
        s.metrics |= {"time/step": now - s.t_start, "tokens_per_s": sampled / (now - s.t_start)}
        s.metrics |= self.evaluator.run(s.step + 1, self.loop, self.stop)
        if self.logger:
            self.logger.log(s.step + 1, s.metrics)
        self.done = s.step + 1
        if self.done % cfg.checkpoints.interval == 0 or self.done == cfg.max_steps or \
                distributed.any_process(self.stop.requested):
            self.save(self.done)
        with distributed.fenced():
            self.adapters.after_step(self.done, self.state.lora)

    def save(self, step: int) -> None:
        """Checkpoint the train state with the data position (buffer, producer) after step `step`."""
        buf = self.producer.state
        with distributed.fenced():
            self.ckpt.save(step, self.state, {"step": step, "examples_drawn": list(buf.drawn),
                                              "buffer": buf.to_json(), "producer": self.producer.checkpoint(),
                                              "policy_version": step, "identity": self.identity})
        self.saved = step

    # -- the end --------------------------------------------------------------------------------------------

    def preempted(self) -> None:
        """A signal stopped the run: checkpoint the last complete step and raise Preempted."""
        if self.saved != self.done:
            self.save(self.done)
        self.ckpt.wait()
        raise Preempted(f"{self.stop.signal or 'a signal to another host'}: stopped after step {self.done}; "
                        f"checkpoint step {self.done} is in {self.ckpt.directory}. Run the same command again to "
                        f"resume.")

    def close(self) -> None:
        """Stop what `start` started, whether the run ended, failed or was stopped: the metrics files, the
        train thread, rollouts in flight (dropped), the environments' servers, the event loop, the server,
        the scheduler and the checkpointer."""
        if self.logger:
            self.logger.close()
        self.train_thread.shutdown()
        self.producer.cancel()  # rollouts in flight past the last step, or since a failure: dropped
        self.close_serving()
        distributed.set_fence(None)
        with contextlib.suppress(Exception):
            self.ckpt.close()

    def close_serving(self) -> None:
        """Stop the serving side: the environments' servers, the event loop, the server, the scheduler."""
        if self.serving_tasks is not None:
            self.loop.run_until_complete(rollouts.settle(self.serving_tasks, timeout_s=10.0))
        self.loop.run_until_complete(self.serving.aclose())
        self.loop.close()
        self.server.stop()
        self.scheduler.stop()


def _engine_group(cfg: RunConfig, mcfg: ModelConfig, mesh: Mesh, console: Any, micro: int | None = None) -> range:
    """The processes whose devices this process's rollout engine spans: `[jax] engine_hosts` consecutive
    ones, or the fit rule's (`jaxrl.parallel.distributed.engine_hosts`; `jaxrl.compile.report.run_engine_hosts`).
    Raises ConfigError (key `jax.mesh` when the compiler refuses the train step, else `jax.engine_hosts`)."""
    def fit(chip_bytes: int) -> int:
        console.print("engine_hosts = 0: compiling the train step to choose the rollout engine's hosts "
                      "(set [jax] engine_hosts to skip this; jaxrl compile prints the value)")
        try:
            return report.run_engine_hosts(cfg, mcfg, mesh, chip_bytes, micro)
        except Exception as exc:  # noqa: BLE001 - not the checkpoint's fault: say which step failed
            key = "jax.mesh" if isinstance(exc, ProgramTooLarge) else "jax.engine_hosts"
            raise ConfigError(cfg.source, [(key, f"compiling the train step to choose the engine hosts: "
                                                 f"{type(exc).__name__}: {exc}; `jaxrl compile` says more")]) from None

    try:
        hosts = distributed.engine_hosts(cfg.jax.engine_hosts, jax.process_count(), distributed.chip_memory(), fit)
    except ValueError as exc:
        raise ConfigError(cfg.source, [("jax.engine_hosts", str(exc))]) from None
    first = jax.process_index() // hosts * hosts
    return range(first, first + hosts)
