"""The Qwen3 family's layer kinds: which feed-forward block each layer runs."""

from __future__ import annotations

from typing import Any

from jaxrl.model.family import LayerKind


def kind(cfg: Any, i: int) -> LayerKind:
    """"moe" where layer `i` of a Qwen3-MoE `ModelConfig` has an MoE block, else "mlp": transformers'
    `Qwen3MoeDecoderLayer` rule (experts, `i` not in `mlp_only_layers`, `(i + 1) % decoder_sparse_step`
    0). A dense Qwen3 is "mlp" throughout."""
    moe = cfg.num_experts > 0 and i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0
    return "moe" if moe else "mlp"
