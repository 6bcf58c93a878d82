"""The Qwen3 family's config mapping: `config.json` (transformers' `Qwen3Config`, `Qwen3MoeConfig`) to
`ModelConfig` fields and back. Keys a checkpoint leaves out take transformers' defaults."""

from __future__ import annotations

from typing import Any

from jaxrl.model.family import common_fields, common_json


def fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields of a "qwen3" or "qwen3_moe" `config.json`: the shared ones
    (`jaxrl.model.family.common_fields`) and, for "qwen3_moe", the experts (`num_experts`, or Mixtral's
    `num_local_experts`), the routing (`norm_topk_prob`) and the layer-kind options (`decoder_sparse_step`,
    `mlp_only_layers`).

    Raises:
        KeyError: a required key is missing (`num_experts_per_tok`, `moe_intermediate_size` for MoE).
    """
    out = common_fields(hf, rms_norm_eps=1e-6, max_position_embeddings=40960)
    if hf["model_type"] == "qwen3_moe":
        out |= dict(
            num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        )
    return out


def to_json(cfg: Any) -> dict[str, Any]:
    """The `config.json` of a Qwen3 (`cfg.num_experts` 0) or Qwen3-MoE `ModelConfig`, with Qwen3's
    bos/eos ids."""
    moe = {}
    if cfg.is_moe:
        moe = {
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": list(cfg.mlp_only_layers),
        }
    return {
        "architectures": ["Qwen3MoeForCausalLM" if cfg.is_moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if cfg.is_moe else "qwen3",
        **common_json(cfg),
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        **moe,
    }
