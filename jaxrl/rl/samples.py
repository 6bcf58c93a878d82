"""Rollouts into training samples, by `trajectory_strategy`: the whole trace as one sample
("interleaved") or one sample per turn ("branching"), each with the index of its rollout (whose
advantage and sampling temperature it trains with).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from jaxrl.envs.loader import Rollout

Sample = tuple[list[int], list[bool], list[float]]
"""One training sample: (token_ids, loss_mask, logprobs), all of one length."""


def turn_samples(token_ids: list[int], loss_mask: list[bool], logprobs: list[float]) -> list[Sample]:
    """One sample per turn of a trace's sample: for each maximal run of sampled tokens, the tokens up to
    the run's end with only that run masked in (earlier turns' tokens masked out, their logprobs 0.0).

    A run is one turn: in a branch, each model call's sampled tokens end its assistant node, and every
    later node opens with template tokens (`<|im_end|>`, `<|im_start|>`) that are not sampled. So turn
    k's sample is, token for token, the prompt turn k was generated from plus its completion.
    Returns [] for a sample with no sampled token. Raises ValueError on lists of different lengths.
    """
    if not len(token_ids) == len(loss_mask) == len(logprobs):
        raise ValueError(f"token_ids, loss_mask and logprobs differ in length: "
                         f"{len(token_ids)}, {len(loss_mask)}, {len(logprobs)}")
    out: list[Sample] = []
    start = None
    for i, sampled in enumerate([*loss_mask, False]):
        if sampled and start is None:
            start = i
        elif not sampled and start is not None:
            n = i - start
            out.append((token_ids[:i], [False] * start + [True] * n, [0.0] * start + logprobs[start:i]))
            start = None
    return out


def training_samples(
    rollouts: Sequence[Rollout], strategy: Literal["interleaved", "branching"]
) -> tuple[list[Sample], np.ndarray]:
    """The training samples of successful rollouts and the index into `rollouts` of each one's rollout
    (int [samples]: `advantages[index]` gives each sample its rollout's advantage).

    interleaved: one sample per rollout, every turn's sampled span masked in.
    branching: one sample per turn (`turn_samples`). Raises ValueError on an unknown strategy.
    """
    match strategy:
        case "interleaved":
            return [(r.token_ids, r.loss_mask, r.logprobs) for r in rollouts], np.arange(len(rollouts))
        case "branching":
            per_rollout = [turn_samples(r.token_ids, r.loss_mask, r.logprobs) for r in rollouts]
            counts = [len(s) for s in per_rollout]
            return [s for samples in per_rollout for s in samples], np.repeat(np.arange(len(rollouts)), counts)
    raise ValueError(f"unknown trajectory_strategy {strategy!r}; expected 'interleaved' or 'branching'")
