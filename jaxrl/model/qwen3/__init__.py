"""The Qwen3 family: transformers' `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` (HF model_type "qwen3" and
"qwen3_moe"): a decoder of RMSNorm, grouped-query attention with per-head q/k RMSNorm and full RoPE, and
a SwiGLU MLP or a top-k softmax-routed mixture of SwiGLU experts.

Its declarations (`jaxrl.model.family`): the config mapping (`config.py`), the weight names
(`weights.py`) and the layer kinds (`layers.py`), gathered in `FAMILY`, its entry in
`jaxrl.model.families.FAMILIES`. The math is the shared blocks'.
"""

from __future__ import annotations

from jaxrl.model.family import Family
from jaxrl.model.qwen3 import config, layers, weights

FAMILY = Family(
    name="qwen3",
    model_types=("qwen3", "qwen3_moe"),
    architectures={"Qwen3ForCausalLM": "qwen3 (dense)", "Qwen3MoeForCausalLM": "qwen3_moe (mixture of experts)"},
    config_fields=config.fields,
    config_json=config.to_json,
    weight_names=weights.NAMES,
    layer_kind=layers.kind,
    unused_tensor=weights.unused,
    layer_options=("decoder_sparse_step", "mlp_only_layers"),
)
