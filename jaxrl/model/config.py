"""`ModelConfig`: the architecture of a checkpoint, read from its HF `config.json`.

One config for every family jaxrl runs, tagged by `family` (a key of `jaxrl.model.families.FAMILIES`).
Its fields are the shared blocks' options (`jaxrl.model.blocks`, `jaxrl.model.moe`): a family's config
mapping (`jaxrl/model/<family>/config.py`) fills them from its `config.json`, and its layer kinds
(`jaxrl/model/<family>/layers.py`) read the layer-kind options. Each option defaults to the plain
decoder's behaviour (Qwen3's), so a family sets only what it changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.model.families import FAMILIES, family


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a checkpoint of a registered family (Qwen3, Qwen3-MoE, GLM-4.5 MoE), read from its
    `config.json` by the family's config mapping (`from_hf`).

    Raises (at construction):
        ValueError: a family that is not registered, a layer option another family's layer kinds read set
            away from its default (`Family.layer_options`), or an option the shared blocks do not run
            (`n_shared_experts` above 1, experts not a multiple of `n_group`, `topk_group` above
            `n_group`, an odd rotary width).
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
    decoder_sparse_step: int = 1  # layer kinds (Qwen3-MoE): every this many layers has an MoE block
    mlp_only_layers: tuple[int, ...] = ()  # layer kinds (Qwen3-MoE): these layers have a dense MLP all the same
    family: str = "qwen3"  # the family's name (`jaxrl.model.families.FAMILIES`): "qwen3" or "glm4_moe"
    attention_bias: bool = False  # q/k/v projections have biases (GLM-4.5)
    use_qk_norm: bool = True  # RMSNorm on every query and key head before RoPE (Qwen3: always)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first int(head_dim * this) dims of a head
    first_k_dense_replace: int = 0  # layer kinds (GLM-4.5): the first this many layers have a dense MLP
    sigmoid_router: bool = False  # GLM-4.5's router: sigmoid scores, choice with e_score_correction_bias
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by this
    n_group: int = 1  # grouped top-k: experts in n_group groups, tokens choose among topk_group of them
    topk_group: int = 1
    n_shared_experts: int = 0  # always-on experts of width moe_intermediate_size (0 or 1)

    def __post_init__(self):
        self._check_layer_options()
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

    def _check_layer_options(self) -> None:
        """Refuse a layer option (any family's `layer_options`) that this family's layer kinds do not read,
        set away from its default: it would change nothing."""
        mine = family(self.family).layer_options
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in sorted({o for f in FAMILIES.values() for o in f.layer_options} - set(mine)):
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"{name} = {getattr(self, name)!r}: the {self.family} family's layer kinds do not "
                                 f"read it (they read {', '.join(mine) or 'no option'})")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json` dict, by the config mapping of the family its `model_type`
        names (`jaxrl.model.families.FAMILIES`); keys a checkpoint leaves out take transformers' defaults.

        Raises:
            ValueError: the `model_type` is no registered family's, a required key is missing, or an option
                is out of range (see the class).
        """
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type {model_type!r} is not supported (expected one of {sorted(FAMILIES)})")
        found = FAMILIES[model_type]
        try:
            return cls(family=found.name, **found.config_fields(hf))
        except KeyError as e:
            raise ValueError(f"config.json lacks the key {e.args[0]!r}") from None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (transformers' `int(head_dim * partial_rotary_factor)`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's feed-forward block, "mlp" or "moe", as the family's layer kinds say: the group of
        params (`mlp` [Q, ...] or `moe` [U, ...]) the layer reads."""
        kind = family(self.family).layer_kind
        return tuple(kind(self, i) for i in range(self.num_layers))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "moe")

    @property
    def mlp_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "mlp")

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict that `from_hf` reads back into this config (the family's mapping)."""
        return family(self.family).config_json(self)

    def dims(self) -> dict[str, int]:
        """Letter -> size, for the shapes of the declared weights (`jaxrl.model.modules`)."""
        return {
            "V": self.vocab_size, "D": self.hidden_size, "F": self.intermediate_size, "L": self.num_layers,
            "N": self.num_heads, "K": self.num_kv_heads, "H": self.head_dim,
            "E": self.num_experts, "I": self.moe_intermediate_size,
            "Q": len(self.mlp_layers), "U": len(self.moe_layers),
        }
