"""A GEPA run (Agrawal et al. 2025, "GEPA: Reflective Prompt Evolution Can Outperform Reinforcement
Learning"): `gepa.optimize` over verifiers' own adapters, rollouts on an `Endpoint`, reflection through a
`Reflector`.

- Classic environments: `verifiers.legacy.gepa.VerifiersGEPAAdapter` (the candidate system prompt injected
  into each row's prompt; `Environment.generate` on verifiers' chat client). Train examples are the first
  `num_train` rows of the train dataset, validation the first `num_val` of the eval dataset (vf-gepa's
  splits; the train rows after the train examples when the environment has no eval dataset).
- v1 environments: `verifiers.v1.gepa.GEPAAdapter` (`Task.with_system_prompt`; `Env.run_slot` on one event
  loop that holds `env.serving()`, as verifiers' own GEPA runner does). Examples are taken the same way;
  validation tasks are renumbered after the train ones (the adapter keys tasks by `data.idx`).
- Every rollout samples with the run's seed, so a candidate's score on an example moves only with the prompt.
- The seed candidate is the environment's system prompt (classic: `Environment.system_prompt`; v1: the
  first train task's), or "" when it has none (the reflection then writes one).

Outputs in the run folder, as verifiers' `save_gepa_results` writes them: `system_prompt.txt`,
`results.jsonl` (one row per candidate), `pareto_frontier.jsonl` (the best candidates of each validation
example), `metadata.json`; jaxrl adds `best_prompt.txt` (the seeds' name), the seed's and the best
candidate's validation scores, the proposal counts and the rollouts run and failed in `metadata.json`,
`gepa_config.json` (the run's settings) and `gepa.log` (gepa's and the reflector's lines). gepa's own
`gepa_state.bin` there makes a rerun with the same folder resume the search; one with other settings (a
larger `max_calls` excepted) is refused, naming each setting that differs.

A search whose first batch of rollouts all failed stops there (`RolloutsFailed`) rather than spending its
budget scoring every prompt 0 on failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gepa.api import optimize
from gepa.core.result import GEPAResult
from verifiers.v1.gepa.adapter import GEPAAdapter

from jaxrl.config.gepa import GepaConfig
from jaxrl.envs import loader
from jaxrl.envs.classic import ClassicEnv
from jaxrl.evaluation import play
from jaxrl.evaluation.endpoint import Endpoint
from jaxrl.evaluation.reflection import Reflector

CONFIG_FILE = "gepa_config.json"
STATE_FILE = "gepa_state.bin"
"""gepa's own saved search state (`gepa.optimize(run_dir=...)` writes it)."""
BEST_PROMPT = "best_prompt.txt"
LOG_FILE = "gepa.log"
OUTPUTS = ("system_prompt.txt", BEST_PROMPT, "results.jsonl", "pareto_frontier.jsonl", "metadata.json")
"""The files every finished run writes."""


class GepaRunError(ValueError):
    """A GEPA run that cannot start: too few examples, or a run folder holding another run's state."""


class RolloutsFailed(RuntimeError):
    """Every rollout of the run's first batch failed (an endpoint that answers but serves nothing, an
    environment that cannot run): the search stops before it scores a candidate on failures."""


@dataclasses.dataclass
class RolloutTally:
    """The rollouts this process ran (`ran`), how many failed, and the first failure's error (its first
    line, at most 300 characters)."""

    ran: int = 0
    failed: int = 0
    first_error: str | None = None

    def line(self) -> str:
        """"F of N rollouts failed (P%)", as `jaxrl eval run` says it."""
        return f"{self.failed} of {self.ran} rollouts failed ({self.failed / max(self.ran, 1):.0%})"


def rollout_error(output: Any) -> str | None:
    """Why one adapter output (a classic output dict, or a v1 `Episode`) failed, or None if it did not
    (`jaxrl.evaluation.play`'s rules, as `jaxrl eval run` counts failures)."""
    if isinstance(output, dict):
        return play.error_text(output["error"]) if output.get("error") else None
    return play.episode_row(output, 0, 0).error


