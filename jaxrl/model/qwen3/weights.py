"""The Qwen3 family's weight names: transformers' `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` tensor names
and layouts of each jaxrl weight (`jaxrl.model.family.WeightNames`), e.g.

    model.embed_tokens.weight                [V, D]    -> embed       [V, D]
    model.layers.{i}.self_attn.q_proj.weight [N*H, D]  -> wq          [L, D, N, H]
    model.layers.{i}.self_attn.o_proj.weight [D, N*H]  -> wo          [L, N, H, D]
    model.layers.{i}.mlp.down_proj.weight    [D, F]    -> mlp/w_down  [Q, F, D]  (layers with a dense MLP)
    model.layers.{i}.mlp.gate.weight         [E, D]    -> moe/router  [U, D, E]  (layers with an MoE block)
    model.layers.{i}.mlp.experts.{e}.up_proj.weight [I, D] -> moe/w_up [U, E, D, I]
    lm_head.weight                           [V, D]    -> unembed     [D, V]   (untied models only)

Checkpoints store each expert separately (as transformers 5 still saves them); jaxrl stacks them on an
`E` axis.
"""

from __future__ import annotations

from jaxrl.model.family import WeightNames

ATTENTION = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", ""),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", "D"),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", "D"),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", "D"),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", "NH"),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", ""),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", ""),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", ""),
}
MLP = {
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", "D"),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", "D"),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", "F"),
}
MOE = {
    "router": ("model.layers.{i}.mlp.gate.weight", "D"),
    "w_gate": ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "D"),
    "w_up": ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "D"),
    "w_down": ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "I"),
}
NAMES = WeightNames(
    top={
        "embed": ("model.embed_tokens.weight", ""),
        "final_norm": ("model.norm.weight", ""),
        "unembed": ("lm_head.weight", "D"),
    },
    groups={"layers": ATTENTION, "mlp": MLP, "moe": MOE},
)


def unused(name: str, num_layers: int) -> bool:
    """Whether a checkpoint's tensor `name` is one some Qwen3 checkpoints carry and the model does not use
    (RoPE's cached `rotary_emb.inv_freq`)."""
    return name.endswith("rotary_emb.inv_freq")
