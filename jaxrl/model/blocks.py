"""The shared blocks every model family's layers are built from, as pure functions over a layer's weights:
RMSNorm, RoPE (full or partial), the projections and their LoRA deltas, attention's inputs (norm, q/k/v
with optional biases and per-head norms, RoPE), the SwiGLU MLP and the feed-forward half of a layer (a
dense MLP, or the MoE block of `jaxrl.model.moe` with an optional shared expert).

A block takes its options from the `ModelConfig` (`attention_bias`, `use_qk_norm`, `rotary_dim`,
`sigmoid_router`, `n_shared_experts`, ...), which each family's config mapping fills
(`jaxrl.model.families`); no block asks which family it runs in. The attention kernels are
`jaxrl.model.attention`; the decoder that stacks these blocks is `jaxrl.model.decoder`, whose docstring
holds the letter table used in names here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.model import moe
from jaxrl.model.config import ModelConfig

Params = dict[str, Any]

# HF projection name -> (our weight name, how many of its non-stack axes are the projection's input)
LORA_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("wq", 1),
    "k_proj": ("wk", 1),
    "v_proj": ("wv", 1),
    "o_proj": ("wo", 2),
    "gate_proj": ("w_gate", 1),
    "up_proj": ("w_up", 1),
    "down_proj": ("w_down", 1),
}



def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis, computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    w = w.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + w.shape)
    return (y * w).astype(x.dtype)


def rope(x_BTZH: jax.Array, positions_BT: jax.Array, theta: float, rotary_dim: int | None = None) -> jax.Array:
    """Rotary position embedding (Su et al. 2021) in HF's rotate-half layout, over either head axis (Z: N or K).

    With `rotary_dim` < H (partial RoPE, GLM-4.5's `partial_rotary_factor`) only each head's first
    `rotary_dim` dims rotate, as a rotate-half RoPE of that width (frequencies `theta ** (-2i / rotary_dim)`),
    and the rest pass unchanged: transformers' `glm4_moe` `apply_rotary_pos_emb` (`q_rot, q_pass`) and
    `Glm4MoeRotaryEmbedding.compute_default_rope_parameters`. None: all H dims rotate."""
    h = x_BTZH.shape[-1]
    r = h if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (theta ** (jnp.arange(0, r, 2, dtype=jnp.float32) / r))
    ang_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None]
    cos = jnp.cos(ang_BTh)[:, :, None, :]
    sin = jnp.sin(ang_BTh)[:, :, None, :]
    x = x_BTZH.astype(jnp.float32)
    x1, x2, rest = x[..., : r // 2], x[..., r // 2: r], x[..., r:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x_BTZH.dtype)


def project(x: jax.Array, w: jax.Array) -> jax.Array:
    """The projection [B, T, O...] of `x` [B, T, Y...] by `w` [Y..., O...], contracting all of `x`'s axes
    after B and T, as one [B * T, Y] @ [Y, O] matmul (tokens and the weight's input and output axes
    flattened: free reshapes of row-major arrays), so the gradient with respect to `x` is a plain
    `dy @ w.T` (with the axes apart, XLA's CPU backend transposed a weight of several input or output axes
    into a copy each backward pass; docs/benchmarks.md, 2026-11-26). The rollout engine on CPU passes its
    output-major weights here (`jaxrl.model.cpu.OutMajor`, which takes the `@`)."""
    x_MY = x.reshape(x.shape[0] * x.shape[1], -1)
    out_shape = w.shape[x.ndim - 2:]
    return (x_MY @ w.reshape(x_MY.shape[1], -1)).reshape(*x.shape[:2], *out_shape)


def lora_delta(x: jax.Array, ab: dict[str, jax.Array] | None, scale: float, out_shape: tuple[int, ...]):
    """`scale * x @ a.T @ b` for one adapted weight (`a` [R, Y...] rank-major as `modules.LoRA` declares
    it, `b` [R, O...]), its input axes (all of `x`'s after B, T) flattened and its output reshaped to
    `out_shape`, in `x`'s dtype; 0.0 for no LoRA (`ab` None).

    The tokens are flattened too, [B * T, Y] @ [R, Y].T @ [R, O]: the factors' gradients then contract one
    token axis (a plain matmul), where with B and T apart XLA's CPU backend transposed each [B, T, O]
    output gradient first (docs/benchmarks.md, 2026-11-26)."""
    if ab is None:
        return 0.0
    flat_MY = x.reshape(x.shape[0] * x.shape[1], -1)
    a_RY, b_RO = ab["a"].reshape(ab["a"].shape[0], -1), ab["b"].reshape(ab["b"].shape[0], -1)
    delta_MO = jax.lax.dot_general(flat_MY, a_RY, (((1,), (1,)), ((), ()))) @ b_RO
    return (scale * delta_MO).reshape(*x.shape[:2], *out_shape).astype(x.dtype)


def attention_inputs(cfg: ModelConfig, lora_scale: float, x_BTD: jax.Array, positions_BT: jax.Array, w: Params,
                     lw: Params | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The queries, keys and values of one layer's attention (training, prefill and decode alike): RMSNorm
    of the residual stream `x_BTD`, the q/k/v projections with their LoRA (`lw`, None: none) and biases
    (`bq`, `bk`, `bv` where `cfg.attention_bias`), RMSNorm per query and key head (where
    `cfg.use_qk_norm`), RoPE on each head's first `cfg.rotary_dim` dims at `positions_BT` (int32 [B, T]);
    the order of transformers' `Qwen3Attention` and `Glm4MoeAttention`. `w`: the layer's `layers` weights.
    Returns q [B, T, N, H], k and v [B, T, K, H], in `x_BTD`'s dtype."""
    nk, hd = cfg.num_kv_heads, cfg.head_dim
    lw = lw or {}
    h_BTD = rms_norm(x_BTD, w["attn_norm"], cfg.rms_norm_eps)
    q_BTNH = project(h_BTD, w["wq"]) + lora_delta(h_BTD, lw.get("wq"), lora_scale,
                                                                        (cfg.num_heads, hd))
    k_BTKH = project(h_BTD, w["wk"]) + lora_delta(h_BTD, lw.get("wk"), lora_scale, (nk, hd))
    v_BTKH = project(h_BTD, w["wv"]) + lora_delta(h_BTD, lw.get("wv"), lora_scale, (nk, hd))
    if cfg.attention_bias:
        q_BTNH, k_BTKH, v_BTKH = (y + w[b].astype(y.dtype)[None, None] for y, b in ((q_BTNH, "bq"), (k_BTKH, "bk"),
                                                                       (v_BTKH, "bv")))
    if cfg.use_qk_norm:
        q_BTNH = rms_norm(q_BTNH, w["q_norm"], cfg.rms_norm_eps)
        k_BTKH = rms_norm(k_BTKH, w["k_norm"], cfg.rms_norm_eps)
    rot = None if cfg.rotary_dim == hd else cfg.rotary_dim
    q_BTNH = rope(q_BTNH, positions_BT, cfg.rope_theta, rot)
    k_BTKH = rope(k_BTKH, positions_BT, cfg.rope_theta, rot)
    return q_BTNH, k_BTKH, v_BTKH


def _mlp(cfg: ModelConfig, lora_scale: float, h_BTD, w, lw, width: int | None = None) -> jax.Array:
    """A SwiGLU MLP (no residual) of `width` (None: `cfg.intermediate_size`, the dense MLP's)."""
    lw = lw or {}
    f = (width or cfg.intermediate_size,)
    gate_BTF = project(h_BTD, w["w_gate"]) + lora_delta(h_BTD, lw.get("w_gate"), lora_scale, f)
    up_BTF = project(h_BTD, w["w_up"]) + lora_delta(h_BTD, lw.get("w_up"), lora_scale, f)
    act_BTF = jax.nn.silu(gate_BTF) * up_BTF
    return project(act_BTF, w["w_down"]) + lora_delta(act_BTF, lw.get("w_down"), lora_scale,
                                                                         (cfg.hidden_size,))


def feed_forward(cfg: ModelConfig, kind: str, lora_scale: float, mesh: Mesh | None, x_BTD: jax.Array, w: Params,
                 mw: Params, mlw: Params | None) -> jax.Array:
    """The feed-forward half of one decoder layer of `kind` ("mlp" or "moe"), with its residual (training,
    prefill and decode alike): `x_BTD` + the dense SwiGLU MLP or the MoE block (`jaxrl.model.moe`) of its
    RMSNorm, plus, in an MoE layer with `cfg.n_shared_experts`, the shared expert (a SwiGLU MLP of width
    `moe_intermediate_size` run on every token, transformers' `Glm4MoeMoE.shared_experts`). `w`: the
    layer's `layers` weights (for `mlp_norm`); `mw`, `mlw`: its `mlp` or `moe` weights and their LoRA.
    Returns [B, T, D] in `x_BTD`'s dtype."""
    h_BTD = rms_norm(x_BTD, w["mlp_norm"], cfg.rms_norm_eps)
    if kind == "mlp":
        return x_BTD + _mlp(cfg, lora_scale, h_BTD, mw, mlw)
    experts = {n: mw[n] for n in moe.EXPERT_AXES}
    out_BTD = moe.moe_block(h_BTD, mw["router"], experts, mlw, top_k=cfg.num_experts_per_tok,
                            norm_topk_prob=cfg.norm_topk_prob, lora_scale=lora_scale, mesh=mesh,
                            e_bias_E=mw["e_bias"] if cfg.sigmoid_router else None, n_group=cfg.n_group,
                            topk_group=cfg.topk_group, routed_scaling=cfg.routed_scaling_factor)
    if cfg.n_shared_experts:
        shared = {"w_gate": mw["shared_gate"], "w_up": mw["shared_up"], "w_down": mw["shared_down"]}
        out_BTD = out_BTD + _mlp(cfg, lora_scale, h_BTD, shared, None, cfg.moe_intermediate_size)
    return x_BTD + out_BTD

