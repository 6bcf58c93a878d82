"""The run folder's layout, in one place: every file name a run writes and every path derived from the
config. Nothing else spells these names.

    <output_dir>/<name>/            the run folder (`run_dir_of`)
      run_config.json               the run's config and what it resolved to (`write_run_config`);
                                    `config.json` in runs from before it was renamed (read still)
      metrics.jsonl                 one JSON row per step (`jaxrl.run.metrics`)
      console.log                   the run's console output, no colours (`jaxrl.cli.runs`)
      run.json                      pid, status and exit code of the run (`jaxrl.cli.runs`)
      checkpoints/<step>/           Orbax checkpoints (`checkpoint_dir_of`), unless `[jax] checkpoint_dir`
                                    puts them in `<checkpoint_dir>/<name>/` (a folder or `gs://` URL)
      adapters/step_<n>/            PEFT adapters (`[adapters]`, `adapters_dir_of`), beside the checkpoints
      wandb/, wandb_id              W&B's offline runs and the W&B run id (`[wandb]`, `jaxrl.run.wandb_log`)

No JAX here: the CLI's run management reads this without paying for JAX.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxrl.config.schema import RunConfig, resolve_model_path, resolve_tokenizer_path
from jaxrl.run import gcs

RUN_CONFIG = "run_config.json"
OLD_RUN_CONFIG = "config.json"  # its name before it was renamed (it shared HF's model config's name)
METRICS = "metrics.jsonl"
LOG = "console.log"
RECORD = "run.json"
CHECKPOINTS = "checkpoints"
ADAPTERS = "adapters"
WANDB = "wandb"  # W&B's own folder (`[wandb]`, offline runs), made by `wandb.init(dir=<run folder>)`
WANDB_ID = "wandb_id"  # the W&B run id a resume continues


def run_name(cfg: RunConfig) -> str:
    """The run's folder name: `name`, else the config file's stem, with `/` replaced."""
    return (cfg.name or cfg.source.stem).replace("/", "_")


def run_dir_of(cfg: RunConfig) -> Path:
    """`<jax.output_dir>/<name>`: the run's local folder (metrics, and checkpoints by default)."""
    return Path(cfg.jax.output_dir).expanduser() / run_name(cfg)


def checkpoint_root(cfg: RunConfig) -> str:
    """The folder (or `gs://` URL) that holds one checkpoint folder per run. `<name>` in it is that
    run's checkpoint folder, except under the default root (`output_dir`), where it is
    `<name>/checkpoints`."""
    if cfg.jax.checkpoint_dir is None:
        return str(Path(cfg.jax.output_dir).expanduser().resolve())
    if gcs.is_gcs(cfg.jax.checkpoint_dir):
        return cfg.jax.checkpoint_dir.rstrip("/")
    return str((Path.cwd() / Path(cfg.jax.checkpoint_dir).expanduser()).resolve())


def checkpoint_dir_of(cfg: RunConfig, name: str | None = None) -> str:
    """The checkpoint folder of run `name` (default: this run) under `checkpoint_root(cfg)`."""
    name = name or run_name(cfg)
    root = checkpoint_root(cfg)
    if cfg.jax.checkpoint_dir is None:
        return str(Path(root) / name / CHECKPOINTS)
    return gcs.join(root, name) if gcs.is_gcs(root) else str(Path(root) / name)


def adapters_dir_of(cfg: RunConfig) -> str:
    """Where a run's `[adapters]` exports go: `adapters/` in the run's folder under its checkpoint root,
    i.e. `<output_dir>/<name>/adapters`, or `<checkpoint_dir>/<name>/adapters` (a folder or `gs://` URL)
    when `[jax] checkpoint_dir` is set. Orbax ignores it there: it lists only numbered step folders."""
    return gcs.join(checkpoint_root(cfg), run_name(cfg), ADAPTERS)


def run_config_path(run_dir: Path) -> Path:
    """The run config file of `run_dir`: `run_config.json`, or `config.json` in a run from before the
    rename when only that exists."""
    path = run_dir / RUN_CONFIG
    if not path.exists() and (run_dir / OLD_RUN_CONFIG).is_file():
        return run_dir / OLD_RUN_CONFIG
    return path


def write_run_config(run_dir: Path, cfg: RunConfig) -> Path:
    """Write `<run_dir>/run_config.json`: the run's config (`model_dump`) and what it resolved to (model
    and tokenizer folders, checkpoint folder), so `jaxrl export` needs only the run folder."""
    resolved = {"source": str(cfg.source), "model_path": resolve_model_path(cfg),
                "tokenizer_path": resolve_tokenizer_path(cfg), "checkpoint_dir": checkpoint_dir_of(cfg)}
    path = run_dir / RUN_CONFIG
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"resolved": resolved, "config": cfg.model_dump(mode="json")}, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The run config `write_run_config` wrote (`{"config", "resolved"}`), from `run_config_path`.

    Raises:
        OSError: the file does not exist or cannot be read.
        ValueError: it is not JSON (json.JSONDecodeError).
    """
    return json.loads(run_config_path(run_dir).read_text(encoding="utf-8"))


def split_run_folder(folder: Path) -> tuple[Path, str | None, int | None]:
    """`(run folder, checkpoints folder or None for the run's own, step or None for the latest)` of a local
    run folder (it holds the run config or `checkpoints/`), one step's folder (`<run>/checkpoints/12`) or a
    checkpoints folder (`<run>/checkpoints`). Reads no file but the two it tests for."""
    if run_config_path(folder).is_file() or (folder / CHECKPOINTS).is_dir():
        return folder, None, None
    if folder.name.isdigit():
        return folder.parent.parent, str(folder.parent), int(folder.name)
    return folder.parent, str(folder), None


def run_tokenizer_path(folder: Path) -> str:
    """The tokenizer folder of the run that a run, checkpoints or step folder (`split_run_folder`) belongs
    to, as its run config recorded it (`resolved.tokenizer_path`).

    Raises:
        ValueError: the run has no readable run config (naming the file).
    """
    run_dir = split_run_folder(folder)[0]
    try:
        return str(read_run_config(run_dir)["resolved"]["tokenizer_path"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"no run config for {folder}: {run_config_path(run_dir)} cannot be read "
                         f"({type(exc).__name__}); `jaxrl run` writes it") from None
