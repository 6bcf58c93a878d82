"""Running a training job in this process for `jaxrl run` and `jaxrl sft` (`jaxrl.cli.main`): third-party
logs kept quiet, the runner's errors printed without traceback, the exit status and `run.json` record.
Imports no JAX until a job starts."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from jaxrl.config.schema import ConfigError, RunConfig

err = Console(stderr=True, soft_wrap=True, highlight=False)


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
    `run.json` when given (with `last_checkpoint` after a failed save), or, after a config error, put back
    the record `previous` that `runs.start` found. A full or read-only disk that refuses the log or the
    record is one more line on stderr, never a traceback."""
    import traceback

    from jaxrl.cli import runs
    from jaxrl.run.errors import RunError
    from jaxrl.run.runner import run as run_training

    code, message, fields = 1, None, {}
    try:
        if cfg.jax.sft is None:
            run_training(cfg, console)  # it loads the `env_file` secrets into the environment
        else:
            from jaxrl.run.sft import SftRun

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
                    runs.restore_record(run_dir, previous)
                else:
                    runs.finish(run_dir, code, **fields)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    err.print(f"jaxrl run: cannot record the run's end in {run_dir / runs.RECORD}: {exc}",
                              markup=False)
    if code:
        raise typer.Exit(code=code)
