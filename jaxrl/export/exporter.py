"""`jaxrl export`: find a run's checkpoint and config (a run folder, a checkpoint folder or one step's,
local or `gs://`), restore its LoRA and write it to Hugging Face format: merged weights or a PEFT
adapter (`jaxrl.model.hf_lora`); a full fine-tuning checkpoint (`[jax] finetune = "full"`) is written
as the whole model (`jaxrl.model.hf.save_hf`). Where it may write and how: `jaxrl.export.target`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from etils import epath
from safetensors import SafetensorError

from jaxrl.config.schema import ConfigError, RunConfig, load_config, resolve_model_path, resolve_tokenizer_path
from jaxrl.export.target import ExportError, Manifest, check_target, write_folder
from jaxrl.model import hf
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.hf_lora import save_adapter, save_merged
from jaxrl.model.modules import init_lora, param_specs
from jaxrl.rl.train import TrainState, make_optimizer
from jaxrl.run import gcs
from jaxrl.run.checkpoint import Checkpointer, CheckpointError
from jaxrl.run.identity import identity_mismatch, model_identity
from jaxrl.run.layout import CHECKPOINTS, checkpoint_dir_of, read_run_config, run_config_path

# Files a merged export copies so that it can be used as it is: from the tokenizer folder, and from the
# base model folder (sampling defaults).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "chat_template.jinja")
_MODEL_FILES = ("generation_config.json",)


@dataclasses.dataclass(frozen=True)
class Source:
    """One checkpoint of a run and what is needed to export it."""

    checkpoint_dir: str
    step: int
    model: str  # the config's `model` (hub id), recorded as the adapter's base model
    model_path: str
    tokenizer_path: str
    lora_rank: int
    lora_alpha: int
    lora_targets: tuple[str, ...]
    dtype: str
    finetune: str = "lora"  # `[jax] finetune`: "full" checkpoints hold every weight and no LoRA

    @classmethod
    def of(cls, cfg: RunConfig, checkpoint_dir: str, step: int) -> Source:
        return cls(checkpoint_dir, step, cfg.model, resolve_model_path(cfg), resolve_tokenizer_path(cfg),
                   cfg.jax.lora_rank, cfg.lora_alpha, tuple(cfg.jax.lora_targets), cfg.jax.dtype, cfg.jax.finetune)


def _run_source(run_dir: Path) -> tuple[RunConfig, dict[str, str]] | None:
    """The config and resolved paths `write_run_config` stored in `run_dir`; None when there are none."""
    path = run_config_path(run_dir)
    if not path.is_file():
        return None
    try:
        data = read_run_config(run_dir)
        return RunConfig.model_validate(data["config"]), data["resolved"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{path} is not a run config written by `jaxrl run` ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0]}); pass the run's TOML with --config") from None


def find_source(ref: str, step: int | None = None, config: str | Path | None = None) -> Source:
    """The checkpoint `ref` names: a run folder (`<output_dir>/<name>`, with the `run_config.json` that
    `jaxrl run` writes), a checkpoint folder (`<run>/checkpoints`, or a `gs://` one), or one step's
    folder (`<run>/checkpoints/12`). `step` picks a step (default: the step folder's, else the latest).
    `config` (the run's TOML) stands in for the run folder's `run_config.json`, which a checkpoint kept
    outside its run folder (`[jax] checkpoint_dir`, `gs://`) cannot be traced to.

    Raises:
        ExportError: no such folder or checkpoint step, no config to read (the message says what to
            pass), or a config whose model folder is missing.
    """
    run_cfg, resolved = None, None
    if config is not None:
        try:
            run_cfg = load_config(config)
        except ConfigError as exc:
            raise ExportError(str(exc)) from None
    ckpt_dir: str | None
    if gcs.is_gcs(ref):
        if run_cfg is None:
            raise ExportError(f"{ref}: pass the run's TOML with --config (a gs:// checkpoint has no run config)")
        head, _, last = ref.rstrip("/").rpartition("/")
        ckpt_dir, path_step = (head, int(last)) if last.isdigit() else (ref.rstrip("/"), None)
    else:
        p = Path(ref).expanduser().resolve()
        if not p.is_dir():
            raise ExportError(f"{ref} is not a folder (expected a run folder, a checkpoint folder or a step's)")
        if run_config_path(p).is_file() or (p / CHECKPOINTS).is_dir():  # a run folder
            run_dir, ckpt_dir, path_step = p, None, None
        elif p.name.isdigit():  # one step of `<run>/checkpoints`
            run_dir, ckpt_dir, path_step = p.parent.parent, str(p.parent), int(p.name)
        else:  # `<run>/checkpoints`
            run_dir, ckpt_dir, path_step = p.parent, str(p), None
        if run_cfg is None:
            if (found := _run_source(run_dir)) is None:
                raise ExportError(f"no run config for {ref}: {run_config_path(run_dir)} does not exist (`jaxrl run` "
                                  "writes it); pass the run's TOML with --config")
            run_cfg, resolved = found
        if ckpt_dir is None:
            ckpt_dir = resolved["checkpoint_dir"] if resolved else checkpoint_dir_of(run_cfg)
    if step is not None and path_step is not None and step != path_step:
        raise ExportError(f"{ref} is step {path_step}, but --step {step} was given")
    step = step if step is not None else path_step
    if not gcs.is_gcs(ckpt_dir) and not Path(ckpt_dir).is_dir():
        raise ExportError(f"no checkpoints: {ckpt_dir} does not exist")
    try:
        ckpt = Checkpointer(ckpt_dir, read_only=True)
        steps = ckpt.all_steps()
        ckpt.close()
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    if not steps:
        raise ExportError(f"no complete checkpoint in {ckpt_dir}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(f"no checkpoint for step {step} in {ckpt_dir} (steps: {', '.join(map(str, steps))})")
    if resolved is not None:
        return Source(ckpt_dir, step, run_cfg.model, resolved["model_path"], resolved["tokenizer_path"],
                      run_cfg.jax.lora_rank, run_cfg.lora_alpha, tuple(run_cfg.jax.lora_targets), run_cfg.jax.dtype,
                      run_cfg.jax.finetune)
    try:
        return Source.of(run_cfg, ckpt_dir, step)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None


def restore_lora(source: Source, model_cfg: ModelConfig) -> Params:
    """The LoRA of `source`'s checkpoint (`restore_trained`); {} for a full fine-tuning one."""
    return restore_trained(source, model_cfg).lora


def restore_trained(source: Source, model_cfg: ModelConfig) -> TrainState:
    """The train state of `source`'s checkpoint, on the default device, after checking the checkpoint
    is of this model, kind of fine-tuning and LoRA shape: its LoRA, or (`finetune = "full"`) its float32
    weights in `base`.

    Raises:
        ExportError: the checkpoint cannot be read or is of another model or LoRA.
    """
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets, full = source.lora_targets, source.finetune == "full"

    def abstract(tree: Any) -> Any:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)

    base = abstract(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape(model_cfg.dims()), jnp.float32),
                                 param_specs(model_cfg), is_leaf=lambda x: hasattr(x, "letters")))
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=device)
    if full:
        like = TrainState({}, abstract(jax.eval_shape(make_optimizer(1.0, full=True).init, base)), step, base=base)
    else:
        lora = abstract(jax.eval_shape(lambda: init_lora(model_cfg, source.lora_rank, targets, jax.random.key(0))))
        like = TrainState(lora, abstract(jax.eval_shape(make_optimizer(1.0).init, {"base": base, "lora": lora})),
                          step)
    identity = model_identity(source.model, dataclasses.asdict(model_cfg), source.lora_rank, targets,
                              source.finetune)
    try:
        ckpt = Checkpointer(source.checkpoint_dir, read_only=True)
        try:
            if problems := identity_mismatch(ckpt.read_meta(source.step).get("identity"), identity):
                raise ExportError(f"checkpoint step {source.step} in {source.checkpoint_dir} is not of this "
                                  "run's model or LoRA: " + "; ".join(problems))
            state, _ = ckpt.restore(source.step, like)
        finally:
            ckpt.close()
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    return state


