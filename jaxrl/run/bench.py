"""`jaxrl run CONFIG --bench`: the rollout engine's and the trainer's throughput alone, on synthetic rollouts
(prime-rl's `--bench`: its orchestrator and trainer on fake data, no environment).

The config's model, mesh, engine (`[jax] decode_slots`, `seq_len`, `kv_cache_tokens`, `dtype`) and trainer
(`[jax.loss]`, `[jax.optim]`, LoRA or full fine-tuning) are built as `jaxrl run` builds them; no
environment is loaded and nothing is written (no run folder, no checkpoint, no metrics file). Each of
`BENCH_STEPS` steps generates `batch_size` rollouts in groups of `rollouts_per_example` sharing one prompt
of random token ids, `seq_len - max_tokens` tokens long (at least 1), each sampling exactly `max_tokens`
tokens (`[sampling]`'s temperature and truncations, no stop token), trains one optimizer step on them with
random advantages, and hands the new weights to the engine, as a run's step does. Per step:

* `prefill_tokens_per_s`: the prompts' tokens over the seconds of a pass that samples 1 token each;
* `decode_tokens_per_s`: the remaining `max_tokens - 1` tokens of every rollout over the full pass's
  seconds less that prefill pass's;
* `generate_tokens_per_s`: every sampled token over the full pass's seconds;
* `train_tokens_per_s`: the batch's tokens (prompt and completion) over the optimizer step's seconds;
* `step_s`: generation, training and the hand-over together; `weight_update_s`: the hand-over alone
  (`time/weight_update`).

The engine's programs are compiled before the first step (`Scheduler.warmup`), the train step's in the
first step: the summary is the median over the steps after the first. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from typing import Any

import jax
import numpy as np
from rich.console import Console

from jaxrl.config.schema import ConfigError, RunConfig
from jaxrl.inference.chunked import make_scheduler
from jaxrl.inference.protocol import Completion
from jaxrl.rl.train import make_batch
from jaxrl.run.job import Job
from jaxrl.run.runner import pad_length
from jaxrl.run.serving import run_engine, sampling_params

BENCH_STEPS = 3
"""Steps of a benchmark: the first compiles the train step; the summary is the median of the others."""


@dataclasses.dataclass
class BenchStep:
    """One step's figures (the module docstring defines each): seconds and tokens per second."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    generate_tokens_per_s: float
    train_tokens_per_s: float
    generate_s: float
    train_s: float
    weight_update_s: float
    step_s: float


