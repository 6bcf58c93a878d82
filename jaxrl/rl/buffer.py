"""The example buffer (`[buffer]`): which examples a step's groups play, and which groups it trains on.

Sampling. Each environment's examples are visited in a seeded order, a fresh permutation per epoch
(`numpy.random.default_rng([seed, env, epoch])`). Group number t (counted over the run) goes to the
environment furthest behind its share of `env_ratios`: argmax_i w_i * (t_E + 1) - n_i over the
environments E that can still be sampled, with w normalised over E, n_i the groups environment i got
so far and t_E their sum (ties: the lowest index). Each environment's count stays within one group of
its share, and equal weights (the default; Hosted Training documents `[0.5, 0.5]`) are plain round
robin. Everything is a function of the seed and the state, so a resumed run draws what the
uninterrupted run drew.

Difficulty, only with `online_difficulty_filtering = true` (the flag turns on difficulty-based
sampling in Hosted Training; with it off, the defaults 0.8 / 0.2 / 0.0 would otherwise retire examples).
Semantics of prime-rl's `orchestrator/buffer.py` (PrimeIntellect-ai/prime-rl): after each group, the
mean reward of its successful rollouts is recorded for its example; an example whose latest mean is
>= `easy_threshold` is easy, else <= `hard_threshold` hard. Of each environment's easy examples, the
share `easy_fraction` stays in sampling: the first `floor(easy_fraction * easy)` of them in a seeded
priority order; the others are retired (no longer drawn; their last mean is kept). Likewise for hard.
A kept example that is played again is classified again by its new mean.

Online filtering (same flag): a group whose successful rollouts all got the same reward (mean exactly
0 or 1 for binary rewards) has all-zero group advantages, so no policy-gradient signal; it is left out
of the training batch and counted in `buffer/filtered_groups`, unless a teacher gives every sampled token
a signal of its own (`dense_signal`: `[jax.loss] teacher_tau > 0`), when every group trains whatever its
rewards (difficulty still decides what is sampled). When every group of a step is left
out, the step takes no optimizer step (the runner logs `optim/skipped` = 1) but still counts as a
step: step numbers, checkpoints and policy versions stay those of batches drawn.

The state (`BufferState`) is a small JSON object saved in each checkpoint's metadata.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.config.envs import BufferConfig


class BufferExhausted(RuntimeError):
    """No environment has an example left to draw: all were retired as easy or hard."""


@dataclasses.dataclass(frozen=True)
class BufferState:
    """Where sampling stands; treat as immutable (methods of `Buffer` return new states).

    drawn: per environment, positions consumed in its stream of permutations (retired examples
        skipped over count too).
    chosen: per environment, groups assigned to it so far.
    mean_reward: per environment, example index -> mean reward of its latest group (difficulty
        filtering only; empty otherwise).
    """

    drawn: tuple[int, ...]
    chosen: tuple[int, ...]
    mean_reward: tuple[dict[int, float], ...]

    @classmethod
    def fresh(cls, n_envs: int) -> BufferState:
        return cls((0,) * n_envs, (0,) * n_envs, tuple({} for _ in range(n_envs)))

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (example indices become string keys); `from_json` inverts it."""
        return {"drawn": list(self.drawn), "chosen": list(self.chosen),
                "mean_reward": [{str(k): v for k, v in sorted(m.items())} for m in self.mean_reward]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BufferState:
        return cls(tuple(int(x) for x in data["drawn"]), tuple(int(x) for x in data["chosen"]),
                   tuple({int(k): float(v) for k, v in m.items()} for m in data["mean_reward"]))

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> BufferState:
        """The buffer state saved in a run's checkpoint metadata; a checkpoint from before `[buffer]`
        sampling has only `examples_drawn`, under round robin, where each environment got one group per
        example drawn."""
        if "buffer" in meta:
            return cls.from_json(meta["buffer"])
        drawn = tuple(int(x) for x in meta["examples_drawn"])
        return cls(drawn, drawn, tuple({} for _ in drawn))


def has_signal(rewards: Sequence[float]) -> bool:
    """True when the rewards differ, so group advantages `r - mean(r)` are not all zero."""
    return len(rewards) > 1 and max(rewards) != min(rewards)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """The sampling rules for environments of `sizes` examples each under `cfg`; see the module
    docstring. Methods are pure: they take a `BufferState` and return a new one.

    `dense_signal`: the loss has a signal on every token besides the reward advantage (a teacher's), so no
    group is left out for equal rewards.

    Raises ValueError when an environment has no examples or `env_ratios` has the wrong length."""

    sizes: tuple[int, ...]
    cfg: BufferConfig
    dense_signal: bool = False

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"every environment needs at least one example, got sizes {list(self.sizes)}")
        ratios = self.cfg.env_ratios
        if ratios is not None and len(self.sizes) > 1 and len(ratios) != len(self.sizes):
            raise ValueError(f"env_ratios has {len(ratios)} entries for {len(self.sizes)} environments")

    @property
    def weights(self) -> tuple[float, ...]:
        """Sampling weight of each environment (`env_ratios`, ignored with one environment)."""
        if self.cfg.env_ratios is None or len(self.sizes) == 1:
            return (1.0,) * len(self.sizes)
        return tuple(float(r) for r in self.cfg.env_ratios)

    def order(self, env: int, epoch: int) -> np.ndarray:
        """int64 [sizes[env]]: the example order of `env` in `epoch`."""
        return np.random.default_rng([self.cfg.seed, env, epoch]).permutation(self.sizes[env])

    def priority(self, env: int) -> np.ndarray:
        """int64 [sizes[env]]: each example's rank in the order easy/hard examples are kept in."""
        return np.argsort(np.random.default_rng([self.cfg.seed, env, 2**31]).permutation(self.sizes[env]))

    def classify(self, mean: float) -> str:
        """Difficulty of a mean reward: "easy", "hard" or "normal" (prime-rl's >= / <= thresholds)."""
        if mean >= self.cfg.easy_threshold:
            return "easy"
        return "hard" if mean <= self.cfg.hard_threshold else "normal"

    def retired(self, state: BufferState, env: int) -> set[int]:
        """Examples of `env` not drawn any more (always empty without difficulty filtering)."""
        if not self.cfg.online_difficulty_filtering:
            return set()
        rank = self.priority(env)
        out: set[int] = set()
        for kind, fraction in (("easy", self.cfg.easy_fraction), ("hard", self.cfg.hard_fraction)):
            pool = sorted((e for e, m in state.mean_reward[env].items() if self.classify(m) == kind),
                          key=lambda e: rank[e])
            out.update(pool[math.floor(fraction * len(pool)):])
        return out

    def draw(self, state: BufferState, n: int) -> tuple[list[tuple[int, int]], BufferState]:
        """The next `n` `(env, example)` jobs and the state after them.

        Raises:
            BufferExhausted: every environment with a positive weight has all its examples retired.
        """
        drawn, chosen = list(state.drawn), list(state.chosen)
        retired = [self.retired(state, i) for i in range(len(self.sizes))]
        live = [i for i, w in enumerate(self.weights) if w > 0 and len(retired[i]) < self.sizes[i]]
        if not live and n:
            easy_hard = sum(len(r) for r in retired)
            raise BufferExhausted(f"every example is retired as easy or hard ({easy_hard} examples); lower "
                                  f"[buffer] hard_threshold, raise easy_threshold or raise easy_fraction / "
                                  f"hard_fraction")
        total_w = sum(self.weights[i] for i in live)
        jobs = []
        for _ in range(n):
            t = sum(chosen[i] for i in live)
            env = max(live, key=lambda i: (self.weights[i] / total_w * (t + 1) - chosen[i], -i))
            chosen[env] += 1
            while True:
                epoch, pos = divmod(drawn[env], self.sizes[env])
                drawn[env] += 1
                example = int(self.order(env, epoch)[pos])
                if example not in retired[env]:
                    break
            jobs.append((env, example))
        return jobs, dataclasses.replace(state, drawn=tuple(drawn), chosen=tuple(chosen))

    def record(self, state: BufferState, jobs: Sequence[tuple[int, int]],
               rewards: Sequence[Sequence[float]]) -> tuple[list[bool], BufferState]:
        """Record each job's successful-rollout rewards. Returns which groups to train on (all of them
        without difficulty filtering or with `dense_signal`; else those with `has_signal`) and the new
        state. A group with no successful rollout records nothing."""
        if not self.cfg.online_difficulty_filtering:
            return [True] * len(jobs), state
        means = [dict(m) for m in state.mean_reward]
        for (env, example), r in zip(jobs, rewards, strict=True):
            if len(r):
                means[env][example] = float(np.mean(np.asarray(r, np.float64)))
        keep = [self.dense_signal or has_signal(r) for r in rewards]
        return keep, dataclasses.replace(state, mean_reward=tuple(means))

    def metrics(self, state: BufferState, keep: Sequence[bool]) -> dict[str, float]:
        """`buffer/filtered_groups` (groups of the step left out), `buffer/easy` and `buffer/hard`
        (examples whose latest mean is easy / hard), `buffer/retired` (examples no longer drawn).
        Empty without difficulty filtering."""
        if not self.cfg.online_difficulty_filtering:
            return {}
        kinds = [self.classify(m) for env_means in state.mean_reward for m in env_means.values()]
        return {"buffer/filtered_groups": float(sum(not k for k in keep)),
                "buffer/easy": float(kinds.count("easy")), "buffer/hard": float(kinds.count("hard")),
                "buffer/retired": float(sum(len(self.retired(state, i)) for i in range(len(self.sizes))))}
