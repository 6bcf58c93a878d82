"""`jaxrl plot`: a run's reward curve and, when its metrics have them, its eval and validation curves, as
one PNG (matplotlib, Agg backend: no display needed).

Panels, from the rows of `metrics.jsonl` (one per step; a step-0 row is the base model's eval):
- reward: `reward/mean` per step with a +-`reward/std` band, and `reward/<env>/mean` with several
  environments;
- eval (only when present): every `eval/.../reward/mean`, `eval/.../pass@k`, `val/.../reward/mean` and
  `val/.../pass@k` series, at the steps it was measured.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

_ENV_REWARD = re.compile(r"^reward/(.+)/mean$")
_EVAL = re.compile(r"^(eval|val)/(.+/)?(reward/mean|pass@\d+)$")


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """`(steps, values)` of the rows where `key` is a finite number."""
    points = [(r["step"], float(r[key])) for r in rows if isinstance(r.get("step"), int)
              and isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def eval_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The eval and validation series in `rows` (see the module docstring), sorted."""
    return sorted({k for r in rows for k in r if _EVAL.match(k)})


def plot_run(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    """Write the PNG of the module docstring for metrics `rows` to `out`; return `out`.

    Raises:
        ValueError: no row has a `reward/mean` or an eval series to plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps, mean = series(rows, "reward/mean")
    evals = eval_keys(rows)
    if not steps and not evals:
        raise ValueError("no reward/mean or eval/val metrics to plot yet")
    panels = 1 + bool(evals)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.5 * panels), squeeze=False, sharex=True)
    ax = axes[0][0]
    marker = "o" if len(steps) <= 30 else None  # a short run's points stay visible
    if steps:
        ax.plot(steps, mean, label="reward/mean", color="C0", marker=marker, markersize=3)
        std_steps, std = series(rows, "reward/std")
        if std_steps == steps:
            ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                            [m + s for m, s in zip(mean, std, strict=True)], color="C0", alpha=0.15,
                            label="+-reward/std")
    for i, key in enumerate(sorted({k for r in rows for k in r if _ENV_REWARD.match(k)})):
        ax.plot(*series(rows, key), label=key, linewidth=1, marker=marker, markersize=2, color=f"C{i + 1}")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)
    if evals:
        ax = axes[1][0]
        for key in evals:
            ax.plot(*series(rows, key), marker="o", label=key)
        ax.set_ylabel("eval / val")
        ax.legend(loc="best", fontsize="small")
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out
