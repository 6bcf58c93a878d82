"""Per-step metrics: a console progress bar with the headline figures, JSON lines in the run folder, and
optionally a W&B run (`jaxrl.run.wandb_log`); trimming the JSON lines back to the step a run resumes from."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxrl.run.layout import METRICS
from jaxrl.run.wandb_log import WandbRun

HEADLINE = ("reward/mean", "reward/std", "seq_len", "tokens_per_s", "time/step")


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"


class MetricsLogger:
    """Writes one JSON object per step to `<run_dir>/metrics.jsonl` and, on a terminal, shows a progress bar
    whose text carries `HEADLINE`; each step's headline is also printed as a line (`step <n>  ...`, once),
    so logs keep the history. Every row also goes to `wandb` when given."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, console: Console | None = None,
                 wandb: WandbRun | None = None) -> None:
        self.path = run_dir / METRICS
        self.headline = HEADLINE  # the metrics of each printed step line (an SFT run has its own)
        self.console = console or Console()
        self.wandb = wandb
        self._file = self.path.open("a", encoding="utf-8")
        self._progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                  TimeElapsedColumn(), TextColumn("{task.description}"), console=self.console,
                                  transient=True)
        self._task = self._progress.add_task("", total=total_steps, completed=start_step)
        if self.console.is_terminal:  # transient: gone at the end, where the step lines printed remain
            self._progress.start()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record `metrics` (floats) of optimizer step `step` (1-based)."""
        clean = {k: (float(v) if isinstance(v, int | float) and math.isfinite(float(v)) else
                     (None if isinstance(v, float) else v)) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        if self.wandb:
            self.wandb.log(step, {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)})
        line = "  ".join(f"{k} {_fmt(metrics[k])}" for k in self.headline if isinstance(metrics.get(k), int | float))
        self._progress.update(self._task, completed=step, description=line)
        if line:  # a row of eval metrics only (step 0: the base model) has its own printed report
            self._progress.console.print(f"step {step:>4}  {line}")

    def close(self) -> None:
        """Stop the progress bar and close the files; the W&B run is marked failed when this is called
        while an exception propagates (from a `finally` block)."""
        if self.console.is_terminal:
            self._progress.stop()
        self._file.close()
        if self.wandb:
            self.wandb.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)


def trim_metrics(path: Path, last_step: int) -> int:
    """Drop rows of steps after `last_step` (and any torn last line) from a metrics JSONL file, so a
    resumed run appends each step once. Returns the number of lines dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped
