"""Running a training job in this process for `jaxrl run` and `jaxrl sft` (`jaxrl.cli.main`): third-party
logs kept quiet, the runner's errors printed without traceback, the exit status and `run.json` record.
Imports no JAX until a job starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from jaxrl.config.schema import ConfigError, RunConfig

err = Console(stderr=True, soft_wrap=True, highlight=False)


def quiet_libraries() -> None:
    """Keep third-party chatter out of a run's console and console.log, errors excepted: transformers'
    "PyTorch was not found" on every import (its level is read from the environment at import), absl's
    (Orbax's) notes, gcsfs' retries, TensorFlow's (JetStream's seqio) start-up lines. A variable already
    set in the environment wins."""
    import logging
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in ("absl", "gcsfs", "tensorflow", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def train(cfg: RunConfig, console: Console | None = None, log: Any = None, run_dir: Path | None = None) -> None:
    """Run the runner (the SFT one for a config with `[jax.sft]`); print (and copy to `log`) its errors
    without traceback and exit with its status; record how the run ended in `run_dir`'s `run.json` when
    given."""
    import traceback

    from jaxrl.cli import runs
    from jaxrl.run.errors import RunError
    from jaxrl.run.runner import run as run_training

    code, message = 1, None
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
    except KeyboardInterrupt:  # a second Ctrl-C
        code = 130
        raise
    except BaseException:
        if log is not None:
            log.write(traceback.format_exc())
        raise
    finally:
        if log is not None and message is not None:
            log.write(message + "\n")
        if run_dir is not None:
            runs.finish(run_dir, code)
    if message is not None:
        err.print(message, markup=False)
    if code:
        raise typer.Exit(code=code)
