"""Online evaluation (`[eval]`) and validation (`[val]`) during a run, through the run's own rollout server.

What is played:
- `[eval]` every `interval` steps (and at step 0, before any update, with `eval_base_model`): each
  `[[eval.env]]` (loaded with its own `args`) on `num_examples` examples (-1 = all) x
  `rollouts_per_example`, each falling back to the `[eval]` defaults; without `[[eval.env]]` tables,
  the training environments.
- `[val]` every `interval` steps: each training `[[env]]` on `num_examples` examples x
  `rollouts_per_example`.
An environment is played on the first examples of its eval split (verifiers' `eval_dataset`; here a
taskset whose `split` field accepts "eval", see `jaxrl.envs.loader.load_env`), and on its train examples when
it has none, as the Hosted Training docs say of `[val]` ("Falls back to primary dataset if
`eval_dataset` is not set"). The same examples and the same seeds are played at every check, so an eval
curve moves only with the weights.

Sampling is the run's `[sampling]`: the Hosted Training schema has no eval sampling table, prime-rl's
eval sampling defaults to the inference server's defaults rather than greedy, and pass@k needs
samples that differ. Seeds: training's rollout seeds count up from
`jax.seed * SEED_MULTIPLIER * rollouts_per_example` (`jaxrl.rl.producer.ProducerSettings.of_run`); eval's
count up from 2**30 below that
and val's from 2**29 below it, so neither meets training's, nor each other's, within 2**29 rollouts
(and the producer's per-seed record of policy versions, `jaxrl.rl.producer.VersionLog`, never sees them).

Metrics, in the training step's row (`jaxrl.rl.rollouts.step_metrics`'s names under a prefix): eval
`eval/<env>/reward/mean`, `.../reward/std`, `.../seq_len`, `.../is_truncated`, `.../tool_call_rate`,
`.../rollouts/failed`, and `eval/<env>/pass@k` where it applies; val the same under `val/` over all training
environments, and under `val/<env>/` per environment when there are several; `time/eval`, `time/val` in seconds.
Failed rollouts are counted, never fatal. pass@k is reported, as prime-rl does, only when every reward
of the environment's check is 0 or 1 (reward 1 = correct; a failed rollout counts as incorrect) and
there are several rollouts per example, for k = 1, 2, 4, ... and k = rollouts_per_example.

Several processes: the check's (environment, example) jobs are split like a training step's groups
(`jaxrl.parallel.distributed.share`), and the small per-rollout outcomes are gathered to every process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import numpy as np
from rich.console import Console
from rich.markup import escape

from jaxrl.config.schema import SEED_MULTIPLIER, ConfigError, RunConfig
from jaxrl.envs import loader
from jaxrl.inference.protocol import SamplingParams
from jaxrl.parallel import distributed
from jaxrl.rl import rollouts
from jaxrl.run.redaction import redact
from jaxrl.run.signals import StopRequest

Kind = Literal["eval", "val"]
SEED_BELOW_TRAINING: dict[Kind, int] = {"eval": 2**30, "val": 2**29}
"""How far below training's first rollout seed each kind's seeds start (see the module docstring)."""
SETTLE_S = 10.0
"""Seconds a cancelled check waits for its rollouts' shielded clean-up before the step goes on."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from `n` attempts of which `c` were correct:
    1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
    eq. 1), computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i) to stay finite for large n.

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_ks(n: int) -> list[int]:
    """The k reported for `n` rollouts per example: powers of two below `n`, and `n` itself."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the metrics need of one eval rollout, small enough to gather from every process:
    reward (the taskset's), ok (False: failed, `error` set), seq_len (prompt + completion tokens),
    is_truncated, tool_calls (the tool calls the model made)."""

    reward: float
    ok: bool
    seq_len: int
    is_truncated: bool
    error: str | None
    tool_calls: int = 0

    @classmethod
    def of(cls, r: loader.Rollout) -> Outcome:
        """The outcome of a played rollout."""
        return cls(r.reward, r.ok, len(r.token_ids), r.is_truncated, r.error, r.tool_calls)


def check_metrics(groups: list[list[Outcome]], prefix: str) -> dict[str, float]:
    """One environment's (or one kind's) metrics of a check, every key starting with `prefix`.

    `groups` holds the outcomes of each example. Over successful rollouts: `reward/mean` (NaN when none
    succeeded), `reward/std`, `seq_len`, `is_truncated` (share), `tool_call_rate` (share with a tool call);
    `rollouts/failed` counts the others.
    `pass@k` (`pass_at_k`, averaged over examples) for each k of `pass_at_k_ks`, only when every
    successful reward is 0 or 1 and every example has at least 2 rollouts; correct = reward 1.
    """
    flat = [o for g in groups for o in g]
    ok = [o for o in flat if o.ok]
    rewards = np.array([o.reward for o in ok], np.float64)
    out = {
        f"{prefix}reward/mean": float(rewards.mean()) if ok else float("nan"),
        f"{prefix}reward/std": float(rewards.std()) if ok else 0.0,
        f"{prefix}seq_len": float(np.mean([o.seq_len for o in ok])) if ok else 0.0,
        f"{prefix}is_truncated": float(np.mean([o.is_truncated for o in ok])) if ok else 0.0,
        f"{prefix}tool_call_rate": float(np.mean([o.tool_calls > 0 for o in ok])) if ok else 0.0,
        f"{prefix}rollouts/failed": float(len(flat) - len(ok)),
    }
    n = min((len(g) for g in groups), default=0)
    if ok and n >= 2 and set(rewards.tolist()) <= {0.0, 1.0}:
        correct = [sum(o.ok and o.reward == 1.0 for o in g) for g in groups]
        for k in pass_at_k_ks(n):
            out[f"{prefix}pass@{k}"] = float(np.mean([pass_at_k(len(g), c, k) for g, c in
                                                      zip(groups, correct, strict=True)]))
    return out


