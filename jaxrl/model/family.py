"""What a model family declares (`Family`), the one entry of the registry `jaxrl.model.families.FAMILIES`.

A family is one folder, `jaxrl/model/<model_type>/`, over the shared blocks (`jaxrl.model.blocks`,
`jaxrl.model.attention`, `jaxrl.model.moe`, the LoRA of `jaxrl.model.modules`): it declares
  (a) its config mapping: the `ModelConfig` fields of its HF `config.json`, and back;
  (b) its weight names: the HF tensor name and layout of each jaxrl weight (`WeightNames`), which load,
      export and the PEFT adapter read and write;
  (c) its layer kinds: which feed-forward block ("mlp" or "moe") each layer runs.
Nothing here imports JAX (`jaxrl validate` and `jaxrl models` read the registry) nor `jaxrl.model.config`
(whose `ModelConfig` reads the registry): a family's functions take the config as its fields, duck-typed.
The recipe for a new family: docs/developing.md, "A new model family".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

FLAT = "*"
"""A `WeightNames` layout: HF stores the weight's [heads, head] as one flat vector (a Linear's bias)."""

LayerKind = Literal["mlp", "moe"]


@dataclasses.dataclass(frozen=True)
class WeightNames:
    """The HF tensor of each jaxrl weight: our name -> (HF name, layout).

    HF stores each layer (and each expert) separately and a Linear's weight as [out, in]; jaxrl stacks
    layers (and experts) on leading axes and keeps a weight as [in..., out...] with heads split out
    (`jaxrl.model.modules.param_specs`). In an HF name `{i}` stands for the layer's index in the
    checkpoint and `{e}` for the expert's (an `{e}` adds a second stack axis). The layout is the letters of
    our shape (after the stack axes) that HF stores last, as a Linear's input ("" = the same layout), or
    `FLAT` (HF's one vector for our [heads, head]).

    top: the unstacked weights (`embed`, `final_norm`, `unembed`).
    groups: the stacked ones, by group: `layers` (attention and norms, [L, ...]), `mlp` (dense MLPs,
        [Q, ...]) and `moe` (router and experts, [U, ...]).
    """

    top: dict[str, tuple[str, str]]
    groups: dict[str, dict[str, tuple[str, str]]]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: the HF model types it reads and what it declares (the module docstring's a-c).

    name: its folder under `jaxrl/model/` and the `ModelConfig.family` of its configs (one of its
        model types).
    model_types: the HF `config.json` `model_type`s it reads; each is a key of `FAMILIES`.
    architectures: HF architecture class -> a line for `jaxrl models`.
    config_fields: (a) a parsed `config.json` -> the `ModelConfig` fields (keyword arguments); a missing
        required key raises KeyError (`ModelConfig.from_hf` names it).
    config_json: (a) back: a `ModelConfig` -> the `config.json` dict that `config_fields` reads back.
    weight_names: (b) the HF names and layouts of its weights.
    layer_kind: (c) `(config, layer index) -> "mlp" | "moe"`: the feed-forward block that layer runs.
    unused_tensor: `(HF tensor name, config's layer count) -> bool`: a tensor its checkpoints may carry that
        the model does not run (load skips it; any other unknown tensor is an error).
    layer_options: (c) the `ModelConfig` fields its `layer_kind` reads (Qwen3-MoE's `decoder_sparse_step`,
        `mlp_only_layers`; GLM-4.5's `first_k_dense_replace`); a config of this family with another
        family's layer option away from its default is refused, not silently run otherwise.
    """

    name: str
    model_types: tuple[str, ...]
    architectures: dict[str, str]
    config_fields: Callable[[dict[str, Any]], dict[str, Any]]
    config_json: Callable[[Any], dict[str, Any]]
    weight_names: WeightNames
    layer_kind: Callable[[Any, int], LayerKind]
    unused_tensor: Callable[[str, int], bool]
    layer_options: tuple[str, ...] = ()


def common_fields(hf: dict[str, Any], *, rms_norm_eps: float, max_position_embeddings: int) -> dict[str, Any]:
    """The `ModelConfig` fields every decoder's `config.json` spells alike, with the family's defaults
    for the two whose transformers default differs (`rms_norm_eps`, `max_position_embeddings`).

    Raises:
        KeyError: a required key (`vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
            `num_attention_heads`) is missing.
    """
    rope = hf.get("rope_parameters") or {}
    n_heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=hf.get("num_key_value_heads", n_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 1e6))),
        rms_norm_eps=float(hf.get("rms_norm_eps", rms_norm_eps)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", max_position_embeddings)),
    )


def common_json(cfg: Any) -> dict[str, Any]:
    """The `config.json` keys of `common_fields` (and the activation, biases and dtype every family writes)
    for a `ModelConfig`."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": cfg.attention_bias,
        "torch_dtype": "float32",
    }


def layer_index(name: str) -> int:
    """The layer index of a `model.layers.{i}.` HF tensor name; -1 for other names."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit() else -1
