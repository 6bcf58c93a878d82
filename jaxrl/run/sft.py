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

import time

from jaxrl.config.schema import ConfigError
from jaxrl.config.sft import DataError
from jaxrl.inference.template import ChatTemplate
from jaxrl.rl import sft
from jaxrl.run.job import Job
from jaxrl.run.layout import METRICS

HEADLINE = ("loss", "tokens_per_s", "time/step")


class SftRun(Job):
    """An SFT run over `Job`'s phases (model, LoRA, checkpoints, adapters, metrics, eval, signals): `load_data`
    reads and packs the data, `step` trains the step's rows; the engine and server start for `[eval]` /
    `[val]` only."""

    objective = "sft"

    @property
    def serves(self) -> bool:
        """The engine and server, for eval only."""
        return self.cfg.eval is not None or self.cfg.val is not None

    def summary(self) -> str:
        return (f"done: {self.cfg.max_steps} SFT steps; metrics in {self.run_dir / METRICS}, "
                f"checkpoints in {self.ckpt.directory}")

    def load_data(self) -> None:
        """Read, tokenize (the tokenizer folder's chat template, `[sampling] enable_thinking`) and pack
        `[jax.sft] data` into rows of `[jax] seq_len` (`data`); with `[jax.sft] epochs`, `cfg.max_steps`
        becomes their steps (ConfigError, key `jax.optim.warmup_steps`, when the warmup is not shorter)."""
        cfg, scfg = self.cfg, self.cfg.jax.sft
        t0 = time.perf_counter()
        try:
            template = ChatTemplate.load(self.model.tokenizer_path, self.model.path)
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
        """`Job.start`, with the SFT metrics on each printed step line."""
        super().start()
        if self.logger:
            self.logger.headline = HEADLINE

    def step(self, step: int) -> bool:
        """One optimizer step on step `step`'s rows, then eval when due and `Job.record_step` (the metrics
        row, the checkpoint and the adapters when due)."""
        scfg = self.cfg.jax.sft
        t0 = time.perf_counter()
        batch = self.data.batch(sft.step_rows(step, scfg.batch_size, self.data.rows, scfg.seed))
        self.ckpt.wait()  # no step trains past a checkpoint that could not be kept (CheckpointError)
        self.state, metrics = self.train_step(batch)
        if metrics["optim/skipped"]:
            self.console.print(f"[yellow]step {step + 1}: loss or gradient not finite; update skipped[/]")
        now = time.perf_counter()
        tokens = float((batch.segment_ids > 0).sum())
        metrics |= {"time/train": now - t0, "time/step": now - t0, "tokens_per_s": tokens / (now - t0),
                    "sft/loss_tokens": float(batch.loss_mask.sum()),
                    "sft/epoch": (step + 1) * scfg.batch_size / self.data.rows}
        if self.serving is not None:
            self.publish(step + 1)
            metrics |= self.serving.evaluate(step + 1, self.stop)
        self.record_step(step + 1, metrics)
        return True

    def checkpoint_meta(self, step: int) -> dict:
        """The train state's metadata after step `step` (the data position is the step itself)."""
        return {"step": step, "policy_version": step, "identity": self.identity, "sft": True}

