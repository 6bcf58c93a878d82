"""`jaxrl run` and `jaxrl sft`: a run config checked to be of the command's kind, then trained in the
foreground or detached into the background (`jaxrl.cli.runs.detach`), the run folder's record claimed so
that one run is not started twice; and the training job in this process: third-party logs kept quiet,
the runner's errors printed without traceback, the exit status and `run.json` record. Imports no JAX
until a job starts."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from jaxrl.cli import runs
from jaxrl.cli.common import ConfigPath, check_model, err, fail, load_run_config, out
from jaxrl.config.schema import ConfigError, RunConfig
from jaxrl.run.errors import RunError
from jaxrl.run.layout import run_dir_of, run_name


def quiet_libraries() -> None:
    """Keep third-party chatter out of a run's console and console.log, errors excepted: transformers'
    "PyTorch was not found" on every import (its level is read from the environment at import), absl's
    (Orbax's) notes, gcsfs' retries, TensorFlow's (JetStream's seqio) start-up lines, and the `datasets`
    progress bars a classic environment's `map` draws while it loads (read at import, too; turned off
    directly when `datasets` is imported already). A variable already set in the environment wins."""
    import logging
    import os
    import sys

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules and os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1":
        sys.modules["datasets"].disable_progress_bars()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in ("absl", "gcsfs", "tensorflow", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def train(cfg: RunConfig, console: Console | None = None, log: Any = None, run_dir: Path | None = None,
          previous: dict[str, Any] | None = None) -> None:
    """Run the runner (the SFT one for a config with `[jax.sft]`); print its errors without traceback on
    stderr first, then copy them to `log`, and exit with its status; record how the run ended in `run_dir`'s
    `run.json` when given (with `last_checkpoint` after a failed save, `error` after a failure), or, after a
    config error, put back the record `previous` that `runs.start` found (`runs.restore_record`). A full or
    read-only disk that refuses the log or the record is one more line on stderr, never a traceback."""
    import traceback

    from jaxrl.run.runner import run as run_training  # JAX and the trainer: only a job that starts

    code, message, fields = 1, None, {}
    try:
        if cfg.jax.sft is None:
            run_training(cfg, console)  # it loads the `env_file` secrets into the environment
        else:
            from jaxrl.run.sft import SftRun  # JAX and the trainer, as the runner

            run_training(cfg, console, run_class=SftRun)
        code = 0
    except ConfigError as exc:
        code, message = 2, str(exc)
    except RunError as exc:  # a checkpoint that cannot be written, failing environments, preemption
        code, message = exc.exit_code, f"jaxrl run: {exc}"
        if hasattr(exc, "last_complete"):  # a CheckpointError
            fields["last_checkpoint"] = exc.last_complete
    except KeyboardInterrupt:  # a second Ctrl-C
        code = 130
        raise
    except BaseException:
        if log is not None:
            with contextlib.suppress(OSError):
                log.write(traceback.format_exc())
        raise
    finally:
        if message is not None:
            with contextlib.suppress(OSError):  # a detached run's stderr is console.log: maybe on the full disk
                err.print(message, markup=False)
        if log is not None and message is not None:
            with contextlib.suppress(OSError):
                log.write(message + "\n")
                log.flush()
        if run_dir is not None:
            try:
                if code == 2:
                    runs.restore_record(run_dir, previous, message)
                else:
                    runs.finish(run_dir, code, **fields, **({"error": message} if message else {}))
            except OSError as exc:
                with contextlib.suppress(OSError):
                    err.print(f"jaxrl run: cannot record the run's end in {run_dir / runs.RECORD}: {exc}",
                              markup=False)
    if code:
        raise typer.Exit(code=code)


def run(
    path: ConfigPath,
    detach: Annotated[bool, typer.Option("--detach", help="Run in the background (a new session, so closing the "
                                                          "terminal does not stop it); output to the run "
                                                          "folder's console.log.")] = False,
    bench: Annotated[bool, typer.Option("--bench", help="Benchmark instead: the engine's and the trainer's "
                                                        "throughput on synthetic rollouts (random prompts, "
                                                        "max_tokens each, no environment), a few steps, "
                                                        "nothing written; a JSON report on the last line "
                                                        "(jaxrl.run.bench).")] = False,
) -> None:
    """Train: load the config, then start the run (in the foreground, or in
    the background with --detach). Its console output is also kept in `<output_dir>/<name>/console.log`."""
    if bench:
        _bench(path)
        return
    _start(path, detach, "run")


def _bench(path: Path) -> None:
    """`jaxrl run --bench`: the report of `jaxrl.run.bench` on stdout, its last line JSON; exit 2 on a config
    problem (the model cannot be loaded, the mesh does not fit)."""
    cfg = load_run_config(path)
    if cfg.jax.sft is not None:
        raise fail(f"{path}: jax.sft: --bench measures an RL config's engine and trainer")
    quiet_libraries()
    from jaxrl.run.bench import bench  # JAX and the trainer: only a benchmark that starts

    try:
        report = bench(cfg, out)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    out.print(json.dumps(report), markup=False, soft_wrap=True)


def sft(
    path: ConfigPath,
    detach: Annotated[bool, typer.Option("--detach", help="Run in the background, as `jaxrl run --detach`.")] = False,
) -> None:
    """Supervised fine-tuning: train the LoRA on the chat JSONL that the config's `[jax.sft]` names
    (docs/sft.md); a run like `jaxrl run`'s (checkpoints, adapters, metrics, eval,
    `--detach`), whose checkpoint an RL config's `checkpoint_id` starts from."""
    _start(path, detach, "sft")