def counted(evaluate: Callable[..., Any], tally: RolloutTally) -> Callable[..., Any]:
    """The adapter's `evaluate`, counting its rollouts and failures in `tally`.

    Raises:
        RolloutsFailed: after a batch, when no rollout of this process has succeeded yet (the first batch
            all failed: gepa would go on to score every candidate 0 and spend its whole budget so).
    """
    def evaluate_counted(batch: list, candidate: dict[str, str], capture_traces: bool = False) -> Any:
        result = evaluate(batch, candidate, capture_traces)
        errors = [e for e in map(rollout_error, result.outputs) if e is not None]
        tally.ran += len(result.outputs)
        tally.failed += len(errors)
        if errors and tally.first_error is None:
            tally.first_error = play.first_line(errors[0])
        if tally.ran and tally.failed == tally.ran:
            raise RolloutsFailed(f"every rollout of the first batch failed ({tally.line()}); first error: "
                                 f"{tally.first_error}; the search stopped before scoring any prompt")
        return result

    return evaluate_counted


@dataclasses.dataclass
class Plan:
    """What gepa is given: the adapter (its `propose_new_texts` unset), the train and validation batch
    items, the seed prompt, and the event loop the adapter drives (closed by `plan`'s context); `tally`
    counts the rollouts `run` makes."""

    adapter: Any
    trainset: list
    valset: list
    seed_prompt: str
    loop: asyncio.AbstractEventLoop
    tally: RolloutTally = dataclasses.field(default_factory=RolloutTally)


def _split(env: loader.LoadedEnv, num_train: int, num_val: int) -> tuple[list, list]:
    train = env.tasks[:num_train]
    val = env.eval_tasks[:num_val] if env.eval_tasks else env.tasks[num_train:num_train + num_val]
    if len(train) < num_train or len(val) < num_val:
        where = "eval split" if env.eval_tasks else "train split, after the train examples"
        raise GepaRunError(f"{env.id}: {num_train} train and {num_val} validation examples were asked for; it has "
                           f"{len(env.tasks)} train examples and {len(val)} validation examples ({where}); lower "
                           "--num-train / --num-val or pass env args for more")
    return list(train), list(val)


async def _rebind_renderers_lock() -> None:
    loader.rebind_renderers_lock()  # renderers' module lock must not stay bound to an earlier event loop


@contextlib.contextmanager
def plan(cfg: GepaConfig, env: loader.LoadedEnv, endpoint: Endpoint) -> Iterator[Plan]:
    """The adapter and data for `env` on `endpoint` (module docstring), with its event loop (and, for a v1
    environment, `env.serving()`) held for the block.

    Raises:
        GepaRunError: too few examples, or a verifiers without `verifiers.legacy.gepa` (0.4 and later),
            whose `save_gepa_results` writes the outputs.
    """
    try:
        import verifiers.legacy.gepa.gepa_utils  # noqa: F401 - the outputs' writer, checked before the search
    except ImportError:
        import verifiers

        raise GepaRunError(f"jaxrl gepa run writes verifiers 0.3's outputs (verifiers.legacy.gepa), which verifiers "
                           f"{verifiers.__version__} lacks: pip install 'verifiers==0.3.1'") from None
    train, val = _split(env, cfg.gepa.num_train, cfg.gepa.num_val)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # verifiers' classic adapter drives `asyncio.get_event_loop()`
    loop.run_until_complete(_rebind_renderers_lock())
    try:
        if isinstance(env.env, ClassicEnv):
            yield _classic_plan(cfg, env.env, endpoint, train, val, loop)
            return
        serving = env.env.serving()
        loop.run_until_complete(serving.__aenter__())
        try:
            yield _v1_plan(cfg, env, endpoint, train, val, loop)
        finally:
            loop.run_until_complete(serving.__aexit__(None, None, None))
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _classic_plan(cfg: GepaConfig, env: ClassicEnv, endpoint: Endpoint, train: list, val: list,
                  loop: asyncio.AbstractEventLoop) -> Plan:
    from verifiers.legacy.gepa.adapter import VerifiersGEPAAdapter

    environment = env.environment
    sampling = {**(environment.sampling_args or {}), **play.chat_sampling_args(cfg.sampling, cfg.gepa.seed)}
    adapter = VerifiersGEPAAdapter(env=environment, client=play.chat_client(endpoint), model=endpoint.model,
                                   sampling_args=sampling, max_concurrent=cfg.gepa.max_concurrent,
                                   state_columns=list(cfg.gepa.state_columns))
    return Plan(adapter, [t.input for t in train], [t.input for t in val], environment.system_prompt or "", loop)


