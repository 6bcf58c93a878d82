"""Local run management behind `jaxrl run --detach`, `list`, `logs`, `stop`, `delete` and `checkpoints`.

A run is its folder `<output_dir>/<name>` (its layout: `jaxrl.run.layout`). Besides what the runner writes
there (`metrics.jsonl`, `run_config.json`, `checkpoints/`, ...), `jaxrl run` keeps two files in it:

- `console.log`: the run's console output, without colours. A foreground run copies what it prints
  to it (the terminal output is unchanged); a detached run's stdout and stderr are the file itself, so
  it also holds what libraries print.
- `run.json`: `{"pid", "host", "status", "config", "started", "ended", "exit_code", "last_checkpoint",
  "error"}`, rewritten whole (a temporary file renamed; in place on a full disk: `write_record`) when the run
  starts and when it ends (`error`: the line a failed run ended with); a config error found by the run puts
  back the record it found, or records the run `failed` when there was none (`restore_record`).
  `status` is `running`, `completed` (exit 0), `stopped` (SIGTERM/SIGINT: checkpointed, exit 143; or
  ended by `jaxrl stop`) or `failed`; a `.lock` file beside it orders two commands of one run (`claimed`).
  A record that says `running` while its process is gone (SIGKILL, out of memory, a lost machine) reads
  as `died`.

`jaxrl list` looks for runs in one runs folder: `--runs-dir`, else `$JAXRL_RUNS_DIR`, else `runs`, the
default `output_dir` (both relative to the working directory, as `output_dir` is). A run is named by
its folder name there, or by a path to its folder. No JAX here: these commands answer at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.control import Control

from jaxrl.run.layout import (
    ADAPTERS,
    CHECKPOINTS,
    LOG,
    METRICS,
    OLD_RUN_CONFIG,
    RECORD,
    RUN_CONFIG,
    WANDB,
    WANDB_ID,
    read_run_config,
)

DEFAULT_RUNS_DIR = "runs"
LOCK = ".lock"  # `claimed`'s lock file in a run folder
HOST = socket.gethostname()
_MARKERS = (RECORD, LOG, METRICS, RUN_CONFIG, OLD_RUN_CONFIG, LOCK)
_WRITTEN = frozenset((*_MARKERS, CHECKPOINTS, ADAPTERS, WANDB, WANDB_ID))  # all that `jaxrl run` writes in a run folder


class RunsError(Exception):
    """A run management request that cannot be done; the message says why and what exists."""


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """One run as `jaxrl list` shows it. `step`: last step in metrics.jsonl (None: no row yet);
    `max_steps` and `reward` (last `reward/mean`) are None when unknown."""

    name: str
    folder: Path
    status: str
    pid: int | None
    step: int | None
    max_steps: int | None
    reward: float | None
    started: float | None


def is_run(folder: Path) -> bool:
    """Whether `folder` is a run folder (it holds one of the files `jaxrl run` writes)."""
    return folder.is_dir() and any((folder / m).exists() for m in _MARKERS)


def find_runs(runs_dir: Path) -> list[Path]:
    """The run folders directly under `runs_dir`, by name; [] when it does not exist."""
    if not runs_dir.is_dir():
        return []
    return sorted(p for p in runs_dir.iterdir() if is_run(p))


def resolve(ref: str, runs_dir: Path) -> Path:
    """The run folder `ref` names: a run name under `runs_dir`, or a path to a run folder.

    Raises:
        RunsError: no such run; the message lists the runs under `runs_dir`.
    """
    for candidate in (runs_dir / ref, Path(ref).expanduser()):
        if is_run(candidate):
            return candidate
    known = [p.name for p in find_runs(runs_dir)]
    where = f"{runs_dir}" + ("" if runs_dir.is_dir() else " (no such folder)")
    listing = f"runs there: {', '.join(known)}" if known else "it holds no run"
    raise RunsError(f"no run {ref!r} in {where}; {listing} (another runs folder: --runs-dir DIR)")


def read_record(folder: Path) -> dict[str, Any]:
    """`run.json` of a run folder; {} when there is none or it cannot be read."""
    try:
        data = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(folder: Path, **fields: Any) -> dict[str, Any]:
    """Update `run.json` with `fields`; returns the new record. Written to a temporary file renamed over it
    (atomic); on a full disk (ENOSPC, EDQUOT) the temporary file is removed and the record rewritten in
    place within the blocks the old one holds (a record is a few hundred bytes; a block 4 KiB), which needs
    no free space.

    Raises:
        OSError: the record cannot be written either way (a read-only folder, a full disk and no record
            to overwrite); no temporary file is left.
    """
    record = read_record(folder) | fields
    text = json.dumps(record, indent=2) + "\n"
    tmp = folder / f".{RECORD}.{os.getpid()}.tmp"
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(folder / RECORD)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not _rewrite_in_place(folder / RECORD, text):
            raise
    return record


def _rewrite_in_place(path: Path, text: str) -> bool:
    """Overwrite `path` with `text` when it fits in the blocks `path` already holds; whether it was written."""
    data = text.encode("utf-8")
    try:
        if len(data) > path.stat().st_blocks * 512:
            return False
        with path.open("r+b") as f:
            f.write(data)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return False
    return True


def restore_record(folder: Path, previous: dict[str, Any] | None, reason: str) -> None:
    """After a config error that only the run found (a model that cannot be downloaded, an environment that
    cannot be loaded): put back the `run.json` that `start` found (`previous`), so an earlier run's record is
    never overwritten; when there was none, record this run as `failed` (exit code 2) with `reason` as its
    `error`, so that its folder is a run `list` and `delete` know.

    Raises:
        OSError: `write_record`'s.
    """
    if previous:
        write_record(folder, **({key: None for key in read_record(folder)} | previous))
    else:
        write_record(folder, status="failed", ended=time.time(), exit_code=2, error=reason)


@contextlib.contextmanager
def claimed(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock (`flock`) on `<folder>/.lock` (the folder made if need be): two `jaxrl run` of
    one run that check it is not running and record themselves inside it do so one after the other, so
    the second finds the first recorded."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / LOCK).open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process that is a jaxrl command, as far as /proc tells
    (a reused pid of another program reads as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        return True
    proc = Path(f"/proc/{pid}")
    with contextlib.suppress(OSError):
        if proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
        if b"jaxrl" not in proc.joinpath("cmdline").read_bytes():
            return False
    return True


def status(folder: Path, record: dict[str, Any] | None = None) -> str:
    """`running`, `completed`, `stopped`, `failed`, `died` (recorded as running, process gone) or
    `unknown` (a folder without `run.json`: from before it existed, or a start cut off before it recorded
    itself)."""
    record = read_record(folder) if record is None else record
    state = record.get("status", "unknown")
    if state == "running" and record.get("host", HOST) == HOST and not (
            isinstance(record.get("pid"), int) and pid_alive(record["pid"])):
        return "died"
    return state  # a run recorded by another host (a shared folder) cannot be checked from here


def running_pid(folder: Path) -> int | None:
    """The pid of the process of this host that runs this run, None when none does (another host's
    run, as process 0 of a multi-host run records it, does not count: the other hosts start it too)."""
    record = read_record(folder)
    if record.get("host", HOST) != HOST:
        return None
    return record["pid"] if status(folder, record) == "running" else None


def metrics_rows(folder: Path) -> list[dict[str, Any]]:
    """The rows of `metrics.jsonl` (a torn last line is skipped)."""
    rows = []
    with contextlib.suppress(FileNotFoundError):
        for line in (folder / METRICS).read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                if isinstance(row := json.loads(line), dict):
                    rows.append(row)
    return rows


def run_config(folder: Path) -> dict[str, Any]:
    """The run config that the runner writes (`{"config", "resolved"}`, `jaxrl.run.layout.write_run_config`);
    {} before it exists."""
    with contextlib.suppress(OSError, ValueError):
        data = read_run_config(folder)
        if isinstance(data, dict):
            return data
    return {}


def info(folder: Path) -> RunInfo:
    """What `jaxrl list` shows of one run."""
    record = read_record(folder)
    rows = [r for r in metrics_rows(folder) if isinstance(r.get("step"), int)]
    last = rows[-1] if rows else {}
    reward = next((r["reward/mean"] for r in reversed(rows) if isinstance(r.get("reward/mean"), int | float)), None)
    max_steps = run_config(folder).get("config", {}).get("max_steps")
    return RunInfo(folder.name, folder, status(folder, record), record.get("pid"), last.get("step"),
                   max_steps, reward, record.get("started"))


def checkpoint_dir(folder: Path) -> str:
    """The run's checkpoint folder or `gs://` URL, as its run config resolved it; else the default
    `<run folder>/checkpoints`."""
    return run_config(folder).get("resolved", {}).get("checkpoint_dir") or str(folder / CHECKPOINTS)


def adapters_dir(folder: Path) -> str:
    """Where the run's `[adapters]` go: `<run folder>/adapters`, or `adapters/` in the checkpoint folder
    when that is elsewhere (`jaxrl.run.layout.adapters_dir_of`)."""
    ckpt = checkpoint_dir(folder)
    if Path(ckpt) == folder / CHECKPOINTS:
        return str(folder / ADAPTERS)
    return f"{ckpt.rstrip('/')}/{ADAPTERS}"


class TeeConsole(Console):
    """A Console that also prints, without colour or live redraws, everything passed to `print` into
    `log` (a text file): the terminal sees exactly what a plain Console shows."""

    def __init__(self, log: IO[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._copy = Console(file=log, soft_wrap=True, highlight=False, no_color=True, force_terminal=False,
                             width=200)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*objects, **kwargs)
        if objects and not any(isinstance(o, Control) for o in objects):  # progress redraws stay on the terminal
            self._copy.print(*objects, **kwargs)
            self._copy.file.flush()


def stdout_is(path: Path) -> bool:
    """Whether this process's stdout is the file `path` (a detached run writes its log that way)."""
    try:
        out, target = os.fstat(sys.stdout.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):
        return False
    return (out.st_dev, out.st_ino) == (target.st_dev, target.st_ino)