class Bench(Job):
    """A benchmark of `cfg`'s engine and trainer (module docstring): `run` returns the report as a dict."""

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rollouts a step, prompt tokens, sampled tokens) of each synthetic step."""
        cfg = self.cfg
        sampled = min(sampling_params(cfg).max_tokens, cfg.jax.seq_len - 1)
        return cfg.batch_size, cfg.jax.seq_len - sampled, sampled

    def run(self) -> dict[str, Any]:  # type: ignore[override]
        """Build the model, trainer and engine, run `BENCH_STEPS` steps; the report: the setting, each
        step's `BenchStep` and their `summary`. Raises ConfigError as `jaxrl run` does (the model cannot be
        loaded, the mesh does not fit), and for an engine over several hosts (`[jax] engine_hosts`)."""
        if jax.process_count() > 1:
            raise ConfigError(self.cfg.source, [("jax", "--bench runs on one process (one host) only")])
        self.load_model()
        self.init_training()
        engine = run_engine(self.cfg, self.model.config, self.placement, self.console.print)
        self.scheduler = make_scheduler(engine, self.engine_params(), self.cfg.model, seed=self.cfg.sampling_seed)
        loop = asyncio.new_event_loop()
        try:
            t0 = time.perf_counter()
            loop.run_until_complete(self.scheduler.warmup(sampling_params(self.cfg)))
            self.console.print(f"bench: engine compiled in {time.perf_counter() - t0:.1f}s")
            steps = [self.step_figures(loop, step) for step in range(BENCH_STEPS)]
        finally:
            self.scheduler.stop()
            loop.close()
        n, prompt, sampled = self.shape
        later = steps[1:] or steps
        summary = {f: statistics.median(getattr(s, f) for s in later) for f in BenchStep.__dataclass_fields__}
        return {"model": self.model.path, "rollouts": n, "prompt_tokens": prompt, "max_tokens": sampled,
                "decode_slots": self.cfg.jax.decode_slots, "devices": jax.device_count(),
                "platform": jax.devices()[0].platform, "steps": [dataclasses.asdict(s) for s in steps],
                "summary": summary}

    def generate(self, loop: asyncio.AbstractEventLoop, prompts: list[list[int]], max_tokens: int,
                 first_seed: int) -> tuple[list[Completion], float]:
        """Every prompt's completion of exactly `max_tokens` tokens (no stop token) at once, and the seconds."""
        base = dataclasses.replace(sampling_params(self.cfg), max_tokens=max_tokens, stop_token_ids=(),
                                   min_tokens=0)

        async def every() -> list[Completion]:
            seeded = [dataclasses.replace(base, seed=first_seed + i) for i in range(len(prompts))]
            return list(await asyncio.gather(*map(self.scheduler.generate, prompts, seeded)))

        t0 = time.perf_counter()
        out = loop.run_until_complete(every())
        return out, time.perf_counter() - t0

    def step_figures(self, loop: asyncio.AbstractEventLoop, step: int) -> BenchStep:
        """Step `step`: generate, train, hand over (module docstring); prints and returns its figures."""
        n, prompt_len, sampled = self.shape
        rng = np.random.default_rng(step)
        group = self.cfg.rollouts_per_example
        prompts = [p for p in rng.integers(0, self.model.config.vocab_size, (n // group, prompt_len)).tolist()
                   for _ in range(group)]
        t_start = time.perf_counter()
        _, prefill_s = self.generate(loop, prompts, 1, step * n)
        completions, generate_s = self.generate(loop, prompts, sampled, step * n)
        samples = [(p + c.token_ids, [False] * len(p) + [True] * len(c.token_ids), [0.0] * len(p) + c.logprobs)
                   for p, c in zip(prompts, completions, strict=True)]
        width = pad_length(prompt_len + sampled, self.cfg.jax.seq_len)
        temperature = sampling_params(self.cfg).temperature
        batch = make_batch(samples, rng.standard_normal(n).astype(np.float32), temperature, width)
        t_train = time.perf_counter()
        self.state, _ = self.train_step(batch)
        train_s = time.perf_counter() - t_train
        t_update = time.perf_counter()
        self.scheduler.update_params(jax.block_until_ready(self.engine_params()), step + 1)
        now = time.perf_counter()
        tokens = sum(len(c.token_ids) for c in completions)
        figures = BenchStep(
            prefill_tokens_per_s=n * prompt_len / prefill_s,
            decode_tokens_per_s=(tokens - n) / max(generate_s - prefill_s, 1e-9),
            generate_tokens_per_s=tokens / generate_s,
            train_tokens_per_s=n * (prompt_len + sampled) / train_s,
            generate_s=generate_s, train_s=train_s, weight_update_s=now - t_update, step_s=now - t_start)
        self.console.print(f"bench step {step + 1}/{BENCH_STEPS}: generate {generate_s:.2f}s (prefill "
                           f"{figures.prefill_tokens_per_s:,.0f} tok/s, decode {figures.decode_tokens_per_s:,.0f} "
                           f"tok/s), train {train_s:.2f}s ({figures.train_tokens_per_s:,.0f} tok/s), weight "
                           f"update {figures.weight_update_s:.3f}s")
        return figures


def bench(cfg: RunConfig, console: Console) -> dict[str, Any]:
    """The benchmark of `cfg` (`Bench.run`'s report); raises what it raises."""
    return Bench(cfg, console, []).run()
