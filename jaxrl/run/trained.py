"""A run's checkpoint, found and restored: the trained model that `jaxrl export` writes, `jaxrl serve` and
`jaxrl eval -m` serve, and an in-process teacher (`[jax.teacher] model`) scores with. A checkpoint is named
by its run folder (`<output_dir>/<name>`, with the `run_config.json` that `jaxrl run` writes), its
checkpoints folder (`<run>/checkpoints`, or a `gs://` one with the run's TOML) or one step's folder
(`<run>/checkpoints/12`); restoring it checks it is of the model and LoRA its run config names
(`jaxrl.run.identity`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.config.schema import ConfigError, RunConfig, load_config, resolve_model_path, resolve_tokenizer_path
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.modules import init_lora, param_specs
from jaxrl.rl.train import TrainState, make_optimizer
from jaxrl.run import gcs
from jaxrl.run.checkpoint import Checkpointer, CheckpointError
from jaxrl.run.identity import identity_mismatch, model_identity
from jaxrl.run.layout import checkpoint_dir_of, read_run_config, run_config_path, split_run_folder


class SourceError(Exception):
    """A run's checkpoint that cannot be found or read: no such run, checkpoint or step, no config to
    read, or a checkpoint of another model or LoRA. The message says which and what to pass."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One checkpoint of a run and what is needed to load it: its run's base model and tokenizer folders,
    and the LoRA shape (or full fine-tuning) its weights are of."""

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
        raise SourceError(f"{path} is not a run config written by `jaxrl run` ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0]}); pass the run's TOML with --config") from None


def find_source(ref: str, step: int | None = None, config: str | Path | None = None) -> Source:
    """The checkpoint `ref` names: a run folder (`<output_dir>/<name>`, with the `run_config.json` that
    `jaxrl run` writes), a checkpoint folder (`<run>/checkpoints`, or a `gs://` one), or one step's
    folder (`<run>/checkpoints/12`). `step` picks a step (default: the step folder's, else the latest).
    `config` (the run's TOML) stands in for the run folder's `run_config.json`, which a checkpoint kept
    outside its run folder (`[jax] checkpoint_dir`, `gs://`) cannot be traced to.

    Raises:
        SourceError: no such folder or checkpoint step, no config to read (the message says what to
            pass), or a config whose model folder is missing.
    """
    run_cfg, resolved = None, None
    if config is not None:
        try:
            run_cfg = load_config(config)
        except ConfigError as exc:
            raise SourceError(str(exc)) from None
    ckpt_dir: str | None
    if gcs.is_gcs(ref):
        if run_cfg is None:
            raise SourceError(f"{ref}: pass the run's TOML with --config (a gs:// checkpoint has no run config)")
        head, _, last = ref.rstrip("/").rpartition("/")
        ckpt_dir, path_step = (head, int(last)) if last.isdigit() else (ref.rstrip("/"), None)
    else:
        p = Path(ref).expanduser().resolve()
        if not p.is_dir():
            raise SourceError(f"{ref} is not a folder (expected a run folder, a checkpoint folder or a step's)")
        run_dir, ckpt_dir, path_step = split_run_folder(p)
        if run_cfg is None:
            if (found := _run_source(run_dir)) is None:
                raise SourceError(f"no run config for {ref}: {run_config_path(run_dir)} does not exist (`jaxrl run` "
                                  "writes it); pass the run's TOML with --config")
            run_cfg, resolved = found
        if ckpt_dir is None:
            ckpt_dir = resolved["checkpoint_dir"] if resolved else checkpoint_dir_of(run_cfg)
    if step is not None and path_step is not None and step != path_step:
        raise SourceError(f"{ref} is step {path_step}, but --step {step} was given")
    step = step if step is not None else path_step
    if not gcs.is_gcs(ckpt_dir) and not Path(ckpt_dir).is_dir():
        raise SourceError(f"no checkpoints: {ckpt_dir} does not exist")
    try:
        ckpt = Checkpointer(ckpt_dir, read_only=True)
        steps = ckpt.all_steps()
        ckpt.close()
    except CheckpointError as exc:
        raise SourceError(str(exc)) from None
    if not steps:
        raise SourceError(f"no complete checkpoint in {ckpt_dir}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise SourceError(f"no checkpoint for step {step} in {ckpt_dir} (steps: {', '.join(map(str, steps))})")
    if resolved is not None:
        return Source(ckpt_dir, step, run_cfg.model, resolved["model_path"], resolved["tokenizer_path"],
                      run_cfg.jax.lora_rank, run_cfg.lora_alpha, tuple(run_cfg.jax.lora_targets), run_cfg.jax.dtype,
                      run_cfg.jax.finetune)
    try:
        return Source.of(run_cfg, ckpt_dir, step)
    except ConfigError as exc:
        raise SourceError(str(exc)) from None


def restore_lora(source: Source, model_cfg: ModelConfig) -> Params:
    """The LoRA of `source`'s checkpoint (`restore_trained`); {} for a full fine-tuning one."""
    return restore_trained(source, model_cfg).lora


def restore_trained(source: Source, model_cfg: ModelConfig) -> TrainState:
    """The train state of `source`'s checkpoint, on the default device, after checking the checkpoint
    is of this model, kind of fine-tuning and LoRA shape: its LoRA, or (`finetune = "full"`) its float32
    weights in `base`.

    Raises:
        SourceError: the checkpoint cannot be read or is of another model or LoRA.
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
                raise SourceError(f"checkpoint step {source.step} in {source.checkpoint_dir} is not of this "
                                  "run's model or LoRA: " + "; ".join(problems))
            state, _ = ckpt.restore(source.step, like)
        finally:
            ckpt.close()
    except CheckpointError as exc:
        raise SourceError(str(exc)) from None
    return state
