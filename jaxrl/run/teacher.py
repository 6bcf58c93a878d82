"""A run's in-process teacher (`[jax.teacher] model`): found as `model` is (a folder, `gs://` URL or Hub id,
downloaded when missing), its tokenizer compared with the student's before any weight loads, and its
weights loaded frozen onto the trainer's mesh, sharded by the rules of the student's weights
(`jaxrl.model.modules.param_specs` of its own config), in `[jax] dtype`. The train step scores the sampled
tokens with it (`jaxrl.rl.train.Trainer`); it is not part of the train state, so checkpoints do not hold it
and a resumed run loads it again."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from jaxrl.config.hub import resolve_model
from jaxrl.config.model_path import ModelNotFoundError
from jaxrl.config.schema import ConfigError, RunConfig
from jaxrl.config.teacher import vocabulary_mismatch
from jaxrl.model import hf
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.modules import param_specs
from jaxrl.parallel.sharding import spec_shardings

KEY = "jax.teacher.model"


@dataclasses.dataclass(frozen=True)
class Teacher:
    """A loaded in-process teacher: where its checkpoint is (`path`), its architecture (`config`) and its
    frozen weights on the trainer's mesh (`weights`, the structure of `param_specs(config)`)."""

    path: str
    config: ModelConfig
    weights: Params

    @property
    def parameters(self) -> int:
        """Its number of weights."""
        return sum(x.size for x in jax.tree.leaves(self.weights))


def teacher_path(cfg: RunConfig) -> str:
    """The teacher's checkpoint folder or `gs://` URL, downloading a Hub id into the HF cache when missing
    (`jaxrl.config.hub.resolve_model`, from the config file's folder).

    Raises:
        ConfigError: (key `jax.teacher.model`) not found, or the download failed (one line saying why).
    """
    try:
        return resolve_model(cfg.jax.teacher.model, cfg.config_dir)
    except ModelNotFoundError as exc:
        raise ConfigError(cfg.source, [(KEY, f"the teacher: {exc}")]) from None


def check_vocabulary(cfg: RunConfig, student_tokenizer: str, teacher: str) -> None:
    """Refuse a teacher whose tokenizer is not the student's (`vocabulary_mismatch`); folders on `gs://`
    are not compared (the load-time check, `jaxrl.config.teacher.teacher_file_problems`, says the same).

    Raises:
        ConfigError: (key `jax.teacher.model`) the vocabularies differ, or a folder holds no tokenizer.
    """
    if student_tokenizer.startswith("gs://") or teacher.startswith("gs://"):
        return
    try:
        reason = vocabulary_mismatch(Path(student_tokenizer), Path(teacher))
    except ValueError as exc:
        reason = str(exc)
    if reason:
        raise ConfigError(cfg.source, [(KEY, reason)])


def load_teacher(cfg: RunConfig, mesh: Mesh, dtype: Any, path: str) -> Teacher:
    """The teacher at `path` (`teacher_path`), its weights in `dtype` placed on `mesh` by `param_specs`.

    Raises:
        ConfigError: (key `jax.teacher.model`) the checkpoint cannot be read (missing, truncated or
            malformed), in one line.
    """
    try:
        config = hf.load_config(path)
        weights = hf.load_hf(path, dtype, shardings=spec_shardings(param_specs(config), config.dims(), mesh))[1]
    except Exception as exc:  # noqa: BLE001 - a missing, truncated or malformed checkpoint, in any layer
        raise ConfigError(cfg.source, [(KEY, f"cannot load the teacher from {path}: "
                                             f"{type(exc).__name__}: {exc}")]) from None
    return Teacher(path, config, weights)
