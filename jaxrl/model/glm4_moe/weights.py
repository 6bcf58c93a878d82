"""The GLM-4.5 MoE family's weight names: Qwen3's (`jaxrl.model.qwen3.weights`), plus

    model.layers.{i}.self_attn.q_proj.bias   [N*H]     -> bq               [L, N, H]  (attention_bias)
    model.layers.{i}.mlp.gate.e_score_correction_bias [E] -> moe/e_bias   [U, E]
    model.layers.{i}.mlp.shared_experts.gate_proj.weight [I, D] -> moe/shared_gate [U, D, I]

and so on for `bk`, `bv`, `shared_up` and `shared_down` (`jaxrl.model.family.WeightNames`).
"""

from __future__ import annotations

from jaxrl.model.family import FLAT, WeightNames, layer_index
from jaxrl.model.qwen3 import weights as qwen3

NAMES = WeightNames(
    top=qwen3.NAMES.top,
    groups={
        "layers": qwen3.ATTENTION | {
            "bq": ("model.layers.{i}.self_attn.q_proj.bias", FLAT),
            "bk": ("model.layers.{i}.self_attn.k_proj.bias", FLAT),
            "bv": ("model.layers.{i}.self_attn.v_proj.bias", FLAT),
        },
        "mlp": qwen3.MLP,
        "moe": qwen3.MOE | {
            "e_bias": ("model.layers.{i}.mlp.gate.e_score_correction_bias", ""),
            "shared_gate": ("model.layers.{i}.mlp.shared_experts.gate_proj.weight", "D"),
            "shared_up": ("model.layers.{i}.mlp.shared_experts.up_proj.weight", "D"),
            "shared_down": ("model.layers.{i}.mlp.shared_experts.down_proj.weight", "I"),
        },
    },
)


def unused(name: str, num_layers: int) -> bool:
    """Whether a checkpoint's tensor `name` is one the model does not run: Qwen3's (`rotary_emb.inv_freq`),
    or a layer at or past `num_layers`, GLM-4.5's multi-token-prediction layers (transformers'
    `_keys_to_ignore_on_load_unexpected`)."""
    return qwen3.unused(name, num_layers) or layer_index(name) >= num_layers