def _start(path: Path, detach: bool, command: str) -> None:
    """`jaxrl run` or `jaxrl sft` (`command`): the config must be of that kind (`[jax.sft]` set for sft
    only); then the run, in the foreground or detached."""
    cfg = load_run_config(path)
    if command == "run" and cfg.jax.sft is not None:
        raise fail(f"{path}: jax.sft: this is an SFT config; train it with `jaxrl sft {path}`")
    if command == "sft" and cfg.jax.sft is None:
        raise fail(f"{path}: jax.sft: required by `jaxrl sft` (the data to train on); an RL config runs with "
                    f"`jaxrl run {path}`")
    check_model(cfg)  # before the run folder is made: a model `run` cannot find leaves no folder behind
    run_dir, name = run_dir_of(cfg), run_name(cfg)

    def refuse_if_running() -> None:
        pid = runs.running_pid(run_dir)
        if pid is not None and pid != os.getpid():  # a detached run's own process finds itself recorded
            raise fail(f"jaxrl {command}: run {name} is already running (pid {pid}) in {run_dir}; follow it "
                        f"with `jaxrl logs {name} --follow`, stop it with `jaxrl stop {name}`")

    if detach:
        with runs.claimed(run_dir):  # two commands of one run at once: the second finds the first recorded
            refuse_if_running()
            pid = runs.detach(path.resolve(), run_dir, command)
        where = "" if cfg.jax.output_dir == runs.DEFAULT_RUNS_DIR else f" --runs-dir {cfg.jax.output_dir}"
        out.print(f"started run {name} in the background (pid {pid}); its folder is {run_dir}\n"
                  f"follow it:  jaxrl logs {name}{where} --follow\n"
                  f"stop it:    jaxrl stop {name}{where}", markup=False)
        return
    refuse_if_running()  # at once, before JAX starts; again under the lock below, which makes the folder
    quiet_libraries()
    from jaxrl.parallel import distributed  # JAX, as the runner: kept off the validate/init path

    try:  # join a multi-host run (JAX_* variables, GCP Batch, Cloud TPU pod) before any device is touched
        distributed.initialize(distributed.from_env())
    except ValueError as exc:
        raise fail(f"jaxrl {command}: {exc}") from None
    if not distributed.is_primary():  # process 0 alone keeps the run's record and log
        train(cfg)
        return
    with runs.claimed(run_dir):  # checked again: not held while JAX starts, which waits for the other hosts
        refuse_if_running()
        previous = runs.start(run_dir, path.resolve())
    if runs.stdout_is(run_dir / runs.LOG):  # detached: stdout and stderr already go to the log
        train(cfg, run_dir=run_dir, previous=previous)
        return
    with (run_dir / runs.LOG).open("a", encoding="utf-8") as log:
        log.write(f"--- jaxrl {command} {path.resolve()} {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
        train(cfg, runs.TeeConsole(log, soft_wrap=True), log, run_dir, previous)