@dataclasses.dataclass(frozen=True)
class Suite:
    """One environment of a check: `env.tasks` are exactly the examples played, each
    `rollouts_per_example` times; rollout `i` of example `e` samples with seed
    `first_seed + e * rollouts_per_example + i`."""

    kind: Kind
    name: str
    env: loader.LoadedEnv
    rollouts_per_example: int
    first_seed: int


def _examples(env: loader.LoadedEnv, num_examples: int) -> loader.LoadedEnv:
    """`env` restricted to the first `num_examples` (-1 = all) of its eval split, else of its train split."""
    tasks = env.eval_tasks or env.tasks
    return dataclasses.replace(env, tasks=tasks if num_examples == -1 else tasks[:num_examples])


def _suites(kind: Kind, plan: list[tuple[str, loader.LoadedEnv, int, int]], seed0: int) -> list[Suite]:
    """Suites of `(name, env, num_examples, rollouts_per_example)`, seeds counting up from `seed0`."""
    out = []
    for name, env, num_examples, n in plan:
        played = _examples(env, num_examples)
        out.append(Suite(kind, name, played, n, seed0))
        seed0 += len(played.tasks) * n
    return out


def load_eval_envs(cfg: RunConfig) -> list[loader.LoadedEnv]:
    """The `[[eval.env]]` environments, each loaded with its own `args`; [] without them.

    Raises:
        ConfigError: key `eval.env.<i>.id`, when one cannot be loaded (`jaxrl.envs.loader.load_env`).
    """
    loaded = []
    for i, ec in enumerate(cfg.eval.env if cfg.eval else []):
        try:
            env = loader.load_env(ec.id, ec.args, version=ec.version)
            loaded.append(dataclasses.replace(env, max_retries=ec.max_retries or 0))
        except loader.EnvLoadError as exc:
            raise ConfigError(cfg.source, [(f"eval.env.{i}.id", str(exc))]) from None
    return loaded


