"""A run's in-process teacher (`[jax.teacher] model`): found as `model` is (a folder, `gs://` URL or Hub id,
downloaded when missing) or, as `jaxrl serve` takes it, a jaxrl run or checkpoint (`jaxrl.run.trained`: its
base model with the checkpoint's LoRA folded in, or its full fine-tuning weights); its tokenizer compared
with the student's before any weight loads; and its weights loaded frozen onto the trainer's mesh, sharded
by the rules of the student's weights (`jaxrl.model.modules.param_specs` of its own config), in `[jax]
dtype`. The train step scores the sampled tokens with it (`jaxrl.rl.train.Trainer`); it is not part of the
train state, so checkpoints do not hold it and a resumed run loads it again."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from etils import epath
from jax.sharding import Mesh

from jaxrl.config.hub import resolve_model
from jaxrl.config.model_path import ModelNotFoundError
from jaxrl.config.schema import ConfigError, RunConfig
from jaxrl.config.teacher import vocabulary_mismatch
from jaxrl.model import hf
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.hf_lora import merge_lora
from jaxrl.model.modules import lora_specs, param_specs
from jaxrl.parallel.sharding import spec_shardings
from jaxrl.run import gcs
from jaxrl.run.trained import Source, SourceError, find_source, restore_trained

KEY = "jax.teacher.model"


@dataclasses.dataclass(frozen=True)
class TeacherFiles:
    """Where an in-process teacher's files are: `where` (the folder or `gs://` URL `[jax.teacher] model`
    names, found), its Hugging Face weights and config (`model_path`: `where` itself, or a run's base
    model), its tokenizer folder, and `run`, the run checkpoint whose LoRA or weights go over
    `model_path` (None for a Hugging Face folder)."""

    where: str
    model_path: str
    tokenizer_path: str
    run: Source | None = None

    def describe(self) -> str:
        """`where`, and for a run which checkpoint of which kind."""
        if self.run is None:
            return self.where
        kind = "full fine-tuning" if self.run.finetune == "full" else f"LoRA r{self.run.lora_rank} folded into"
        return f"{self.where} (checkpoint step {self.run.step}: {kind} {self.model_path})"


@dataclasses.dataclass(frozen=True)
class Teacher:
    """A loaded in-process teacher: its files (`files`), its architecture (`config`) and its frozen
    weights on the trainer's mesh (`weights`, the structure of `param_specs(config)`)."""

    files: TeacherFiles
    config: ModelConfig
    weights: Params

    @property
    def parameters(self) -> int:
        """Its number of weights."""
        return sum(x.size for x in jax.tree.leaves(self.weights))


def find_teacher(cfg: RunConfig) -> TeacherFiles:
    """The teacher's files: a Hugging Face folder or `gs://` URL (downloading a Hub id into the HF cache
    when missing, `jaxrl.config.hub.resolve_model`, from the config file's folder), else a local jaxrl run
    folder, checkpoints folder or step folder (`find_source`: its latest step, or the step folder's).

    Raises:
        ConfigError: (key `jax.teacher.model`) not found, the download failed, or a local folder that is
            neither a model folder nor a run's checkpoint (one line saying why).
    """
    try:
        where = resolve_model(cfg.jax.teacher.model, cfg.config_dir)
    except ModelNotFoundError as exc:
        raise ConfigError(cfg.source, [(KEY, f"the teacher: {exc}")]) from None
    if gcs.is_gcs(where) or (Path(where) / "config.json").is_file():
        return TeacherFiles(where, where, where)
    try:
        run = find_source(where)
    except SourceError as exc:
        raise ConfigError(cfg.source, [(KEY, f"the teacher {where} is neither a model folder (config.json + "
                                             f"safetensors) nor a jaxrl run or checkpoint: {exc}")]) from None
    return TeacherFiles(where, run.model_path, run.tokenizer_path, run)


def check_vocabulary(cfg: RunConfig, student_tokenizer: str, teacher_tokenizer: str) -> None:
    """Refuse a teacher whose tokenizer folder (local or `gs://`) is not the student's
    (`vocabulary_mismatch`, reading the files through `etils.epath`).

    Raises:
        ConfigError: (key `jax.teacher.model`) the vocabularies differ, or a folder holds no tokenizer.
    """
    try:
        reason = vocabulary_mismatch(student_tokenizer, teacher_tokenizer, read=_read_text)
    except (ValueError, OSError) as exc:  # OSError: a `gs://` folder that cannot be read
        reason = str(exc)
    if reason:
        raise ConfigError(cfg.source, [(KEY, reason)])


def student_encoder(cfg: RunConfig, tokenizer_path: str) -> Callable[[str], list[int]]:
    """The student's tokenizer (transformers `AutoTokenizer` of its folder, offline) as text -> token ids,
    no special tokens added (the server teacher's probe, `jaxrl.rl.teacher_client.check_server`).

    Raises:
        ConfigError: (key `jax.teacher.base_url`) the folder holds no tokenizer transformers can load.
    """
    from transformers import AutoTokenizer  # about 1 s to import: only a server teacher's check needs it

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(cfg.source, [("jax.teacher.base_url", f"cannot load the student's tokenizer from "
                                                                f"{tokenizer_path} to compare: {exc}")]) from None
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def _read_text(folder: str, name: str) -> str | None:
    """The text of `folder/name` (a local or `gs://` folder), None when there is no such file."""
    path = epath.Path(folder) / name
    return path.read_text(encoding="utf-8") if path.is_file() else None


def load_teacher(cfg: RunConfig, mesh: Mesh, dtype: Any, files: TeacherFiles) -> Teacher:
    """The teacher of `files` (`find_teacher`), its weights in `dtype` placed on `mesh` by `param_specs`; a
    run's LoRA is folded into its base weights (`merge_lora`, at `lora_alpha / lora_rank`), a full
    fine-tuning run's weights replace them. A run's checkpoint is restored onto one device first, as
    `jaxrl serve` and `jaxrl export` restore it, then placed.

    Raises:
        ConfigError: (key `jax.teacher.model`) the checkpoint cannot be read (missing, truncated,
            malformed, or a run checkpoint of another model), in one line.
    """
    try:
        config = hf.load_config(files.model_path)
        shardings = spec_shardings(param_specs(config), config.dims(), mesh)
        weights = hf.load_hf(files.model_path, dtype, shardings=shardings)[1]
        if files.run is not None:
            weights = _trained(files.run, config, weights, mesh)
    except Exception as exc:  # noqa: BLE001 - a missing, truncated or malformed checkpoint, in any layer
        raise ConfigError(cfg.source, [(KEY, f"cannot load the teacher from {files.describe()}: "
                                             f"{type(exc).__name__}: {exc}")]) from None
    return Teacher(files, config, weights)


def _trained(run: Source, config: ModelConfig, base: Params, mesh: Mesh) -> Params:
    """`base` (on `mesh`) with `run`'s checkpoint applied: its LoRA folded in, or its weights instead."""
    restored = restore_trained(run, config)
    shardings = jax.tree.map(lambda x: x.sharding, base)
    if restored.base is not None:
        return jax.device_put(jax.tree.map(lambda x, b: x.astype(b.dtype), restored.base, base), shardings)
    lora = jax.device_put(restored.lora, spec_shardings(lora_specs(config, run.lora_rank, run.lora_targets),
                                                        {**config.dims(), "R": run.lora_rank}, mesh))
    return jax.device_put(merge_lora(config, base, lora, run.lora_alpha / run.lora_rank), shardings)
