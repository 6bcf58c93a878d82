"""`ModelConfig`: the architecture of a checkpoint, read from its HF `config.json`.

One config for every family jaxrl runs, tagged by `family`:
  * "qwen3": transformers' `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` (model_type "qwen3" / "qwen3_moe");
  * "glm4_moe": transformers' `Glm4MoeForCausalLM` (GLM-4.5, GLM-4.5-Air, PrimeIntellect/INTELLECT-3;
    `transformers/models/glm4_moe/modeling_glm4_moe.py`): the same decoder with q/k/v biases
    (`attention_bias`), optional per-head q/k RMSNorm (`use_qk_norm`), RoPE on the first
    `partial_rotary_factor` of each head's dims, dense MLPs in the first `first_k_dense_replace` layers,
    a sigmoid router whose choice adds `e_score_correction_bias` and may be grouped (`n_group`,
    `topk_group`), weights scaled by `routed_scaling_factor`, and `n_shared_experts` always-on experts.
The fields that the GLM options add default to Qwen3's behaviour, so one model code serves both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FAMILIES = {"qwen3": ("qwen3", "qwen3_moe"), "glm4_moe": ("glm4_moe",)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3, Qwen3-MoE or GLM-4.5 (`glm4_moe`) checkpoint, read from its `config.json`.

    Raises (at construction):
        ValueError: an option this model code does not run (`n_shared_experts` above 1, experts not a
            multiple of `n_group`, `topk_group` above `n_group`, an odd rotary width).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    num_experts: int = 0  # 0: a dense Qwen3
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    family: str = "qwen3"  # "qwen3" or "glm4_moe" (FAMILIES)
    attention_bias: bool = False  # q/k/v projections have biases (GLM-4.5)
    use_qk_norm: bool = True  # RMSNorm on every query and key head before RoPE (Qwen3: always)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first int(head_dim * this) dims of a head
    first_k_dense_replace: int = 0  # the first this many layers have a dense MLP (GLM-4.5)
    sigmoid_router: bool = False  # GLM-4.5's router: sigmoid scores, choice with e_score_correction_bias
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by this
    n_group: int = 1  # grouped top-k: experts in n_group groups, tokens choose among topk_group of them
    topk_group: int = 1
    n_shared_experts: int = 0  # always-on experts of width moe_intermediate_size (0 or 1)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not one of {sorted(FAMILIES)}")
        if self.n_shared_experts not in (0, 1):
            raise ValueError(f"n_shared_experts = {self.n_shared_experts}: jaxrl runs 0 or 1 shared expert "
                             "(GLM-4.5 and GLM-4.5-Air have 1)")
        if self.num_experts and (self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group):
            raise ValueError(f"{self.num_experts} experts in n_group = {self.n_group} groups choosing "
                             f"topk_group = {self.topk_group}: the groups must divide the experts and "
                             "0 < topk_group <= n_group")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"partial_rotary_factor = {self.partial_rotary_factor} of head_dim "
                             f"{self.head_dim} gives {self.rotary_dim} rotary dims; it must be even and > 0")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json` dict; keys a checkpoint leaves out take transformers'
        defaults (`Qwen3Config`, `Qwen3MoeConfig`, `Glm4MoeConfig`).

        Raises:
            ValueError: the architecture is not Qwen3, Qwen3-MoE or GLM-4.5 MoE, a required key is
                missing, or an option is out of range (see the class).
        """
        model_type = hf.get("model_type")
        if model_type not in FAMILIES["qwen3"] + FAMILIES["glm4_moe"]:
            raise ValueError(f"model_type {model_type!r} is not supported (expected 'qwen3', 'qwen3_moe' "
                             "or 'glm4_moe')")
        rope = hf.get("rope_parameters") or {}
        glm = model_type == "glm4_moe"
        try:
            n_heads = hf["num_attention_heads"]
            moe: dict[str, Any] = {}
            if model_type == "qwen3_moe":
                moe = dict(
                    num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
                    num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                    mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
                )
            if glm:  # Glm4MoeConfig's defaults for what a config.json leaves out
                moe = dict(
                    family="glm4_moe",
                    num_experts=int(hf.get("n_routed_experts", 128)),
                    num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
                    moe_intermediate_size=int(hf.get("moe_intermediate_size", 1408)),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                    attention_bias=bool(hf.get("attention_bias", False)),
                    use_qk_norm=bool(hf.get("use_qk_norm", False)),
                    partial_rotary_factor=float(hf.get("partial_rotary_factor",
                                                       rope.get("partial_rotary_factor", 0.5))),
                    first_k_dense_replace=int(hf.get("first_k_dense_replace", 1)),
                    sigmoid_router=True,
                    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                    n_group=int(hf.get("n_group") or 1),
                    topk_group=int(hf.get("topk_group") or 1),
                    n_shared_experts=int(hf.get("n_shared_experts", 1)),
                )
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=n_heads,
                num_kv_heads=hf.get("num_key_value_heads", n_heads),
                head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
                rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 1e6))),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5 if glm else 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 131072 if glm else 40960)),
                **moe,
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the key {e.args[0]!r}") from None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_glm(self) -> bool:
        return self.family == "glm4_moe"

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (transformers' `int(head_dim * partial_rotary_factor)`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_is_moe(self, i: int) -> bool:
        """Whether layer `i` has an MoE block (transformers' Qwen3MoeDecoderLayer rule, and
        Glm4MoeDecoderLayer's `layer_idx >= first_k_dense_replace`)."""
        return (self.num_experts > 0 and i >= self.first_k_dense_replace and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.layer_is_moe(i))

    @property
    def mlp_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.layer_is_moe(i))

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict that `from_hf` reads back into this config."""
        common = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "torch_dtype": "float32",
        }
        if self.is_glm:
            return {
                "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **common,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                    "partial_rotary_factor": self.partial_rotary_factor},
                "partial_rotary_factor": self.partial_rotary_factor,
                "use_qk_norm": self.use_qk_norm,
                "n_routed_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "first_k_dense_replace": self.first_k_dense_replace,
                "routed_scaling_factor": self.routed_scaling_factor, "n_group": self.n_group,
                "topk_group": self.topk_group, "n_shared_experts": self.n_shared_experts,
                "num_nextn_predict_layers": 0,
            }
        moe = {}
        if self.is_moe:
            moe = {
                "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers),
            }
        return {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
            **common,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            **moe,
        }

    def dims(self) -> dict[str, int]:
        """Letter -> size, for the shapes of the declared weights (`jaxrl.model.modules`)."""
        return {
            "V": self.vocab_size, "D": self.hidden_size, "F": self.intermediate_size, "L": self.num_layers,
            "N": self.num_heads, "K": self.num_kv_heads, "H": self.head_dim,
            "E": self.num_experts, "I": self.moe_intermediate_size,
            "Q": len(self.mlp_layers), "U": len(self.moe_layers),
        }
