"""What a run needs to survive: where its checkpoints live, which checkpoint a warm start names and
whether it fits the model, trimming metrics back to the checkpoint a run resumes from, turning SIGTERM
into "checkpoint, then exit", and keeping secrets out of messages.

No JAX here: the CLI imports `RunError` from this module without paying for JAX.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jaxrl.config.schema import ConfigError, RunConfig
from jaxrl.run import gcs


class RunError(RuntimeError):
    """A run that stopped for a reason the user must act on; the message says what happened and what
    was kept. `exit_code` is the CLI's exit status (1; 143 = 128 + SIGTERM for a preempted run)."""

    exit_code = 1


class Preempted(RunError):
    """SIGTERM (or SIGINT) arrived; the run saved a checkpoint and stopped. Running it again resumes."""

    exit_code = 143


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
        return str(Path(root) / name / "checkpoints")
    return gcs.join(root, name) if gcs.is_gcs(root) else str(Path(root) / name)


def resolve_checkpoint_id(cfg: RunConfig) -> tuple[str, int | None]:
    """`(checkpoint folder, step or None for its latest)` named by `cfg.checkpoint_id`.

    `"<run>"` and `"<run>/<step>"` name a run under this run's checkpoint root; a value with `://` or
    starting with `/`, `.` or `~` is a path (relative to the config file) to a run's checkpoint folder,
    or to one step's folder when its last part is a number.

    Raises:
        ConfigError: `checkpoint_id` is not set or is malformed.
    """
    ref = cfg.checkpoint_id
    if not ref:
        raise ConfigError(cfg.source, [("checkpoint_id", "not set")])
    if "://" in ref or ref[0] in "/.~":
        where = ref.rstrip("/") if gcs.is_gcs(ref) else str((cfg.config_dir / Path(ref).expanduser()).resolve())
        head, _, last = where.rpartition("/")
        return (head, int(last)) if last.isdigit() and head else (where, None)
    parts = ref.split("/")
    if len(parts) > 2 or not parts[0] or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError(cfg.source, [("checkpoint_id", f"{ref!r} is not '<run>', '<run>/<step>' or a path "
                                                         "(absolute, ./relative or gs://)")])
    return checkpoint_dir_of(cfg, parts[0]), int(parts[1]) if len(parts) == 2 else None


def model_identity(model: str, model_config: dict[str, Any], lora_rank: int, lora_targets: Iterable[str]) -> dict:
    """What a checkpoint must match to be loaded into a run: the model id, its architecture (the
    `ModelConfig` fields) and the LoRA shape. Saved in every checkpoint's metadata."""
    arch = {k: list(v) if isinstance(v, tuple) else v for k, v in model_config.items()}
    return {"model": model, "architecture": arch, "lora_rank": lora_rank, "lora_targets": sorted(lora_targets)}


def identity_mismatch(saved: dict[str, Any] | None, expected: dict[str, Any]) -> list[str]:
    """Human-readable differences between a checkpoint's `model_identity` and this run's; [] when they
    match. A checkpoint without one (written before it existed) only has its arrays checked."""
    if saved is None:
        return []
    out = []
    for key in ("model", "lora_rank", "lora_targets"):
        if saved.get(key) != expected[key]:
            out.append(f"{key}: checkpoint {saved.get(key)!r}, this run {expected[key]!r}")
    arch_saved, arch = saved.get("architecture", {}), expected["architecture"]
    out += [f"architecture.{k}: checkpoint {arch_saved.get(k)!r}, this run {arch.get(k)!r}"
            for k in sorted(set(arch_saved) | set(arch)) if arch_saved.get(k) != arch.get(k)]
    return out


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


class StopRequest:
    """Set by SIGTERM/SIGINT while `stop_on_signals` is active. `on_signal` (if set) is called from the
    handler, for example to cancel the rollouts in flight through their event loop."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.on_signal: Callable[[], None] | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Within the block, SIGTERM and SIGINT set the yielded `StopRequest` instead of killing the
    process; a second signal of the same kind gets the previous handler (a second Ctrl-C still
    interrupts). Previous handlers are restored on exit. Outside the main thread it does nothing."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handle(signum: int, frame: Any) -> None:
        if stop.requested:
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)
            return
        stop.signal = signal.Signals(signum).name
        if stop.on_signal is not None:
            stop.on_signal()

    for s in previous:
        signal.signal(s, handle)
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)


def secret_values(env_file_values: dict[str, str], environ: dict[str, str] | None = None) -> list[str]:
    """Values to keep out of every message: all `env_file` values, and environment variables whose
    name says secret (KEY, TOKEN, SECRET, PASSWORD, CREDENTIAL, AUTH). Values under 6 characters are
    left alone (redacting "1" or "true" would garble messages and protect nothing)."""
    environ = dict(os.environ) if environ is None else environ
    values = set(env_file_values.values()) | {v for k, v in environ.items() if _SECRET_NAME.search(k)}
    return sorted((v for v in values if len(v) >= 6), key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each secret replaced by `***`."""
    for s in secrets:
        text = text.replace(s, "***")
    return text
