"""A run's architectures for compiling, from `config.json` alone (no weights read): the student's
(`model_of`) and an in-process teacher's (`teacher_model_of`, `[jax.teacher] model`)."""

from __future__ import annotations

from jaxrl.config.hub import download_config
from jaxrl.config.model_path import HubModel, ModelNotFoundError, find_in_hf_cache
from jaxrl.config.schema import ConfigError, RunConfig, locate_model_path
from jaxrl.model import catalog, hf
from jaxrl.model.config import ModelConfig


def model_of(cfg: RunConfig) -> ModelConfig:
    """The run's architecture, from its `config.json` alone: the checkpoint's when it is on this machine
    (a folder, or the local HF cache, a config-only entry included); else the catalogue's facts for a
    Hosted Training model name (`jaxrl.model.catalog.HOSTED_MODELS`); else the Hub's `config.json` of the
    id, downloaded alone (`jaxrl.config.hub.download_config`). A `gs://` checkpoint is not read.

    Raises:
        ConfigError: none of these has it (naming the places looked in, or why the download failed).
    """
    try:
        found: str | HubModel = locate_model_path(cfg)
    except ConfigError as exc:  # e.g. a `[jax] model_path` folder of the training machine, absent here
        found = str(exc)
        if (facts := catalog.HOSTED_MODELS.get(cfg.model)) is not None:
            return ModelConfig.from_hf(facts)
        hosted = ", ".join(catalog.HOSTED_MODELS)
        raise ConfigError(cfg.source, [("model", f"no architecture for {cfg.model!r}: {found}; and it is not a "
                                                 f"Hosted Training model ({hosted})")]) from None
    if isinstance(found, str) and not found.startswith("gs://"):
        return hf.load_config(found)
    if isinstance(found, HubModel) and (cached := find_in_hf_cache(found.repo_id, found.revision,
                                                                   need="config")) is not None:
        return hf.load_config(cached)
    facts = catalog.HOSTED_MODELS.get(cfg.model)
    if facts is not None:
        return ModelConfig.from_hf(facts)
    if isinstance(found, str):
        raise ConfigError(cfg.source, [("model", f"no architecture for {cfg.model!r}: {found} is not read for "
                                                 "compiling, and it is not a Hosted Training model "
                                                 f"({', '.join(catalog.HOSTED_MODELS)})")])
    try:
        return hf.load_config(download_config(found).parent)
    except ModelNotFoundError as exc:
        raise ConfigError(cfg.source, [("model", str(exc))]) from None


def teacher_model_of(cfg: RunConfig) -> ModelConfig | None:
    """An in-process teacher's architecture (`[jax.teacher] model`), found as `model_of` finds the student's
    (its folder, the HF cache, the catalogue, the Hub's `config.json`); None without one or with a server
    teacher. Raises ConfigError as `model_of` does, under the key `jax.teacher.model`, and for a jaxrl run
    named as the teacher (no `config.json` of its own)."""
    teacher = cfg.jax.teacher
    if teacher is None or teacher.model is None:
        return None
    as_model = cfg.model_copy(update={"model": teacher.model,
                                      "jax": cfg.jax.model_copy(update={"model_path": None, "model_revision": None})})
    as_model._source = cfg._source
    try:
        return model_of(as_model)
    except ConfigError as exc:
        raise ConfigError(cfg.source, [("jax.teacher.model", reason) for _, reason in exc.problems]) from None
    except FileNotFoundError as exc:  # a jaxrl run's folder: its architecture is its base model's
        raise ConfigError(cfg.source, [("jax.teacher.model", f"{exc}: `jaxrl compile` reads a teacher's "
                                        "architecture from a model folder, gs:// URL or Hub id; for a jaxrl run "
                                        "as the teacher, compile with its base model (or its export) named")]) \
            from None