class Evaluator:
    """The run's `[eval]` and `[val]` checks (see the module docstring); a no-op when both are absent.

    Built once before the first step; `serving()` must be entered in the run's event loop before `run`
    is called in it.
    """

    def __init__(self, cfg: RunConfig, train_envs: list[loader.LoadedEnv], eval_envs: list[loader.LoadedEnv],
                 client: dict[str, Any], sampling: SamplingParams, console: Console,
                 secrets: list[str] | None = None, in_flight: asyncio.Semaphore | None = None) -> None:
        """`train_envs` / `eval_envs`: the loaded `[[env]]` / `[[eval.env]]` (`load_eval_envs`), in
        config order; `client`: `jaxrl.envs.loader.run_group`'s keyword arguments for the run's server;
        `secrets`: values kept out of the errors printed; `in_flight`: the run's bound on rollouts
        running at once (`jaxrl.rl.rollouts.collect`), shared with training's."""
        self.cfg, self.client, self.sampling, self.console = cfg, client, sampling, console
        self.secrets, self.in_flight = secrets or [], in_flight
        self._own = eval_envs
        seed0 = cfg.sampling_seed * SEED_MULTIPLIER * cfg.rollouts_per_example
        self.suites: list[Suite] = []
        if cfg.eval is not None:
            e = cfg.eval
            if e.env:
                plan = [(ec.display_name, env, e.num_examples if ec.num_examples is None else ec.num_examples,
                         ec.rollouts_per_example or e.rollouts_per_example)
                        for ec, env in zip(e.env, eval_envs, strict=True)]
            else:
                plan = [(tc.display_name, env, e.num_examples, e.rollouts_per_example)
                        for tc, env in zip(cfg.env, train_envs, strict=True)]
            self.suites += _suites("eval", plan, seed0 - SEED_BELOW_TRAINING["eval"])
        if cfg.val is not None:
            v = cfg.val
            plan = [(tc.display_name, env, v.num_examples, v.rollouts_per_example)
                    for tc, env in zip(cfg.env, train_envs, strict=True)]
            self.suites += _suites("val", plan, seed0 - SEED_BELOW_TRAINING["val"])
        for s in self.suites:
            split = "eval split" if s.env.eval_tasks else "tasks (it has no eval split)"
            console.print(f"{s.kind} {s.name}: {len(s.env.tasks)} examples of its {split} x "
                          f"{s.rollouts_per_example} rollouts", highlight=False)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Evaluator]:
        """Holds the serving resources of the `[[eval.env]]` environments (the training ones' are the
        runner's), like `jaxrl.envs.loader.LoadedEnv.serving`."""
        async with contextlib.AsyncExitStack() as stack:
            for env in self._own:
                await stack.enter_async_context(env.serving())
            yield self

    def due(self, kind: Kind, step: int) -> bool:
        """Whether `kind` runs after optimizer step `step` (0: before the first, the base model)."""
        if kind == "eval" and self.cfg.eval is not None:
            return self.cfg.eval.eval_base_model if step == 0 else step % self.cfg.eval.interval == 0
        if kind == "val" and self.cfg.val is not None:
            return step > 0 and step % self.cfg.val.interval == 0
        return False

    def run(self, step: int, loop: asyncio.AbstractEventLoop, stop: StopRequest | None = None) -> dict[str, float]:
        """The metrics of the checks due after step `step` with the engine's current weights; {} when
        none is due. A collective with several processes: every process calls it at every step.
        A signal (`stop`) cancels the check, whose metrics are then left out."""
        out: dict[str, float] = {}
        for kind in ("eval", "val"):
            if self.due(kind, step):
                out |= self._check(kind, step, loop, stop)
        return out

    def _check(self, kind: Kind, step: int, loop: asyncio.AbstractEventLoop,
               stop: StopRequest | None) -> dict[str, float]:
        t0 = time.perf_counter()
        suites = [s for s in self.suites if s.kind == kind]
        jobs = [(si, e) for si, s in enumerate(suites) for e in range(len(s.env.tasks))]
        mine = distributed.share(len(jobs))
        keep = asyncio.all_tasks(loop)
        task = loop.create_task(self._play(suites, jobs[mine.start:mine.stop]))
        if stop is not None:
            stop.on_signal = lambda: loop.call_soon_threadsafe(task.cancel)
        try:
            played = loop.run_until_complete(task)
        except asyncio.CancelledError:
            loop.run_until_complete(rollouts.settle(keep, SETTLE_S))
            played = None
        finally:
            if stop is not None:
                stop.on_signal = None
        shares = distributed.all_gather_objects(played)
        if any(share is None for share in shares):
            return {}
        groups = [[Outcome(**o) for o in g] for share in shares for g in share]
        by_suite: list[list[list[Outcome]]] = [[] for _ in suites]
        for (si, _), group in zip(jobs, groups, strict=True):
            by_suite[si].append(group)
        out: dict[str, float] = {}
        for s, sg in zip(suites, by_suite, strict=True):
            if kind == "eval" or len(suites) > 1:
                out |= check_metrics(sg, f"{kind}/{s.name}/")
        if kind == "val":
            out |= check_metrics([g for sg in by_suite for g in sg], "val/")
        out[f"time/{kind}"] = time.perf_counter() - t0
        self._report(kind, step, suites, by_suite, out)
        return out

    async def _play(self, suites: list[Suite], jobs: list[tuple[int, int]]) -> list[list[dict]]:
        """The outcomes (as dicts) of each `(suite index, example)` job, in order."""
        timeout = self.cfg.jax.rollout_timeout

        async def one(si: int, example: int) -> list[dict]:
            s = suites[si]
            (group,) = await rollouts.collect([s.env], [(0, example)], s.rollouts_per_example, self.client,
                                              self.sampling, s.first_seed + example * s.rollouts_per_example,
                                              timeout, self.in_flight)
            return [dataclasses.asdict(Outcome.of(r)) for r in group]

        return list(await asyncio.gather(*[one(si, e) for si, e in jobs]))

    def _report(self, kind: Kind, step: int, suites: list[Suite], by_suite: list[list[list[Outcome]]],
                metrics: dict[str, float]) -> None:
        parts = []
        for s, sg in zip(suites, by_suite, strict=True):
            flat = [o for g in sg for o in g]
            ok = [o.reward for o in flat if o.ok]
            mean = f"{np.mean(ok):.3f}" if ok else "n/a"
            failed = f", {len(flat) - len(ok)} failed" if len(ok) < len(flat) else ""
            parts.append(f"{s.name} reward {mean} ({len(sg)} x {s.rollouts_per_example}{failed})")
        when = "base model" if step == 0 else f"step {step}"
        self.console.print(f"{kind} {when}: " + "; ".join(parts) + f" in {metrics[f'time/{kind}']:.1f}s",
                           highlight=False)
        first = next((o.error for sg in by_suite for g in sg for o in g if not o.ok and o.error), None)
        if first is not None:
            line = escape(redact(first.strip().splitlines()[0][:300] if first.strip() else first, self.secrets))
            self.console.print(f"[yellow]{kind}: first error: {line}[/]", highlight=False)
