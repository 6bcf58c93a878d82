"""Qwen3 (dense) in JAX over a params pytree, with LoRA and a KV cache.

Letters used in names and einsums:
  B batch   T query positions   S key positions (KV cache length)   L layers
  D model   N query heads       K kv heads       G query heads per kv head (N // K)
  H head    F MLP hidden        V vocabulary     R LoRA rank

The architecture follows transformers' `Qwen3ForCausalLM` (RMSNorm before attention and MLP, RMSNorm
on every query and key head before RoPE, grouped-query attention, SwiGLU MLP). Each weight is declared
once in `param_specs`; initialisation (`init_params`), shardings (`jaxrl.sharding`) and checkpoint
restore targets are derived from that one declaration. Layers are stacked on a leading `L` axis and run
with `jax.lax.scan`, so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]
KVCache = dict[str, jax.Array]  # {"k": [L,B,S,K,H], "v": [L,B,S,K,H]}

# HF projection name -> (our weight name, input letters, output letters)
LORA_TARGETS: dict[str, tuple[str, str, str]] = {
    "q_proj": ("wq", "D", "NH"),
    "k_proj": ("wk", "D", "KH"),
    "v_proj": ("wv", "D", "KH"),
    "o_proj": ("wo", "NH", "D"),
    "gate_proj": ("w_gate", "D", "F"),
    "up_proj": ("w_up", "D", "F"),
    "down_proj": ("w_down", "F", "D"),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3 checkpoint, read from its HF `config.json`."""

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

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json` dict.

        Raises:
            ValueError: the architecture is not Qwen3, or a required key is missing.
        """
        model_type = hf.get("model_type")
        if model_type != "qwen3":
            raise ValueError(f"model_type {model_type!r} is not supported (expected 'qwen3')")
        try:
            n_heads = hf["num_attention_heads"]
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=n_heads,
                num_kv_heads=hf.get("num_key_value_heads", n_heads),
                head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
                rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 1e6))),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the key {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict that `from_hf` reads back into this config."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
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
            "attention_bias": False,
            "torch_dtype": "float32",
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        }

    def dims(self) -> dict[str, int]:
        """Letter -> size, for the shapes in `param_specs`."""
        return {
            "V": self.vocab_size, "D": self.hidden_size, "F": self.intermediate_size, "L": self.num_layers,
            "N": self.num_heads, "K": self.num_kv_heads, "H": self.head_dim,
        }


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight: its shape letters, logical axis names (one per letter) and initialiser.

    `init` is "normal" (std 0.02, as HF's `initializer_range`), "ones" or "zeros".
    """

    letters: str
    axes: tuple[str | None, ...]
    init: str = "normal"

    def shape(self, dims: dict[str, int]) -> tuple[int, ...]:
        return tuple(dims[c] for c in self.letters)


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
    """The declaration of every base weight (a pytree of `ParamSpec` with the params' structure)."""
    layers = {
        "attn_norm": ParamSpec("LD", ("layers", "embed"), "ones"),
        "wq": ParamSpec("LDNH", ("layers", "embed", "heads", "head_dim")),
        "wk": ParamSpec("LDKH", ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ParamSpec("LDKH", ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ParamSpec("LNHD", ("layers", "heads", "head_dim", "embed")),
        "q_norm": ParamSpec("LH", ("layers", "head_dim"), "ones"),
        "k_norm": ParamSpec("LH", ("layers", "head_dim"), "ones"),
        "mlp_norm": ParamSpec("LD", ("layers", "embed"), "ones"),
        "w_gate": ParamSpec("LDF", ("layers", "embed", "mlp")),
        "w_up": ParamSpec("LDF", ("layers", "embed", "mlp")),
        "w_down": ParamSpec("LFD", ("layers", "mlp", "embed")),
    }
    specs: dict[str, Any] = {
        "embed": ParamSpec("VD", ("vocab", "embed")),
        "layers": layers,
        "final_norm": ParamSpec("D", ("embed",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["unembed"] = ParamSpec("DV", ("embed", "vocab"))
    return specs


def lora_specs(cfg: ModelConfig, rank: int, targets: tuple[str, ...]) -> dict[str, Any]:
    """Declarations of the LoRA factors: for each HF target `t`, `a` [L, in, R] and `b` [L, R, out].

    `b` starts at zero so a fresh adapter leaves the model unchanged (LoRA, Hu et al. 2021, sec. 4.1).
    """
    specs = {}
    for t in targets:
        name, fan_in, fan_out = LORA_TARGETS[t]
        specs[name] = {
            "a": ParamSpec("L" + fan_in + "R", ("layers", *_lora_axes(fan_in), None), "normal"),
            "b": ParamSpec("LR" + fan_out, ("layers", None, *_lora_axes(fan_out)), "zeros"),
        }
    return {"layers": specs}


def _lora_axes(letters: str) -> tuple[str | None, ...]:
    names = {"D": "embed", "F": "mlp", "N": "heads", "K": "kv_heads", "H": "head_dim"}
    return tuple(names[c] for c in letters)


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def init_from_specs(specs: Any, dims: dict[str, int], key: jax.Array, dtype: Any) -> Any:
    """Random weights for a pytree of `ParamSpec` (normal std 0.02, or ones / zeros)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys, strict=True):
        shape = spec.shape(dims)
        if spec.init == "ones":
            out.append(jnp.ones(shape, dtype))
        elif spec.init == "zeros":
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random base weights with the structure of `param_specs(cfg)`."""
    return init_from_specs(param_specs(cfg), cfg.dims(), key, dtype)


def init_lora(cfg: ModelConfig, rank: int, targets: tuple[str, ...], key: jax.Array,
              dtype: Any = jnp.float32) -> Params:
    """Fresh LoRA factors (`b` = 0) for `targets` at `rank`."""
    return init_from_specs(lora_specs(cfg, rank, targets), {**cfg.dims(), "R": rank}, key, dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis, computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    w = w.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + w.shape)
    return (y * w).astype(x.dtype)


def rope(x_BTXH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al. 2021) in HF's rotate-half layout, any head count X."""
    h = x_BTXH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    ang_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None]
    cos = jnp.cos(ang_BTh)[:, :, None, :]
    sin = jnp.sin(ang_BTh)[:, :, None, :]
    x = x_BTXH.astype(jnp.float32)
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTXH.dtype)


def _lora_delta(x: jax.Array, ab: dict[str, jax.Array] | None, scale: float, out_shape: tuple[int, ...]):
    if ab is None:
        return 0.0
    flat = x.reshape(*x.shape[:2], -1)
    delta = jnp.einsum("BTI,IR,RO->BTO", flat, ab["a"].reshape(-1, ab["a"].shape[-1]),
                       ab["b"].reshape(ab["b"].shape[0], -1))
    return (scale * delta).reshape(*x.shape[:2], *out_shape).astype(x.dtype)


def _layer(cfg: ModelConfig, lora_scale: float, x_BTD, positions_BT, w, lw, k_cache, v_cache, key_pos_BS):
    """One decoder layer. Returns the new residual stream and this layer's full key/value cache."""
    b, t, _ = x_BTD.shape
    nk, g, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    lw = lw or {}

    h_BTD = rms_norm(x_BTD, w["attn_norm"], cfg.rms_norm_eps)
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, w["wq"]) + _lora_delta(h_BTD, lw.get("wq"), lora_scale,
                                                                         (cfg.num_heads, hd))
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, w["wk"]) + _lora_delta(h_BTD, lw.get("wk"), lora_scale, (nk, hd))
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, w["wv"]) + _lora_delta(h_BTD, lw.get("wv"), lora_scale, (nk, hd))
    q_BTNH = rope(rms_norm(q_BTNH, w["q_norm"], cfg.rms_norm_eps), positions_BT, cfg.rope_theta)
    k_BTKH = rope(rms_norm(k_BTKH, w["k_norm"], cfg.rms_norm_eps), positions_BT, cfg.rope_theta)

    if k_cache is None:  # self-attention over this chunk (training, prefill)
        k_BSKH, v_BSKH = k_BTKH, v_BTKH
    else:  # write this chunk at its positions, then attend over the whole cache (decode)
        rows = jnp.arange(b)[:, None]
        k_BSKH = k_cache.at[rows, positions_BT].set(k_BTKH.astype(k_cache.dtype))
        v_BSKH = v_cache.at[rows, positions_BT].set(v_BTKH.astype(v_cache.dtype))

    q_BTKGH = q_BTNH.reshape(b, t, nk, g, hd)
    scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH.astype(q_BTKGH.dtype)).astype(jnp.float32)
    scores_BKGTS = scores_BKGTS / math.sqrt(hd)
    mask_BTS = key_pos_BS[:, None, :] <= positions_BT[:, :, None]
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, -1e30)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(x_BTD.dtype)
    attn_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH.astype(x_BTD.dtype))
    attn_BTNH = attn_BTKGH.reshape(b, t, cfg.num_heads, hd)
    out_BTD = jnp.einsum("BTNH,NHD->BTD", attn_BTNH, w["wo"]) + _lora_delta(attn_BTNH, lw.get("wo"), lora_scale,
                                                                             (cfg.hidden_size,))
    x_BTD = x_BTD + out_BTD

    h_BTD = rms_norm(x_BTD, w["mlp_norm"], cfg.rms_norm_eps)
    f = (cfg.intermediate_size,)
    gate_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, w["w_gate"]) + _lora_delta(h_BTD, lw.get("w_gate"), lora_scale, f)
    up_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, w["w_up"]) + _lora_delta(h_BTD, lw.get("w_up"), lora_scale, f)
    act_BTF = jax.nn.silu(gate_BTF) * up_BTF
    down_BTD = jnp.einsum("BTF,FD->BTD", act_BTF, w["w_down"]) + _lora_delta(act_BTF, lw.get("w_down"), lora_scale,
                                                                            (cfg.hidden_size,))
    return x_BTD + down_BTD, k_BSKH, v_BSKH


def forward(
    cfg: ModelConfig,
    params: Params,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    *,
    lora: Params | None = None,
    lora_scale: float = 0.0,
    cache: KVCache | None = None,
    remat: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Run the decoder stack; return final-norm hidden states and the key/value cache.

    Args:
        tokens_BT: int32 token ids [B, T].
        positions_BT: int32 absolute positions [B, T]. A query attends to keys whose position is <= its
            own, so right padding (positions after the real tokens) is never attended to by real tokens.
        lora: LoRA factors from `init_lora` (or None); their product is scaled by `lora_scale`
            (alpha / rank).
        cache: None to attend within `tokens_BT` (training, prefill); or a cache {"k","v"} of shape
            [L, B, S, K, H] where index s holds position s: the chunk is written at `positions_BT` and
            attends to every cache entry at a position <= its own (decode).
        remat: rematerialise each layer's activations in the backward pass.

    Returns:
        hidden_BTD in the params' dtype, and {"k","v"}: [L, B, T, K, H] (no cache given) or the
        updated [L, B, S, K, H] cache.
    """
    x_BTD = params["embed"][tokens_BT]
    b = tokens_BT.shape[0]
    if cache is None:
        key_pos_BS = positions_BT
    else:
        s = cache["k"].shape[2]
        key_pos_BS = jnp.broadcast_to(jnp.arange(s, dtype=positions_BT.dtype), (b, s))
    lora_layers = None if lora is None else lora["layers"]

    def body(x, xs):
        w, lw, kc, vc = xs
        x, k, v = _layer(cfg, lora_scale, x, positions_BT, w, lw, kc, vc, key_pos_BS)
        return x, (k, v)

    if remat:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    xs = (params["layers"], lora_layers,
          None if cache is None else cache["k"], None if cache is None else cache["v"])
    x_BTD, (k_L, v_L) = jax.lax.scan(body, x_BTD, xs)
    return rms_norm(x_BTD, params["final_norm"], cfg.rms_norm_eps), {"k": k_L, "v": v_L}


def unembed_matrix(params: Params) -> jax.Array:
    """The output projection [D, V]: `unembed`, or the transposed input embedding when tied."""
    return params["unembed"] if "unembed" in params else params["embed"].T


def logits(params: Params, hidden_BTD: jax.Array) -> jax.Array:
    """fp32 logits [B, T, V] from final hidden states [B, T, D]."""
    return jnp.einsum("BTD,DV->BTV", hidden_BTD, unembed_matrix(params)).astype(jnp.float32)
