"""The GLM-4.5 MoE family's layer kinds: which feed-forward block each layer runs."""

from __future__ import annotations

from typing import Any

from jaxrl.model.family import LayerKind


def kind(cfg: Any, i: int) -> LayerKind:
    """"mlp" for the first `first_k_dense_replace` layers of a GLM-4.5 `ModelConfig`, "moe" after them
    (transformers' `Glm4MoeDecoderLayer`: `layer_idx >= first_k_dense_replace`)."""
    return "moe" if cfg.num_experts > 0 and i >= cfg.first_k_dense_replace else "mlp"