def export(source: Source, out: str | Path, *, adapter: bool = False, force: bool = False) -> Path:
    """Write `source`'s checkpoint to the local folder `out`: the merged model (base weights in the run's
    dtype, plus the tokenizer files of its tokenizer folder), or with `adapter` the PEFT adapter folder.
    A full fine-tuning checkpoint is the model itself: its weights, in the run's dtype (the weights its
    rollout engine sampled with), plus the tokenizer files. `out` must be new or empty, or with `force`
    an earlier export of the same kind; it is never the run's base model or tokenizer folder, and it is
    written whole or not at all (`jaxrl.export.target`).

    Raises:
        ExportError: `out` is refused (`target.check_target`), the checkpoint or the base model cannot be
            read, the adapter format cannot hold this LoRA (or the checkpoint has none: full
            fine-tuning), or `out` cannot be written (a file, no permission, disk full).
    """
    dtype = jnp.bfloat16 if source.dtype == "bfloat16" else jnp.float32
    full = source.finetune == "full"
    if full and adapter:
        raise ExportError(f"checkpoint step {source.step} in {source.checkpoint_dir} is of full fine-tuning "
                          "([jax] finetune = \"full\"): it has no LoRA adapter; export the model (--merged)")
    out = Path(out)
    kind = "adapter" if adapter else "merged"
    check_target(out, kind, force=force, protected={
        source.model_path: "the run's base model folder", source.tokenizer_path: "the run's tokenizer folder"})
    try:
        model_cfg = hf.load_config(source.model_path)
        state = restore_trained(source, model_cfg)
        params = None if adapter or full else hf.load_hf(source.model_path, dtype=dtype)[1]
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the base model {source.model_path}: {exc}") from None

    def fill(folder: Path) -> None:
        if adapter:
            save_adapter(folder, model_cfg, state.lora, rank=source.lora_rank, alpha=source.lora_alpha,
                         targets=source.lora_targets, base_model_name_or_path=source.model)
            return
        if full:
            hf.save_hf(folder, model_cfg, state.base, dtype=dtype)
        else:
            save_merged(folder, model_cfg, params, state.lora, source.lora_alpha / source.lora_rank)
        for src_folder, names in ((source.tokenizer_path, _TOKENIZER_FILES), (source.model_path, _MODEL_FILES)):
            for name in names:
                if (src := epath.Path(src_folder) / name).exists():  # the folders may be gs:// ones
                    (folder / name).write_bytes(src.read_bytes())

    try:
        write_folder(out, lambda files: Manifest(kind, source.checkpoint_dir, source.step, tuple(files)), fill)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ExportError(f"cannot write {out}: {reason}; nothing was written") from None
    return out
