"""Local runs managed as `prime rl` manages hosted ones: `jaxrl list`, `logs`, `stop`, `delete`, `checkpoints`
and `plot` over the run folders under `--runs-dir` (`jaxrl.cli.runs` reads and changes them). All but
`checkpoints` (which reads each checkpoint back with Orbax) import no JAX, so they answer at once.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from jaxrl.cli import runs
from jaxrl.cli.common import err, fail, out
from jaxrl.cli.plot import plot_run

RunsDir = Annotated[Path, typer.Option("--runs-dir", envvar="JAXRL_RUNS_DIR",
                                       help="Folder holding the runs: a config's [jax] output_dir.")]
RunRef = Annotated[str, typer.Argument(metavar="RUN", show_default=False,
                                       help="A run's name (its folder under --runs-dir) or the path of its folder.")]
_STATUS_STYLE = {"running": "cyan", "completed": "green", "stopped": "yellow", "failed": "red", "died": "red"}


def _run_folder(ref: str, runs_dir: Path) -> Path:
    """The folder of run `ref` (a name under `runs_dir`, or a path); exit 2 naming what is missing."""
    try:
        return runs.resolve(ref, runs_dir)
    except runs.RunsError as exc:
        raise fail(str(exc)) from None


def list_runs(runs_dir: RunsDir = Path("runs")) -> None:
    """List the runs under --runs-dir: status (running, completed, stopped, failed, died), last step,
    last reward/mean, start time."""
    found = [runs.info(folder) for folder in runs.find_runs(runs_dir)]
    if not found:
        out.print(f"no runs in {runs_dir}" + ("" if runs_dir.is_dir() else " (no such folder)"), markup=False)
        return
    table = Table(title=f"runs in {runs_dir}")
    for col in ("run", "status", "step", "reward/mean", "started", "pid"):
        table.add_column(col, justify="right" if col in ("step", "reward/mean", "pid") else "left")
    for r in found:
        step = "-" if r.step is None else f"{r.step}/{r.max_steps}" if r.max_steps else str(r.step)
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.started)) if r.started else "-"
        table.add_row(r.name, f"[{_STATUS_STYLE.get(r.status, 'default')}]{r.status}[/]", step,
                      "-" if r.reward is None else f"{r.reward:.3f}", started,
                      str(r.pid) if r.status == "running" else "")
    Console(width=max(out.width, 100), highlight=False).print(table)


def logs(
    ref: RunRef,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new output until the run ends.")]
    = False,
    tail: Annotated[int | None, typer.Option("--tail", "-n", help="Start with the last N lines only.",
                                             show_default=False)] = None,
    runs_dir: RunsDir = Path("runs"),
) -> None:
    """Print a run's console output (its console.log); with --follow, until the run ends."""
    folder = _run_folder(ref, runs_dir)
    if not (folder / runs.LOG).exists() and not follow:
        raise fail(f"jaxrl logs: {folder} has no {runs.LOG} (a run started before jaxrl kept one)")
    if not follow:
        lines = (folder / runs.LOG).read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        sys.stdout.write("".join(lines if tail is None else lines[-tail:] if tail else []))
        return
    try:
        for chunk in runs.follow(folder, tail):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    except KeyboardInterrupt:
        return
    out.print(f"[run {folder.name}: {runs.status(folder)}]", markup=False)


def stop(
    ref: RunRef,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the run to checkpoint and exit.")] = 300.0,
    runs_dir: RunsDir = Path("runs"),
) -> None:
    """Stop a running run: SIGTERM, then it finishes the train step in progress, saves a checkpoint and
    exits (`jaxrl run` on its config again resumes it)."""
    folder = _run_folder(ref, runs_dir)
    try:
        if (pid := runs.running_pid(folder)) is not None:
            err.print(f"stopping run {folder.name} (pid {pid}): waiting for its checkpoint ...", markup=False)
        state = runs.stop(folder, timeout)
    except runs.RunsError as exc:
        raise fail(f"jaxrl stop: {exc}") from None
    if state == "running":
        err.print(f"jaxrl stop: run {folder.name} is still running after {timeout:g}s; it exits after its "
                  f"checkpoint (see `jaxrl logs {folder.name}`)", markup=False)
        raise typer.Exit(code=1)
    last = runs.last_lines(folder, 1)
    out.print(f"run {folder.name}: {state}" + (f"; its log ends: {last[0]}" if last else ""), markup=False)