def start(folder: Path, config: Path) -> dict[str, Any]:
    """Record this process as running `folder`'s run from `config`; return the record found before ({}:
    none), for `restore_record`. A detached run's own process finds the record `detach` made for it, and
    returns the one `detach` found."""
    folder.mkdir(parents=True, exist_ok=True)
    found = read_record(folder)
    previous = (found.get("previous") or {}) if found.get("pid") == os.getpid() else found
    write_record(folder, pid=os.getpid(), host=HOST, status="running", config=str(config), started=time.time(),
                 ended=None, exit_code=None, last_checkpoint=None, error=None, previous=None)
    return previous


def finish(folder: Path, exit_code: int, **fields: Any) -> None:
    """Record how this process's run ended: exit 0 completed, 143/130 (SIGTERM/SIGINT) stopped, else failed;
    with `fields` (`last_checkpoint`: the last complete checkpoint's step after a failed save).

    Raises:
        OSError: `write_record`'s.
    """
    state = "completed" if exit_code == 0 else "stopped" if exit_code in (130, 143) else "failed"
    write_record(folder, status=state, ended=time.time(), exit_code=exit_code, **fields)


def detach(config: Path, folder: Path, command: str = "run") -> int:
    """Start `python -m jaxrl <command> CONFIG` (command "run" or "sft") in a new session (it outlives the
    terminal and ignores its Ctrl-C), stdin closed, stdout and stderr appended to `<folder>/console.log`;
    record it as running and return its pid. The child sees the log as its stdout and so does not copy its
    console again."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / LOG).open("a", encoding="utf-8") as log:
        log.write(f"--- jaxrl {command} {config} (detached) {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
        log.flush()
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        previous = read_record(folder)
        proc = subprocess.Popen([sys.executable, "-m", "jaxrl", command, str(config)], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    write_record(folder, pid=proc.pid, host=HOST, status="running", config=str(config), started=time.time(),
                 ended=None, exit_code=None, error=None, previous=previous)
    return proc.pid


def last_lines(folder: Path, n: int) -> list[str]:
    """The last `n` non-empty lines of the run's log ([] without one)."""
    with contextlib.suppress(FileNotFoundError):
        lines = (folder / LOG).read_text(encoding="utf-8", errors="replace").splitlines()
        return [line for line in lines if line.strip()][-n:]
    return []


