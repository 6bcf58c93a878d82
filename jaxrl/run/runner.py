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
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.markup import escape

from jaxrl.config.env_file import load_env_file
from jaxrl.config.schema import ConfigError, RunConfig, resolve_tokenizer_path
from jaxrl.envs import loader
from jaxrl.parallel import distributed
from jaxrl.rl import rollouts
from jaxrl.rl.buffer import Buffer, BufferExhausted, BufferState
from jaxrl.rl.producer import Producer, ProducerSettings
from jaxrl.rl.samples import training_samples
from jaxrl.rl.teacher_client import TeacherUnavailable, check_server, score
from jaxrl.rl.train import make_batch
from jaxrl.run.errors import RunError
from jaxrl.run.job import Job
from jaxrl.run.redaction import redact, secret_values
from jaxrl.run.teacher import student_encoder

PREFLIGHT_TIMEOUT_S = 300.0
"""Least time the pre-flight rollout gets: it loads the client's tokenizer, which a step's do not."""


def pad_length(n: int, seq_len: int) -> int:
    """Training width for a longest sample of `n` tokens: the next power of two >= 64, capped at seq_len,
    so the train step compiles for a handful of widths only."""
    width = 64
    while width < n:
        width *= 2
    return min(width, seq_len)


def run(cfg: RunConfig, console: Console | None = None, run_class: type[Job] | None = None) -> Path:
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