def _v1_plan(cfg: GepaConfig, env: loader.LoadedEnv, endpoint: Endpoint, train: list, val: list,
             loop: asyncio.AbstractEventLoop) -> Plan:
    renumbered = []
    for i, task in enumerate(val):
        clone = copy.copy(task)
        clone.data = task.data.model_copy(update={"idx": len(train) + i})
        renumbered.append(clone)
    tasks = {t.data.idx: t for t in [*train, *renumbered]}
    ctx = play.model_context(endpoint, cfg.sampling.model_copy(update={"seed": cfg.sampling.seed or cfg.gepa.seed}),
                             0, cfg.jax.seq_len)
    adapter = GEPAAdapter(env=env.env, ctx=ctx, tasks=tasks, loop=loop,
                          semaphore=asyncio.Semaphore(cfg.gepa.max_concurrent),
                          reflection_columns=list(cfg.gepa.state_columns))
    seed_prompt = next((t.data.system_prompt for t in train if t.data.system_prompt is not None), "")
    return Plan(adapter, [t.data.idx for t in train], [t.data.idx for t in renumbered], seed_prompt, loop)


def check_resume(run_dir: Path, settings: dict[str, Any]) -> bool:
    """True when `run_dir` holds an earlier search's state (gepa's `gepa_state.bin`) to resume. Raises
    GepaRunError, naming each setting that differs, when that search was started with other settings than
    `settings` (`gepa.max_calls` may differ: a larger budget goes on). Writes nothing (`record_settings`
    does, once the search starts), so a run that stopped before searching (an endpoint down, say) leaves
    nothing that refuses a corrected rerun."""
    path = run_dir / CONFIG_FILE
    resuming = (run_dir / STATE_FILE).is_file()
    if resuming and path.is_file():
        before = json.loads(path.read_text(encoding="utf-8"))
        changed = [f"{key} {old!r} -> {new!r}" for key, old, new in differences(before, settings)
                   if key != "gepa.max_calls"]
        if changed:
            raise GepaRunError(f"{run_dir} holds a GEPA run started with other settings ({'; '.join(changed)}); "
                               "use another -o folder, or delete it to start over")
    return resuming


def record_settings(run_dir: Path, cfg: GepaConfig) -> None:
    """`run_dir/gepa_config.json`: the settings a resumed search must keep (`check_resume`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = cfg.model_dump(mode="json", exclude={"run_dir"})
    (run_dir / CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def differences(before: Any, after: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value before, value after) for each leaf that differs between two JSON objects (a key
    only one side has is None on the other), sorted by key."""
    if not (isinstance(before, dict) and isinstance(after, dict)):
        return [] if before == after else [(prefix, before, after)]
    out = []
    for key in sorted(set(before) | set(after)):
        out += differences(before.get(key), after.get(key), f"{prefix}.{key}" if prefix else str(key))
    return out