def follow(folder: Path, tail: int | None = None, poll_s: float = 0.5) -> Iterator[str]:
    """The log's text, then (while the run is running) what is appended, until the run ends; the last
    `tail` lines only at first when given."""
    path = folder / LOG
    pos = 0
    if tail is not None and path.exists():
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        yield "".join(lines[-tail:] if tail else [])
        pos = path.stat().st_size
    while True:
        alive = running_pid(folder) is not None  # read before the file, so the last lines are not missed
        if path.exists():
            with path.open("rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            if chunk:
                yield chunk.decode("utf-8", errors="replace")
        if not alive:
            return
        time.sleep(poll_s)


def stop(folder: Path, timeout_s: float, poll_s: float = 0.5) -> str:
    """SIGTERM the run's process (it finishes the train step in progress, checkpoints and exits 143) and
    wait up to `timeout_s` for it to exit; return its status then (`running` if it has not exited).
    A run that ended without recording how (killed during start-up) is recorded as stopped.

    Raises:
        RunsError: the run is not running.
    """
    record = read_record(folder)
    state = status(folder, record)
    if state != "running":
        raise RunsError(f"run {folder.name} is not running ({state})")
    if record.get("host", HOST) != HOST:
        raise RunsError(f"run {folder.name} runs on host {record['host']}; stop it there")
    pid = record["pid"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return "running"
        time.sleep(poll_s)
    if read_record(folder).get("status") == "running":
        write_record(folder, status="stopped", ended=time.time(), exit_code=None)
    return status(folder)


def deletion_plan(folder: Path) -> tuple[list[Path], list[str]]:
    """`(local folders to delete, locations left alone)`: the run folder, and its checkpoint folder (which
    holds its adapters) when that is a separate local one; `gs://` checkpoint folders, and a separate
    folder that `_separate_checkpoints_problem` refuses, are left alone and listed with why."""
    local, kept = [folder], []
    ckpt = checkpoint_dir(folder)
    if ckpt.startswith("gs://"):
        kept.append(f"its checkpoints and adapters on GCS, {ckpt} (remove them with `gcloud storage rm -r {ckpt}`)")
    elif not Path(ckpt).resolve().is_relative_to(folder.resolve()) and Path(ckpt).exists():
        if problem := _separate_checkpoints_problem(Path(ckpt), folder):
            kept.append(f"its checkpoint folder {ckpt} ({problem})")
        else:
            local.append(Path(ckpt))
    return local, kept


def _separate_checkpoints_problem(ckpt: Path, folder: Path) -> str | None:
    """Why the checkpoint folder recorded in a run's run config is not deleted with it (None: it is):
    `<checkpoint_dir>/<name>` must end in the run's name and hold neither the run, its runs folder nor the
    working directory (a hand-edited or older run config could name any folder)."""
    if ckpt.is_symlink() or not ckpt.is_dir():
        return "not a plain folder"
    real = ckpt.resolve()
    if real.name != folder.name:
        return f"its name is not the run's, {folder.name!r}"
    if any(real == p or real in p.parents for p in (folder.resolve(), Path.cwd().resolve())):
        return "it holds the run folder or the working directory"
    return None


def check_deletable(folder: Path, runs_dir: Path) -> None:
    """Raises RunsError when `folder` is not a run folder (not a symbolic link, and holding `run.json` or
    only what `jaxrl run` writes, as a start cut off before it recorded itself leaves `console.log` and
    `.lock`) strictly inside `runs_dir`, holds the working directory, or is running, here or on another host
    (stop it first). A name like `.` or `..` thus never reaches the runs folder or its parent."""
    real, root = folder.resolve(), runs_dir.resolve()
    if folder.is_symlink() or not folder.is_dir() or root not in real.parents:
        raise RunsError(f"refused to delete {folder}: not a run folder inside the runs folder {runs_dir} "
                        f"(another runs folder: --runs-dir DIR); nothing deleted")
    if not (folder / RECORD).is_file() and (others := _not_written_by_run(folder)):
        raise RunsError(f"refused to delete {folder}: it has no {RECORD} and holds what `jaxrl run` does not "
                        f"write ({', '.join(others[:4])}{', ...' if len(others) > 4 else ''}); nothing deleted")
    if real == Path.cwd().resolve() or real in Path.cwd().resolve().parents:
        raise RunsError(f"refused to delete {folder}: it holds the working directory; nothing deleted")
    record = read_record(folder)
    if status(folder, record) == "running":
        where = f"pid {record.get('pid')}" + ("" if record.get("host", HOST) == HOST else f" on {record['host']}")
        raise RunsError(f"run {folder.name} is running ({where}); stop it first with `jaxrl stop {folder.name}`")


def _not_written_by_run(folder: Path) -> list[str]:
    """The names in `folder` that are not among those `jaxrl run` writes there (`run.json`'s temporary
    files count as its own)."""
    return sorted(p.name for p in folder.iterdir() if p.name not in _WRITTEN
                  and not (p.name.startswith(f".{RECORD}.") and p.name.endswith(".tmp")))


def delete(folder: Path, runs_dir: Path) -> tuple[list[Path], list[str]]:
    """Delete what `deletion_plan` lists as local; return the plan.

    Raises:
        RunsError: `check_deletable` refuses the folder.
    """
    check_deletable(folder, runs_dir)
    local, kept = deletion_plan(folder)
    for path in local:
        shutil.rmtree(path)
    return local, kept
