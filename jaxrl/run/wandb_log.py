"""`[wandb]`: each step's metrics and the run's config to Weights & Biases, through the `wandb` package.

Without `WANDB_API_KEY` (and no `WANDB_MODE` of the user's), the run is recorded offline under
`<run_dir>/wandb/offline-run-*`; `wandb sync <that folder>` uploads it later. Only process 0 logs.
The config is logged with every secret value (`jaxrl.run.redaction.secret_values`: `env_file` values and
secret-named environment variables) replaced by `***`, and W&B's console capture is off, so lines an
environment prints never reach W&B. A resumed run continues the same W&B run (its id is kept in
`<run_dir>/wandb_id`). Metrics are plotted against the logged `step`, so the steps a resume redoes
(those after its checkpoint) appear again at their own step numbers.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console

from jaxrl.config.schema import RunConfig
from jaxrl.run.errors import RunError
from jaxrl.run.layout import WANDB_ID, run_name
from jaxrl.run.redaction import redact


def redacted(value: Any, secrets: list[str]) -> Any:
    """`value` (JSON-like: dicts, lists, strings, numbers) with every secret in every string replaced."""
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {k: redacted(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(v, secrets) for v in value]
    return value


class WandbRun:
    """One W&B run of a training run; see the module docstring. Build it with `start`."""

    def __init__(self, run: Any) -> None:
        self.run = run
        run.define_metric("step")
        run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `metrics` of optimizer step `step` (1-based)."""
        self.run.log({**metrics, "step": step})

    def finish(self, exit_code: int = 0) -> None:
        """Close the run (a nonzero `exit_code` marks it failed) and write its last records."""
        self.run.finish(exit_code=exit_code)


def start(cfg: RunConfig, run_dir: Path, secrets: list[str], console: Console) -> WandbRun | None:
    """The W&B run of `cfg`, or None without a `[wandb]` table. Prints where the run goes.

    Raises:
        RunError: W&B could not start (an online login without network, a bad entity or project).
    """
    if cfg.wandb is None:
        return None
    import wandb  # here, not at the top: a second of import time that runs without [wandb] do not pay

    os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")  # else it advertises Weave on seeing openai imported
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    id_file = run_dir / WANDB_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    try:
        run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name or run_name(cfg),
                         id=run_id, resume="allow", dir=str(run_dir), mode=mode,
                         config=redacted(cfg.model_dump(mode="json"), secrets),
                         settings=wandb.Settings(console="off", silent=True))
    except Exception as exc:  # noqa: BLE001 - wandb raises many kinds (auth, network, usage)
        raise RunError(f"cannot start W&B ({mode} mode): {type(exc).__name__}: {exc}; unset WANDB_API_KEY or set "
                       f"WANDB_MODE=offline to record the run offline") from None
    if mode == "offline":
        folder = Path(run.dir).parent
        console.print(f"W&B: offline run in {folder}; upload it with `wandb sync {folder}`")
    else:
        console.print(f"W&B: {run.url}")
    return WandbRun(run)