class FileLog:
    """gepa's `LoggerProtocol` (`log(str)`) appending to `gepa.log` (its folder created), with an optional echo."""

    def __init__(self, path: Path, echo: Callable[[str], None] | None = None) -> None:
        self.path, self.echo = path, echo
        path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, message: str) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(message.rstrip("\n") + "\n")
        if self.echo is not None:
            self.echo(message)


def run(cfg: GepaConfig, p: Plan, reflector: Reflector, run_dir: Path, log: FileLog,
        watch: Callable[[Any], None]) -> GEPAResult:
    """`gepa.optimize` over `p` with `reflector` as the adapter's proposer and stopper; `watch(state)` sees
    gepa's state before each iteration (the progress bar). Writes the outputs (module docstring).

    Raises:
        ReflectionFailed: `reflector` stopped the search before its budget was spent (the outputs are
            written first).
        RolloutsFailed: every rollout of the first batch failed (`counted`; nothing is written).
    """
    p.adapter.propose_new_texts = reflector.propose
    p.adapter.evaluate = counted(p.adapter.evaluate, p.tally)
    record_settings(run_dir, cfg)

    def stopper(state: Any) -> bool:
        watch(state)
        return reflector.should_stop(state)

    kwargs: dict[str, Any] = {}
    if cfg.gepa.perfect_score is not None:
        kwargs["perfect_score"] = cfg.gepa.perfect_score
    result = optimize(seed_candidate={"system_prompt": p.seed_prompt}, trainset=p.trainset, valset=p.valset,
                      adapter=p.adapter, max_metric_calls=cfg.gepa.max_calls,
                      reflection_minibatch_size=cfg.gepa.minibatch_size, run_dir=str(run_dir), seed=cfg.gepa.seed,
                      display_progress_bar=False, skip_perfect_score=cfg.gepa.perfect_score is not None,
                      logger=log, stop_callbacks=[stopper], track_best_outputs=False, **kwargs)
    budget_left = (result.total_metric_calls or 0) < cfg.gepa.max_calls
    save(run_dir, result, cfg, reflector, p.tally, budget_left)
    reflector.raise_if_exhausted(budget_left)
    return result


def save(run_dir: Path, result: GEPAResult, cfg: GepaConfig, reflector: Reflector, tally: RolloutTally,
         budget_left: bool) -> None:
    """verifiers' outputs (`save_gepa_results`), `best_prompt.txt`, and jaxrl's additions to `metadata.json`
    (`rollouts_run` and `rollouts_failed` count this process's rollouts: a resumed run's earlier ones are in
    gepa's `total_metric_calls`)."""
    from verifiers.legacy.gepa.gepa_utils import save_gepa_results

    env = cfg.env[0]
    save_gepa_results(run_dir, result, config={
        "env_id": env.env_id, "env_args": env.env_args, "model": cfg.model,
        "reflection_model": cfg.reflection_model or cfg.model, "num_train": cfg.gepa.num_train,
        "num_val": cfg.gepa.num_val, "max_metric_calls": cfg.gepa.max_calls, "minibatch_size": cfg.gepa.minibatch_size,
        "perfect_score": cfg.gepa.perfect_score, "state_columns": cfg.gepa.state_columns, "seed": cfg.gepa.seed})
    best = result.best_candidate.get("system_prompt", "") if isinstance(result.best_candidate, dict) else ""
    (run_dir / BEST_PROMPT).write_text(best, encoding="utf-8")
    meta_path = run_dir / "metadata.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    scores = list(result.val_aggregate_scores)
    meta |= {"seed_val_score": scores[0] if scores else None, "best_val_score": scores[result.best_idx] if scores
             else None, "best_prompt_path": BEST_PROMPT, "proposals_accepted_by_reflector": reflector.accepted,
             "failed_proposals": reflector.failures, "rollouts_run": tally.ran, "rollouts_failed": tally.failed,
             "stopped_by_failed_proposals": reflector.should_stop() and budget_left}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
