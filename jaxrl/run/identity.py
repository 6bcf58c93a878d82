"""Which checkpoint a warm start names (`checkpoint_id`) and whether a checkpoint fits this run's model:
the identity (model id, architecture, kind of fine-tuning, LoRA shape) saved in every checkpoint's
metadata; restoring a checkpoint after that check (`restore_checked`, `warm_start_state`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.markup import escape

from jaxrl.config.schema import ConfigError, RunConfig
from jaxrl.rl.train import TrainState
from jaxrl.run import gcs
from jaxrl.run.checkpoint import Checkpointer, CheckpointError
from jaxrl.run.layout import checkpoint_dir_of


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


def model_identity(model: str, model_config: dict[str, Any], lora_rank: int, lora_targets: Iterable[str],
                   finetune: str = "lora") -> dict:
    """What a checkpoint must match to be loaded into a run: the model id, its architecture (the
    `ModelConfig` fields), what trains (`[jax] finetune`) and, with LoRA, the LoRA shape. Saved in every
    checkpoint's metadata."""
    arch = {k: list(v) if isinstance(v, tuple) else v for k, v in model_config.items()}
    if finetune == "full":
        return {"model": model, "architecture": arch, "finetune": finetune}
    return {"model": model, "architecture": arch, "lora_rank": lora_rank, "lora_targets": sorted(lora_targets)}


def identity_mismatch(saved: dict[str, Any] | None, expected: dict[str, Any]) -> list[str]:
    """Human-readable differences between a checkpoint's `model_identity` and this run's; [] when they
    match. A checkpoint without one (written before it existed) only has its arrays checked."""
    if saved is None:
        return []
    out = []
    kind = saved.get("finetune", "lora")  # checkpoints from before full fine-tuning are LoRA ones
    if kind != expected.get("finetune", "lora"):
        return [f"finetune: checkpoint {kind!r}, this run {expected.get('finetune', 'lora')!r}"]
    for key in ("model", "lora_rank", "lora_targets"):
        if saved.get(key) != expected.get(key):
            out.append(f"{key}: checkpoint {saved.get(key)!r}, this run {expected.get(key)!r}")
    arch_saved, arch = saved.get("architecture", {}), expected["architecture"]
    out += [f"architecture.{k}: checkpoint {arch_saved.get(k)!r}, this run {arch.get(k)!r}"
            for k in sorted(set(arch_saved) | set(arch)) if arch_saved.get(k) != arch.get(k)]
    return out


def restore_checked(ckpt: Checkpointer, step: int, like: TrainState, identity: dict) -> tuple[TrainState, dict]:
    """Checkpoint `step` of `ckpt`, after checking it is of this run's model and LoRA shape."""
    meta = ckpt.read_meta(step)
    if problems := identity_mismatch(meta.get("identity"), identity):
        raise CheckpointError(f"checkpoint step {step} in {ckpt.directory} is of a different model or LoRA: "
                              + "; ".join(problems))
    return ckpt.restore(step, like)


def restore_newest(ckpt: Checkpointer, like: TrainState, identity: dict, console: Any
                   ) -> tuple[TrainState, dict] | None:
    """The newest checkpoint of `ckpt` that restores whole (state, metadata), None when it has none. Newer
    steps that do not (a truncated array file, garbage metadata, a deleted `_METADATA`) are skipped with one
    warning each naming the step and why, and set aside as `<step>.damaged` (`Checkpointer.set_aside`), not
    deleted, once an older step has restored.

    Raises:
        CheckpointError: a checkpoint is of another model or LoRA shape (`restore_checked`), or no step
            restores (the newest's error, nothing set aside: storage that is down fails every step, and
            must not restart the run from step 0).
    """
    damaged: list[tuple[int, CheckpointError]] = []
    for step in reversed(ckpt.all_steps()):
        try:
            meta = ckpt.read_meta(step)
            mismatch = identity_mismatch(meta.get("identity"), identity)
            restored = None if mismatch else ckpt.restore(step, like)
        except CheckpointError as exc:
            damaged.append((step, exc))
            continue
        if mismatch:
            raise CheckpointError(f"checkpoint step {step} in {ckpt.directory} is of a different model or LoRA: "
                                  + "; ".join(mismatch))
        for bad, exc in damaged:
            where = ckpt.set_aside(bad)
            console.print(f"[yellow]checkpoint step {bad} is damaged; resuming from step {step} instead "
                          f"(the damaged one is kept as {escape(where)}):[/] {escape(str(exc))}", highlight=False)
        return restored
    if damaged:
        raise damaged[0][1]
    return None


def warm_start_state(cfg: RunConfig, like: TrainState, identity: dict, console: Any) -> TrainState:
    """The train state of the checkpoint `cfg.checkpoint_id` names (its LoRA, or its weights in full
    fine-tuning, start the run). Raises ConfigError (key `checkpoint_id`) when there is no such
    checkpoint or it is of another model or kind of fine-tuning."""
    directory, step = resolve_checkpoint_id(cfg)
    try:
        source = Checkpointer(directory, read_only=True)
        step = source.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {directory}")
        restored, _ = restore_checked(source, step, like, identity)
        source.close()
    except CheckpointError as exc:
        raise ConfigError(cfg.source, [("checkpoint_id", f"{cfg.checkpoint_id!r}: {exc}")]) from None
    console.print(f"warm start: {'weights' if restored.base is not None else 'LoRA'} of checkpoint step {step} "
                  f"in {directory}")
    return restored
