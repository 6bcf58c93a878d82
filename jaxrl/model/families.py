"""The registry of model families, keyed by HF `config.json` `model_type`: adding a family is its folder
(`jaxrl/model/<name>/`, declaring a `jaxrl.model.family.Family`) and its entry in `_REGISTERED`.
Nothing here imports JAX."""

from __future__ import annotations

from jaxrl.model import glm4_moe, qwen3
from jaxrl.model.family import Family

_REGISTERED = (
    qwen3.FAMILY,
    glm4_moe.FAMILY,
)

FAMILIES: dict[str, Family] = {model_type: f for f in _REGISTERED for model_type in f.model_types}
"""HF model_type -> its family ("qwen3" and "qwen3_moe" -> Qwen3's, "glm4_moe" -> GLM-4.5's)."""


def family(name: str) -> Family:
    """The family named `name` (`ModelConfig.family`, one of its model types).

    Raises:
        ValueError: no registered family has that name.
    """
    found = FAMILIES.get(name)
    if found is None or found.name != name:
        raise ValueError(f"family {name!r} is not one of {sorted(f.name for f in _REGISTERED)}")
    return found
