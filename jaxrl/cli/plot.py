"""`jaxrl plot`: what the Hosted Training docs tell users to watch in a run, as one PNG of stacked
panels (matplotlib, Agg backend: no display needed).

Panels, from the rows of `metrics.jsonl` (one per step; a step-0 row is the base model's eval), each
drawn only when the run has its metrics:
- reward: `reward/mean` per step with a +-`reward/std` band, and `reward/<env>/mean` with several
  environments; in an SFT run (`jaxrl sft`: rows with `sft/epoch`), its `loss` instead;
- entropy: `policy/entropy` (a collapse towards 0 comes before reward collapse);
- KL: `policy/kl` (trainer against the engine that sampled) and `policy/ref_kl` (against the reference
  policy, with `[jax.loss] kl_coef > 0`);
- teacher KL: `teacher/kl` (the student against the teacher on its sampled tokens, with `[jax.loss]
  teacher_tau > 0`: on-policy distillation);
- learning rate: `optim/lr` (`[jax.optim]` schedule);
- eval / val: every `eval/.../reward/mean`, `eval/.../pass@k`, `val/.../reward/mean` and
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


TRAINING_PANELS = (("entropy", ("policy/entropy",)), ("KL", ("policy/kl", "policy/ref_kl")),
                   ("teacher KL", ("teacher/kl",)), ("learning rate", ("optim/lr",)))
"""The panels between reward and eval: (y label, the metrics drawn in it)."""


def panels(rows: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The panels of the module docstring that `rows` have data for, in order: (y label, series keys);
    the reward panel's keys are its mean curves."""
    present = {k for r in rows for k in r}
    out = []
    if series(rows, "reward/mean")[0]:
        out.append(("reward", ["reward/mean", *sorted(k for k in present if _ENV_REWARD.match(k))]))
    elif series(rows, "sft/epoch")[0]:  # an SFT run: its loss is what to watch
        out.append(("SFT loss", ["loss"]))
    for label, keys in TRAINING_PANELS:
        if drawn := [k for k in keys if series(rows, k)[0]]:
            out.append((label, drawn))
    if evals := eval_keys(rows):
        out.append(("eval / val", evals))
    return out


def plot_run(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    """Write the PNG of the module docstring for metrics `rows` to `out` (8 x 3.5 inches per panel at
    100 dpi); return `out`.

    Raises:
        ValueError: no row has a `reward/mean`, an SFT loss or an eval series to plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps, mean = series(rows, "reward/mean")
    shown = panels(rows)
    if not steps and not eval_keys(rows) and not series(rows, "sft/epoch")[0]:
        raise ValueError("no reward/mean or eval/val metrics to plot yet")
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 3.5 * len(shown)), squeeze=False, sharex=True)
    marker = "o" if len(steps) <= 30 else None  # a short run's points stay visible
    for (label, keys), ax in zip(shown, axes[:, 0], strict=True):
        if label == "reward":
            _reward_panel(ax, rows, keys, marker)
        else:
            for key in keys:
                ax.plot(*series(rows, key), label=key, marker="o" if label == "eval / val" else marker,
                        markersize=3)
        ax.set_ylabel(label)
        ax.legend(loc="best", fontsize="small")
        ax.grid(alpha=0.3)
    axes[0][0].set_title(title)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out


def _reward_panel(ax: Any, rows: list[dict[str, Any]], keys: list[str], marker: str | None) -> None:
    """`reward/mean` with its +-`reward/std` band, then each environment's mean."""
    steps, mean = series(rows, "reward/mean")
    ax.plot(steps, mean, label="reward/mean", color="C0", marker=marker, markersize=3)
    std_steps, std = series(rows, "reward/std")
    if std_steps == steps:
        ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                        [m + s for m, s in zip(mean, std, strict=True)], color="C0", alpha=0.15,
                        label="+-reward/std")
    for i, key in enumerate(keys[1:]):
        ax.plot(*series(rows, key), label=key, linewidth=1, marker=marker, markersize=2, color=f"C{i + 1}")
