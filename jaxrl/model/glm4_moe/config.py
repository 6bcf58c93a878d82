"""The GLM-4.5 MoE family's config mapping: `config.json` (transformers' `Glm4MoeConfig`) to `ModelConfig`
fields and back. Keys a checkpoint leaves out take `Glm4MoeConfig`'s defaults."""

from __future__ import annotations

from typing import Any

from jaxrl.model.family import common_fields, common_json


def fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields of a "glm4_moe" `config.json`: the shared ones
    (`jaxrl.model.family.common_fields`, with GLM's `rms_norm_eps` 1e-5 and 131,072 positions), the
    experts (`n_routed_experts`), GLM's block options (q/k/v biases, qk-norm, partial RoPE, the sigmoid
    router and its grouping and scaling, shared experts) and its layer-kind option
    (`first_k_dense_replace`). `partial_rotary_factor` is read at the top level or in `rope_parameters`
    (transformers 5 moved it there)."""
    rope = hf.get("rope_parameters") or {}
    return common_fields(hf, rms_norm_eps=1e-5, max_position_embeddings=131072) | dict(
        num_experts=int(hf.get("n_routed_experts", 128)),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 1408)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
        use_qk_norm=bool(hf.get("use_qk_norm", False)),
        partial_rotary_factor=float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))),
        first_k_dense_replace=int(hf.get("first_k_dense_replace", 1)),
        sigmoid_router=True,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        n_shared_experts=int(hf.get("n_shared_experts", 1)),
    )


def to_json(cfg: Any) -> dict[str, Any]:
    """The `config.json` of a GLM-4.5 MoE `ModelConfig` (no multi-token-prediction layer:
    `num_nextn_predict_layers` 0)."""
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **common_json(cfg),
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor},
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "use_qk_norm": cfg.use_qk_norm,
        "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "routed_scaling_factor": cfg.routed_scaling_factor, "n_group": cfg.n_group,
        "topk_group": cfg.topk_group, "n_shared_experts": cfg.n_shared_experts,
        "num_nextn_predict_layers": 0,
    }
