"""An eval's summary and its saved files: `results.jsonl` (one row per rollout) and `metadata.json`.

The summary is the seeds' check before training ("confirm reward diversity exists at baseline"; their
best-practices snippet groups `results.jsonl` rows by `example_id` and prints `np.std` of each example's
rewards): the mean reward over rollouts, each example's reward std (population std, numpy's default, as
the snippet computes it), and the share of examples whose rollouts all scored the same (std 0: a group
that teaches RL nothing, `[buffer] online_difficulty_filtering` would drop it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.evaluation.play import Row

RESULTS = "results.jsonl"
METADATA = "metadata.json"


@dataclasses.dataclass(frozen=True)
class Summary:
    """reward_mean: over every rollout (a failed one scores 0.0); reward_std: over every rollout;
    example_std: each example's reward std, by example id; no_diversity: the share of examples whose std
    is 0 (all their rollouts scored alike); failed: rollouts that failed, of `rollouts` in all."""

    reward_mean: float
    reward_std: float
    example_std: dict[int, float]
    no_diversity: float
    failed: int
    num_examples: int
    rollouts_per_example: int
    rollouts: int

    @property
    def all_failed(self) -> bool:
        """Whether every rollout failed (the eval measured nothing)."""
        return self.failed == self.rollouts

    def failed_line(self) -> str:
        """"F of N rollouts failed (P%)"."""
        return f"{self.failed} of {self.rollouts} rollouts failed ({self.failed / self.rollouts:.0%})"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (example ids as strings)."""
        out = dataclasses.asdict(self)
        out["example_std"] = {str(k): v for k, v in self.example_std.items()}
        return out


def summarise(rows: Sequence[dict[str, Any]] | Sequence[Row]) -> Summary:
    """The summary of rows (`Row`s or `results.jsonl`'s dicts). Raises ValueError without rows."""
    dicts = [dataclasses.asdict(r) if isinstance(r, Row) else r for r in rows]
    if not dicts:
        raise ValueError("no rollouts to summarise")
    by_example: dict[int, list[float]] = {}
    for r in dicts:
        by_example.setdefault(r["example_id"], []).append(float(r["reward"]))
    rewards = np.array([float(r["reward"]) for r in dicts])
    example_std = {ex: float(np.std(rs)) for ex, rs in by_example.items()}
    return Summary(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()), example_std=example_std,
                   no_diversity=float(np.mean([s == 0.0 for s in example_std.values()])),
                   failed=sum(r["error"] is not None for r in dicts), num_examples=len(by_example),
                   rollouts_per_example=max(len(rs) for rs in by_example.values()), rollouts=len(dicts))


def lines(summary: Summary) -> list[str]:
    """The summary as the console prints it."""
    stds = np.array(list(summary.example_std.values()))
    flat = round(summary.no_diversity * summary.num_examples)
    out = [f"reward mean {summary.reward_mean:.4f} (std {summary.reward_std:.4f}) over {summary.num_examples} "
           f"examples x {summary.rollouts_per_example} rollouts" + (f"; {summary.failed_line()}" if summary.failed
                                                                    else ""),
           f"per-example reward std: mean {stds.mean():.4f}, min {stds.min():.4f}, max {stds.max():.4f}",
           f"no reward diversity (all rollouts of the example scored alike): {flat}/{summary.num_examples} examples "
           f"({summary.no_diversity:.0%})"]
    if summary.rollouts_per_example < 2:
        out.append("one rollout per example: reward diversity needs -r 2 or more")
    return out


def save(folder: Path, rows: Sequence[Row], summary: Summary, metadata: dict[str, Any]) -> None:
    """`results.jsonl` (one `Row` per line, in example then rollout order) and `metadata.json` (`metadata`
    with the summary under "summary") in `folder`, created if needed."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / RESULTS).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(dataclasses.asdict(row), ensure_ascii=False) + "\n")
    (folder / METADATA).write_text(json.dumps({**metadata, "summary": summary.as_dict()}, indent=2) + "\n",
                                   encoding="utf-8")
