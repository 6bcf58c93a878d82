"""`jaxrl sft`: supervised fine-tuning of the LoRA on chat-format JSONL (`[jax.sft]`), with an RL run's
machinery: the same model loading, `Trainer` (its step and accumulation, over `losses.sft_loss`),
optimizer and schedule (`[jax.optim]`), Orbax checkpoints with the model identity, PEFT adapters
(`[adapters]`), metrics rows, W&B, `[eval]` through the rollout engine and server, resume, SIGTERM.

Each step trains `[jax.sft] batch_size` packed rows of `[jax] seq_len` tokens (`jaxrl.rl.sft`), drawn
epoch after epoch, each epoch in a seeded order (`jaxrl.rl.sft.step_rows`), so a resumed run takes the
rows the uninterrupted run would have. Metrics: `loss` (token-mean negative log-likelihood of the
assistant tokens), `tokens_per_s` (non-padding tokens trained per second of the step), `sft/loss_tokens`,
`sft/epoch` (epochs done, fractional), `time/train`, `time/step`, the trainer's `optim/*` and
`policy/entropy`, and with `[eval]` the eval rows RL runs write. A checkpoint holds the same train state
as an RL run's, so an RL run's `checkpoint_id` warm-starts from it.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import jax
from rich.console import Console

from jaxrl.config.schema import ConfigError, RunConfig
from jaxrl.config.sft import DataError
from jaxrl.inference.chat import ChatTemplate
from jaxrl.parallel import distributed
from jaxrl.rl import sft
from jaxrl.run import wandb_log
from jaxrl.run.adapters import RunAdapters
from jaxrl.run.checkpoint import Checkpointer
from jaxrl.run.layout import METRICS, adapters_dir_of, checkpoint_dir_of, write_run_config
from jaxrl.run.metrics import MetricsLogger, trim_metrics
from jaxrl.run.runner import Run
from jaxrl.run.signals import stop_on_signals

HEADLINE = ("loss", "tokens_per_s", "time/step")


class SftRun(Run):
    """An SFT run: `Run`'s phases where they are the same (model, LoRA, engine and evaluator, close), its
    own where RL's gather rollouts: `setup` loads and packs the data, `step` trains the step's rows."""

    def run(self) -> Path:
        """All phases; return the run folder. Raises what `jaxrl.run.runner.run` documents (not RunError
        for rollouts: none are played but eval's)."""
        self.setup()
        if self.start_step >= self.cfg.max_steps:
            self.console.print(f"run already complete ({self.start_step}/{self.cfg.max_steps} steps)")
            self.ckpt.close()
            return self.run_dir
        self.start()
        try:
            with stop_on_signals() as self.stop:
                if self.serves:
                    self.serve_envs()
                    self.evaluate_base()
                for step in range(self.start_step, self.cfg.max_steps):
                    if distributed.any_process(self.stop.requested):
                        break
                    self.step(step)
                if distributed.any_process(self.stop.requested):
                    self.preempted()
            self.ckpt.wait()
        finally:
            self.close()
        self.console.print(f"done: {self.cfg.max_steps} SFT steps; metrics in {self.run_dir / METRICS}, "
                           f"checkpoints in {self.ckpt.directory}")
        return self.run_dir

    def setup(self) -> None:
        """Load the model, the LoRA, the trainer, the data (packed), the eval environments and the last
        checkpoint (or `checkpoint_id`'s LoRA). Raises ConfigError (key `jax.sft.data`) for data that
        cannot be tokenized or packed."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.load_model()
        self.load_data()  # sets max_steps from [jax.sft] epochs
        cfg = self.cfg
        if self.primary:
            write_run_config(self.run_dir, cfg)
        self.adapters = RunAdapters(cfg, self.mcfg, adapters_dir_of(cfg), self.console)
        self.init_training("sft")
        self.serves = cfg.eval is not None or cfg.val is not None  # the engine and server, for eval only
        self.envs, self.eval_envs, self.chat_template = [], [], None
        if self.serves:
            self.load_envs()
        self.ckpt = Checkpointer(checkpoint_dir_of(cfg), keep=cfg.checkpoints.keep_cloud)
        self.resume_or_warm_start()
        self.done = self.saved = self.start_step
        if self.primary and (dropped := trim_metrics(self.run_dir / METRICS, self.start_step)):
            self.console.print(f"dropped {dropped} metrics rows past step {self.start_step} "
                               f"(steps run after the last checkpoint)")

    def load_data(self) -> None:
        """Read, tokenize (the tokenizer folder's chat template, `[sampling] enable_thinking`) and pack
        `[jax.sft] data` into rows of `[jax] seq_len` (`data`); with `[jax.sft] epochs`, `cfg.max_steps`
        becomes their steps (ConfigError, key `jax.optim.warmup_steps`, when the warmup is not shorter)."""
        cfg, scfg = self.cfg, self.cfg.jax.sft
        t0 = time.perf_counter()
        try:
            template = ChatTemplate.load(self.tokenizer_path, self.model_path)
            tokenizer = sft.Tokenizer.from_tokenizer(template.tokenizer, cfg.sampling.enable_thinking)
            self.data = sft.load(scfg.data, tokenizer, cfg.jax.seq_len, scfg.seed)
        except (DataError, ValueError, OSError) as exc:
            raise ConfigError(cfg.source, [("jax.sft.data", str(exc))]) from None
        d = self.data
        if scfg.epochs is not None:
            steps = sft.epoch_steps(scfg.epochs, d.rows, scfg.batch_size)
            self.cfg = cfg = cfg.model_copy(update={"max_steps": steps})
            if (warmup := cfg.jax.optim.warmup_steps) and warmup >= steps:
                raise ConfigError(cfg.source, [("jax.optim.warmup_steps", f"{warmup} must be < the {steps} steps of "
                                                                          f"{scfg.epochs} epochs")])
        steps_per_epoch = d.rows / scfg.batch_size
        self.console.print(f"SFT data: {d.conversations} conversations in {d.rows} rows of {cfg.jax.seq_len} tokens "
                           f"({int(d.loss_mask.sum())} trained tokens; {d.truncated} conversations cut to the "
                           f"row length), {cfg.max_steps} steps of {scfg.batch_size} rows = "
                           f"{cfg.max_steps / steps_per_epoch:.2f} epochs; read in {time.perf_counter() - t0:.1f}s")

    def start(self) -> None:
        """Start the engine, server and evaluator when `[eval]` / `[val]` play, else the W&B run and the
        metrics logger alone."""
        if self.serves:
            self.start_serving()
        else:
            wandb_run = wandb_log.start(self.cfg, self.run_dir, self.secrets, self.console) if self.primary else None
            self.logger = MetricsLogger(self.run_dir, self.cfg.max_steps, self.start_step, self.console,
                                        wandb_run) if self.primary else None
        if self.logger:
            self.logger.headline = HEADLINE

    def step(self, step: int) -> bool:
        """One optimizer step on step `step`'s rows, then eval when due, the metrics row, the checkpoint
        and the adapters when due."""
        cfg, scfg = self.cfg, self.cfg.jax.sft
        t0 = time.perf_counter()
        batch = self.data.batch(sft.step_rows(step, scfg.batch_size, self.data.rows, scfg.seed))
        self.ckpt.wait()  # no step trains past a checkpoint that could not be kept (CheckpointError)
        with distributed.fenced():
            self.state, metrics = self.trainer.step(self.state, self.base, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if metrics["optim/skipped"]:
            self.console.print(f"[yellow]step {step + 1}: loss or gradient not finite; update skipped[/]")
        now = time.perf_counter()
        tokens = float((batch.segment_ids > 0).sum())
        metrics |= {"time/train": now - t0, "time/step": now - t0, "tokens_per_s": tokens / (now - t0),
                    "sft/loss_tokens": float(batch.loss_mask.sum()),
                    "sft/epoch": (step + 1) * scfg.batch_size / self.data.rows}
        if self.serves:
            self.scheduler.update_params(self.engine_params(), version=step + 1)
            metrics |= self.evaluator.run(step + 1, self.loop, self.stop)
        if self.logger:
            self.logger.log(step + 1, metrics)
        self.done = step + 1
        if self.done % cfg.checkpoints.interval == 0 or self.done == cfg.max_steps or \
                distributed.any_process(self.stop.requested):
            self.save(self.done)
        with distributed.fenced():
            self.adapters.after_step(self.done, self.state.lora)
        return True

    def save(self, step: int) -> None:
        """Checkpoint the train state after step `step` (the data position is the step itself)."""
        with distributed.fenced():
            self.ckpt.save(step, self.state, {"step": step, "policy_version": step, "identity": self.identity,
                                              "sft": True})
        self.saved = step

    def close(self) -> None:
        """Stop what `start` started: the metrics files and, when serving, the environments' servers, the
        event loop, the server, the scheduler; then the checkpointer."""
        if self.logger:
            self.logger.close()
        if self.serves:
            self.close_serving()
        distributed.set_fence(None)
        with contextlib.suppress(Exception):
            self.ckpt.close()


def run_sft(cfg: RunConfig, console: Console | None = None) -> Path:
    """Train `cfg` (an SFT config: `[jax.sft]` set) to `max_steps`, resuming from the run's last complete
    checkpoint when there is one; return the run folder. Raises what `jaxrl.run.runner.run` does."""
    from jaxrl.run.runner import run

    return run(cfg, console, run_class=SftRun)