def delete(
    ref: RunRef,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    runs_dir: RunsDir = Path("runs"),
) -> None:
    """Delete a run: its folder, and its checkpoint folder when that is a separate local one
    (`[jax] checkpoint_dir`). Checkpoints on gs:// are left in place, and said so. Refuses a running run,
    and any folder that is not a run inside --runs-dir (it holds `run.json`, or only what `jaxrl run`
    writes)."""
    folder = _run_folder(ref, runs_dir)
    try:
        runs.check_deletable(folder, runs_dir)
    except runs.RunsError as exc:
        raise fail(f"jaxrl delete: {exc}") from None
    local, kept = runs.deletion_plan(folder)
    if not yes:
        out.print(f"run {folder.name} ({runs.status(folder)}): deleting removes\n"
                  + "\n".join(f"  {p}" for p in local), markup=False)
        if not typer.confirm(f"delete run {folder.name}?", default=False):
            raise fail("jaxrl delete: nothing deleted")
    try:
        runs.delete(folder, runs_dir)
    except (runs.RunsError, OSError) as exc:
        raise fail(f"jaxrl delete: {exc}") from None
    out.print(f"deleted run {folder.name}: " + ", ".join(map(str, local)), markup=False)
    for what in kept:
        out.print(f"not deleted: {what}", markup=False)


def checkpoints(ref: RunRef, runs_dir: RunsDir = Path("runs")) -> None:
    """List a run's complete checkpoints (local or gs://) and PEFT adapter folders, with the reward/mean
    of each step. Each checkpoint is read back whole; one that does not restore is marked `damaged` with
    why, as is one a resumed run set aside (`<step>.damaged`)."""
    folder = _run_folder(ref, runs_dir)
    directory, adapters = runs.checkpoint_dir(folder), runs.adapters_dir(folder)
    steps: list[int] = []
    damage: dict[int, str] = {}  # step -> why it does not restore
    if directory.startswith("gs://") or Path(directory).is_dir():
        import logging

        from jaxrl.run.checkpoint import Checkpointer  # heavy (JAX, Orbax): only here

        logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax warns that a read-only manager saves nothing
        try:
            checkpointer = Checkpointer(directory, read_only=True)
            steps = checkpointer.all_steps()
            damage = {step: why for step in steps if (why := checkpointer.damage(step))}
            checkpointer.close()
        except Exception as exc:  # noqa: BLE001 - storage errors of any layer
            raise fail(f"jaxrl checkpoints: cannot list {directory}: {type(exc).__name__}: {exc}") from None
        if not directory.startswith("gs://"):  # steps a resumed run set aside (`Checkpointer.set_aside`)
            damage |= {int(p.name.split(".")[0]): f"set aside as {p}" for p in Path(directory).glob("*.damaged*")
                       if p.name.split(".")[0].isdigit()}
    from jaxrl.run.adapters import adapter_steps  # heavy (JAX), as the checkpoints are

    adapter_done = adapter_steps(adapters)
    rewards = {r["step"]: r.get("reward/mean") for r in runs.metrics_rows(folder) if isinstance(r.get("step"), int)}
    if not steps and not adapter_done and not damage:
        out.print(f"run {folder.name} has no checkpoint yet (in {directory})", markup=False)
        return
    table = Table(title=f"run {folder.name}: checkpoints in {directory}")
    for col in ("step", "checkpoint", "adapter", "reward/mean"):
        table.add_column(col, justify="right" if col in ("step", "reward/mean") else "left")
    for step in sorted(set(steps) | set(adapter_done) | set(damage)):
        reward = rewards.get(step)
        mark = f"damaged: {damage[step]}" if step in damage else "yes" if step in steps else "-"
        table.add_row(str(step), mark, f"step_{step}" if step in adapter_done else "-",
                      f"{reward:.3f}" if isinstance(reward, int | float) else "-")
    out.print(table)
    steps = [s for s in steps if s not in damage]
    if adapter_done:
        out.print(f"PEFT adapters in {adapters}", markup=False)
    if steps:
        out.print(f"export one: jaxrl export {folder} --step {steps[-1]} --out DIR [--adapter]", markup=False)


def plot(
    ref: RunRef,
    out_path: Annotated[Path | None, typer.Option("--out", help="PNG to write. Default: `<run folder>/plot.png`.",
                                                  show_default=False)] = None,
    runs_dir: RunsDir = Path("runs"),
) -> None:
    """Write a PNG of a run's reward curve (reward/mean +- reward/std, per environment too) and, when its
    metrics have them, its eval/ and val/ curves."""
    folder = _run_folder(ref, runs_dir)
    try:
        written = plot_run(runs.metrics_rows(folder), out_path or folder / "plot.png", f"run {folder.name}")
    except ValueError as exc:
        raise fail(f"jaxrl plot: {folder}: {exc}") from None
    out.print(f"wrote {written}", markup=False)