class Run(Job):
    """An RL run, in phases (the model is prime-rl's orchestrator: one method per phase), over `Job`'s
    (model, LoRA, checkpoints, adapters, metrics, eval, signals).

    `setup` adds the example buffer; `start` the rollout producer and the train thread; `preflight` plays
    one rollout of each environment (`verify`) and launches the first groups. Then each step is `gather`
    (its groups, from the producer and every process) -> `judge` (metrics, failure verdict, difficulty
    filter) -> `train` (one optimizer step) -> `publish` (the new LoRA to the engine) -> `record` (eval,
    then `Job.record_step`: metrics, checkpoint, adapters). A phase to add is a method here, called from
    `step`, reading the attributes the phases above it set.
    """

    def __init__(self, cfg: RunConfig, console: Console, secrets: list[str]) -> None:
        super().__init__(cfg, console, secrets)
        self.history: list[tuple[int, int]] = []  # (failed, played) rollouts per step: the failure verdict's
        self.producer: Producer | None = None
        self.train_thread: ThreadPoolExecutor | None = None  # the train step's: the loop plays meanwhile

    def step(self, step: int) -> bool:
        """One step's phases; False when a signal stopped it before its rollouts were in."""
        if (s := self.gather(step)) is None:
            return False
        self.judge(s)
        s.metrics |= self.train(s)
        s.metrics["time/weight_update"] = self.publish(s.step + 1)
        self.record(s)
        return True

    # -- setup and start ------------------------------------------------------------------------------------

    def setup(self) -> None:
        """A server teacher's check (`check_server`, its tokenizer probed against the student's; ConfigError,
        key `jax.teacher.base_url`, when it cannot be used), `Job.setup`, then the example buffer over the
        environments and its state (the checkpoint's, or fresh)."""
        if self.server_teacher:
            tokenizer = resolve_tokenizer_path(self.cfg)
            encode = student_encoder(self.cfg, tokenizer)
            try:  # before anything loads: a server that is down is one line, not a failed first step
                asyncio.run(check_server(self.cfg.jax.teacher, encode, tokenizer))
            except TeacherUnavailable as exc:
                raise ConfigError(self.cfg.source, [("jax.teacher.base_url", str(exc))]) from None
        super().setup()
        self.buffer = Buffer(tuple(len(env.tasks) for env in self.envs.train), self.cfg.buffer,
                             dense_signal=self.cfg.jax.loss.teacher_tau > 0)
        meta = self.progress.meta
        self.buffer_state = BufferState.from_meta(meta) if meta else BufferState.fresh(len(self.envs.train))

    @property
    def server_teacher(self) -> bool:
        """Whether the teacher is a server (`[jax.teacher] base_url`), asked at each step's batch."""
        return self.cfg.jax.teacher is not None and self.cfg.jax.teacher.base_url is not None

    def start(self) -> None:
        """`Job.start`, then the rollout producer (resuming the checkpoint's groups in flight) and the train
        thread; `close` stops them."""
        super().start()
        cfg = self.cfg
        next_t, resumed = Producer.resumed(self.progress.meta, self.progress.start_step,
                                           cfg.batch_size // cfg.rollouts_per_example)
        settings = ProducerSettings.of_run(cfg, jax.process_count(), jax.process_index(),
                                           distributed.Exchange().gather if jax.process_count() > 1 else None)
        self.producer = Producer(self.serving.loop, self.buffer, self.buffer_state, self.play, self.serving.versions,
                                 settings, self.progress.start_step, next_t, resumed)
        self.train_thread = ThreadPoolExecutor(1, thread_name_prefix="jaxrl-train")

    async def play(self, job: tuple[int, int], first_seed: int, temperature: float) -> list[loader.Rollout]:
        """The `rollouts_per_example` rollouts of one group at `temperature` (the producer's `play`)."""
        serving = self.serving
        sampling = dataclasses.replace(serving.sampling, temperature=temperature)
        out = await rollouts.collect(self.envs.train, [job], self.cfg.rollouts_per_example, serving.client, sampling,
                                     first_seed, self.cfg.jax.rollout_timeout, serving.in_flight)
        return out[0]

    # -- pre-flight ------------------------------------------------------------------------------------------

    def preflight(self) -> None:
        """`Job.preflight` (engine, environments, `verify`, base eval), then launch the first groups."""
        super().preflight()
        self.producer.refill()

    def verify(self) -> None:
        """Play one rollout of each environment (unless `[buffer] skip_verification`). Raises RunError when
        a pre-flight rollout fails on any process."""
        cfg, serving = self.cfg, self.serving
        if cfg.buffer.skip_verification:
            return
        t_check = time.perf_counter()
        failing = serving.loop.run_until_complete(rollouts.preflight(
            self.envs.train, serving.client, serving.sampling, max(cfg.jax.rollout_timeout, PREFLIGHT_TIMEOUT_S),
            serving.in_flight))
        failing = list(dict.fromkeys(line for lines in distributed.all_gather_objects(failing) for line in lines))
        if failing:
            raise RunError("pre-flight rollout failed before step 1 (set [buffer] skip_verification = true "
                           "to skip this check):\n  " + "\n  ".join(failing))
        self.console.print(f"pre-flight: one rollout of each environment passed in "
                           f"{time.perf_counter() - t_check:.1f}s")

    # -- each step ----------------------------------------------------------------------------------------

    def gather(self, step: int) -> Step | None:
        """Wait for step `step`'s groups from the producer and gather each from the process that played it;
        None when a signal came first (its rollouts are played again on resume). Raises RunError when the
        buffer has no example left to draw."""
        loop, stop = self.serving.loop, self.stop
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
        metrics = taken.metrics(step, self.cfg.rollouts_per_example, self.producer.playing)
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
        s.metrics |= self.serving.scheduler.engine.metrics()  # prefills; a paged cache's hits, pages
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
        cfg, loop, t_train = self.cfg, self.serving.loop, time.perf_counter()
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
        teacher, taught = None, {}
        if self.server_teacher:
            samples, source, teacher, taught = self.ask_teacher(s, samples, source)
            if not samples:
                return {"optim/skipped": 1.0, "time/train": time.perf_counter() - t_train, "train/samples": 0.0,
                        **taught}
        batch = make_batch(samples, advantages[source], temperatures[source], width, teacher)
        self.state, metrics = loop.run_until_complete(loop.run_in_executor(self.train_thread, self.train_step, batch))
        if metrics["optim/skipped"]:
            self.console.print(f"[yellow]step {s.step + 1}: loss or gradient not finite; update skipped, "
                               f"weights unchanged[/]")
        return metrics | taught | {"time/train": time.perf_counter() - t_train, "train/samples": float(len(samples))}

    def ask_teacher(self, s: Step, samples: list, source: np.ndarray) -> tuple[list, np.ndarray, list, dict]:
        """The server teacher's logprobs of each sample's tokens (`jaxrl.rl.teacher_client.score`); samples
        it failed on are dropped (counted in `teacher/failed`, the first reason printed). Returns the samples
        kept, their `source` rows, their teacher logprobs and the metrics."""
        loop = self.serving.loop
        logprobs, errors = loop.run_until_complete(score(self.cfg.jax.teacher, [ids for ids, _, _ in samples]))
        keep = [i for i, lp in enumerate(logprobs) if lp is not None]
        if errors:
            self.console.print(f"[yellow]step {s.step + 1}: the teacher failed on {len(errors)} of {len(samples)} "
                               f"samples, dropped[/]; first: {escape(errors[0])}", highlight=False)
        return ([samples[i] for i in keep], source[keep], [logprobs[i] for i in keep],
                {"teacher/failed": float(len(errors))})

    def publish(self, version: int) -> float:
        """Hand the trainer's LoRA (or, in full fine-tuning, its weights) to the engine as policy `version`
        (`Job.publish`, whose seconds it returns); the producer's next groups play it."""
        seconds = super().publish(version)
        self.producer.set_version(version)
        return seconds

    def record(self, s: Step) -> None:
        """Step timings, eval / val when due (on the new weights), then `Job.record_step` (the metrics row,
        the checkpoint and the PEFT adapters when due)."""
        now = time.perf_counter()
        sampled = sum(sum(r.loss_mask) for g in s.groups for r in g if r.ok)
        s.metrics |= {"time/step": now - s.t_start, "tokens_per_s": sampled / (now - s.t_start)}
        s.metrics |= self.serving.evaluate(s.step + 1, self.stop)
        self.record_step(s.step + 1, s.metrics)

    def checkpoint_meta(self, step: int) -> dict:
        """The data position (buffer, producer) after step `step`, with the model identity."""
        buf = self.producer.state
        return {"step": step, "examples_drawn": list(buf.drawn), "buffer": buf.to_json(),
                "producer": self.producer.checkpoint(), "policy_version": step, "identity": self.identity}

    # -- the end --------------------------------------------------------------------------------------------

    def stop_work(self) -> None:
        """Stop the train thread and drop the rollouts in flight (past the last step, or since a failure)."""
        self.train_thread.shutdown()
        self.producer.cancel()
