"""One step's rollouts: every rollout under its own timeout, failures dropped and counted, group
advantages over the survivors, the step's rollout metrics, and the rule that stops a run whose
environments mostly fail.

A rollout fails when its environment, harness or reward raises, when it produces no sampled token,
when its reward is not finite, or when it takes longer than `[jax] rollout_timeout` (an environment
that hangs in `await`; one that blocks the event loop's thread cannot be interrupted from inside
the process). Failed rollouts are left out of the batch and of their group's advantages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.config.algorithms import AdvantageConfig
from jaxrl.config.schema import SamplingConfig
from jaxrl.envs import loader
from jaxrl.inference.protocol import SamplingParams
from jaxrl.rl import losses

FAILURE_WINDOW = 3
"""Steps over which the failed-rollout fraction is taken."""
MAX_FAILED_FRACTION = 0.5
"""A run stops when more than this fraction of the rollouts of the last `FAILURE_WINDOW` steps failed."""


def temperature_at(sampling: SamplingConfig, step: int, max_steps: int) -> float:
    """The sampling temperature of training step `step` (1-based): `[sampling] temperature`, or with
    `[sampling.temp_scheduler]` its schedule over `n = total_steps or max_steps` steps, with
    `p = (step - 1) / (n - 1)` (1 from step n on, and for n = 1): "linear" `start + (end - start) * p`,
    "cosine" `end + (start - end) * (1 + cos(pi * p)) / 2` (a half cosine, as the learning rate's)."""
    s = sampling.temp_scheduler
    if s is None:
        return sampling.temperature
    n = s.total_steps or max_steps
    p = 1.0 if step >= n else max(step - 1, 0) / (n - 1)
    match s.type:
        case "linear":
            return s.start_temperature + (s.end_temperature - s.start_temperature) * p
        case "cosine":
            return s.end_temperature + (s.start_temperature - s.end_temperature) * (1 + math.cos(math.pi * p)) / 2
    raise ValueError(f"unknown temp_scheduler type {s.type!r}")


async def collect(loaded: list[loader.LoadedEnv], jobs: list[tuple[int, int]], rollouts_per_example: int,
                  client: dict[str, Any],
                  sampling: SamplingParams, first_seed: int, timeout_s: float,
                  in_flight: asyncio.Semaphore | None = None) -> list[list[loader.Rollout]]:
    """Play `rollouts_per_example` rollouts of each `(env index, example index)` job, concurrently; one list
    per job.

    Rollout `i` of job `g` samples with seed `first_seed + g * rollouts_per_example + i`, so a run (and its
    resume) samples the same tokens whatever order requests reach the engine in. Never raises for a failing rollout; a
    failed one is played again, with the same seed, up to its env's `max_retries` times (each attempt
    within `timeout_s`), and counts as failed only after the last.
    `in_flight` (shared by every call of a run: `jaxrl.run.resources`, `[infrastructure].compute_size`)
    bounds the rollouts running at once; `timeout_s` counts from when a rollout gets its place.
    """

    async def one(env_i: int, example: int, seed: int) -> list[loader.Rollout]:
        async with in_flight or contextlib.nullcontext():
            out = await play(env_i, example, seed)
            for _ in range(loaded[env_i].max_retries):
                if all(r.ok for r in out):
                    break
                out = await play(env_i, example, seed)
            return out

    async def play(env_i: int, example: int, seed: int) -> list[loader.Rollout]:
        env = loaded[env_i]
        try:
            out = await asyncio.wait_for(
                loader.run_group(env, example, 1, sampling=dataclasses.replace(sampling, seed=seed), **client),
                timeout_s)
        except TimeoutError:
            return [_failed(env, example, f"timed out after {timeout_s:g}s ([jax] rollout_timeout)")]
        except Exception as exc:  # noqa: BLE001 - an environment may fail in any way; the step goes on
            return [_failed(env, example, f"{type(exc).__name__}: {exc}")]
        return [r if r.ok is False or math.isfinite(r.reward) else
                dataclasses.replace(r, ok=False, error=f"non-finite reward {r.reward}", token_ids=[], loss_mask=[],
                                    logprobs=[]) for r in out]

    n = rollouts_per_example
    groups = await asyncio.gather(*[
        asyncio.gather(*[one(env_i, example, first_seed + g * n + i) for i in range(n)])
        for g, (env_i, example) in enumerate(jobs)
    ])
    return [[r for rollout in group for r in rollout] for group in groups]


async def preflight(loaded: list[loader.LoadedEnv], client: dict[str, Any], sampling: SamplingParams,
                    timeout_s: float, in_flight: asyncio.Semaphore | None = None) -> list[str]:
    """One smoke rollout of each environment's first task before step 1 (`[buffer] skip_verification`
    turns it off): an environment that cannot produce a scored rollout is caught before any training,
    and the client side (tokenizer, renderer, HTTP clients) is loaded outside the rollout timeout.

    Returns:
        One line per failing environment, `"<env>: <error>"`; empty when every one passed.
    """
    probe = dataclasses.replace(sampling, seed=0)
    out = await collect(loaded, [(i, 0) for i in range(len(loaded))], 1, client, probe, 0, timeout_s, in_flight)
    return [f"{env.name}: {group[0].error}" for env, group in zip(loaded, out, strict=True) if not group[0].ok]


def _failed(env: loader.LoadedEnv, example: int, error: str) -> loader.Rollout:
    return loader.Rollout([], [], [], 0.0, False, False, error, env.name, example)


def advantages(groups: list[list[loader.Rollout]], cfg: AdvantageConfig) -> np.ndarray:
    """The advantages (float32) of the groups' successful rollouts, in order, by `[jax.advantage]`
    (`jaxrl.rl.losses.advantages`); failed rollouts are dropped from their group."""
    return losses.advantages([np.array([r.reward for r in g if r.ok], np.float32) for g in groups], cfg)


def step_metrics(rollouts: list[list[loader.Rollout]], names: list[str], multi_env: bool) -> dict[str, float]:
    """Reward, length, truncation and failure metrics of one step (`names`: each group's env name).

    Over successful rollouts: `reward/mean`, `reward/std`, `seq_len` (tokens of prompt and completion),
    `is_truncated` (share), `turns` (the model's replies per rollout), `tool_calls` (tool calls per rollout),
    `tool_call_rate` (share of rollouts with one or more); over all: `rollouts/failed`, `rollouts/timed_out`,
    `time/env` (seconds the step's rollouts spent in their environments' own code, `Rollout.env_s`, summed
    over rollouts that ran at the same time, so it may exceed `time/rollout`) and `time/env_per_rollout`
    (its mean per rollout).
    With `multi_env`, each environment `<env>` of the step also gets `reward/<env>/mean`, `reward/<env>/std`,
    `seq_len/<env>`, `is_truncated/<env>`, `turns/<env>`, `tool_calls/<env>`, `tool_call_rate/<env>` and
    `rollouts/<env>/failed`.
    """
    flat = [r for g in rollouts for r in g]
    out = _rollout_metrics(flat, "")
    out["rollouts/timed_out"] = float(sum(1 for r in flat if r.error and r.error.startswith("timed out")))
    out["time/env"] = float(sum(r.env_s for r in flat))
    out["time/env_per_rollout"] = out["time/env"] / len(flat) if flat else 0.0
    if multi_env:
        for name in sorted(set(names)):
            out |= _rollout_metrics([r for g, n in zip(rollouts, names, strict=True) if n == name for r in g],
                                    f"/{name}")
    return out


def _rollout_metrics(flat: list[loader.Rollout], env: str) -> dict[str, float]:
    ok = [r for r in flat if r.ok]
    rewards = np.array([r.reward for r in ok], np.float32)
    return {
        f"reward{env}/mean": float(rewards.mean()) if rewards.size else float("nan"),
        f"reward{env}/std": float(rewards.std()) if rewards.size else 0.0,
        f"seq_len{env}": float(np.mean([len(r.token_ids) for r in ok])) if ok else 0.0,
        f"is_truncated{env}": float(np.mean([r.is_truncated for r in ok])) if ok else 0.0,
        f"turns{env}": float(np.mean([r.turns for r in ok])) if ok else 0.0,
        f"tool_calls{env}": float(np.mean([r.tool_calls for r in ok])) if ok else 0.0,
        f"tool_call_rate{env}": float(np.mean([r.tool_calls > 0 for r in ok])) if ok else 0.0,
        f"rollouts{env}/failed": float(len(flat) - len(ok)),
    }


def failure_verdict(history: Sequence[tuple[int, int]]) -> str | None:
    """Why the run must stop, or None. `history` holds `(failed, total)` rollouts per step, oldest
    first. Stops when the last step had no successful rollout, or when more than
    `MAX_FAILED_FRACTION` of the rollouts of the last `FAILURE_WINDOW` steps failed."""
    if not history:
        return None
    failed, total = history[-1]
    if total and failed == total:
        return f"every rollout of the step failed ({failed}/{total})"
    window = history[-FAILURE_WINDOW:]
    failed, total = sum(f for f, _ in window), sum(t for _, t in window)
    if len(window) == FAILURE_WINDOW and total and failed / total > MAX_FAILED_FRACTION:
        return (f"{failed} of the last {total} rollouts ({len(window)} steps) failed, more than "
                f"{MAX_FAILED_FRACTION:.0%}")
    return None


def first_errors(rollouts: list[list[loader.Rollout]], limit: int = 3) -> list[str]:
    """The distinct error messages of a step's failed rollouts, at most `limit`, in order."""
    seen: list[str] = []
    for r in (r for g in rollouts for r in g if not r.ok and r.error):
        line = r.error.strip().splitlines()[0][:300] if r.error.strip() else r.error
        if line not in seen:
            seen.append(line)
    return seen[:limit]


async def settle(keep: set[asyncio.Task], timeout_s: float) -> None:
    """Wait (at most `timeout_s` seconds) for every task of the running loop but `keep` and this one to
    finish: cancelled rollouts abort in shielded tasks of their own (verifiers), which the next step, or
    closing the loop, must not find half-done."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while rest := asyncio.all_tasks() - keep - {asyncio.current_task()}:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return
        await asyncio.wait(rest, timeout=left)
