"""The GLM-4.5 MoE family: transformers' `Glm4MoeForCausalLM` (HF model_type "glm4_moe": GLM-4.5,
GLM-4.5-Air, PrimeIntellect/INTELLECT-3; `transformers/models/glm4_moe/modeling_glm4_moe.py`).

Qwen3-MoE's decoder with these options of the shared blocks: q/k/v biases (`attention_bias`), optional
per-head q/k RMSNorm (`use_qk_norm`), RoPE on the first `partial_rotary_factor` of each head's dims, a
sigmoid router whose choice adds `e_score_correction_bias` and may be grouped (`n_group`, `topk_group`),
weights scaled by `routed_scaling_factor`, and `n_shared_experts` always-on experts; and its own layer
kinds, dense MLPs in the first `first_k_dense_replace` layers.

Its declarations (`jaxrl.model.family`): the config mapping (`config.py`), the weight names
(`weights.py`), the layer kinds (`layers.py`), gathered in `FAMILY`, its entry in
`jaxrl.model.families.FAMILIES`; and, for the offline tiny model only, GLM-4.5's chat format and special
tokens (`tokenizer.py`).
"""

from __future__ import annotations

from jaxrl.model.family import Family
from jaxrl.model.glm4_moe import config, layers, weights

FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    architectures={"Glm4MoeForCausalLM": "glm4_moe (GLM-4.5 mixture of experts)"},
    config_fields=config.fields,
    config_json=config.to_json,
    weight_names=weights.NAMES,
    layer_kind=layers.kind,
    unused_tensor=weights.unused,
    layer_options=("first_k_dense_replace",),
)
