"""The decoder every model family runs, in JAX over a params pytree, with LoRA and a KV cache.

Letters used in names and einsums:
  B batch   T query positions   S key positions (KV cache length)   L layers
  D model   N query heads       K kv heads       G query heads per kv head (N // K)
  H head    F MLP hidden        V vocabulary     R LoRA rank
  E experts I expert MLP hidden Q layers with a dense MLP   U layers with an MoE block (Q + U = L)
  M tokens, flattened (B * T, or the rows the output head scores)   X top-k slots of a token (MoE)
  A (token, slot) assignments, M * X (MoE)   P loss positions of a row (the train step)
  C items in one chunk   J chunks (of the vocabulary in sampling, of the tokens in the output head)
  W rows of the output head's second matmul (C, or 2C with the entropy's gradient)
  Z whichever one axis a function takes (RoPE: N or K; sampling's last-positive: J or C)
  Y, O the flattened input and output features of a weight a LoRA adapts
  lowercase: a slice of its capital's axis (h, in RoPE, half of H's rotated part; v a block of V in the
  output head and the CPU sampler). In the engine, B is the decode slots.

A decoder layer is attention with its residual, then the feed-forward block its family's layer kinds
choose ("mlp" or "moe", `ModelConfig.layer_kinds`), each built from the shared blocks
(`jaxrl.model.blocks`: RMSNorm before attention and MLP, q/k/v projections with optional biases and
per-head norms, RoPE on all or part of each head, grouped-query attention, a SwiGLU MLP or a top-k
mixture of SwiGLU experts, `jaxrl.model.moe`) with the options the config gives. The families
(`jaxrl.model.families`: Qwen3 / Qwen3-MoE, GLM-4.5 MoE) declare those options, their weight names and
their layer kinds; nothing here asks which family runs. This module holds the math, as pure functions
over the params pytree; the weights are declared once, as Flax NNX modules, in `jaxrl.model.modules`
(`param_specs`, `init_params`, `Model`, whose methods call these functions). The params have three
stacks: `layers` (attention and norms, [L, ...]), `mlp` (dense MLPs, [Q, ...]) and `moe` (router and
experts, [U, ...]). The stack runs as one `jax.lax.scan` per run of layers of one kind (`scan_runs`:
compile time and the compiler's live memory flat in depth): one scan for a Qwen3, two for GLM-4.5 (its
dense first layers, then its MoE layers).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.model import attention, kernels
from jaxrl.model.blocks import Params, attention_inputs, feed_forward, lora_delta, project, rms_norm
from jaxrl.model.config import ModelConfig

KVCache = dict[str, jax.Array]  # {"k": [L,B,S,K,H], "v": [L,B,S,K,H]}


class LayerWeights(NamedTuple):
    """One decoder layer's weights, as a layer reads them: a row of the stacks in a scan (`scan_runs`), a
    layer's slices (`unstack_layers`, `join_layers`), or the CPU engine's per-layer copy
    (`jaxrl.inference.cpu`). A NamedTuple: a pytree whose leaves are its fields' in order, as a tuple's.

    attn: the layer's row of the `layers` stack (`jaxrl.model.modules.Layers` without L): norms
        `attn_norm`, `mlp_norm` [D], projections `wq` [D, N, H], `wk`, `wv` [D, K, H], `wo` [N, H, D],
        optional biases (`bq` [N, H], `bk`, `bv` [K, H]) and per-head norms (`q_norm`, `k_norm` [H]); on
        the CPU engine the projections as `jaxrl.model.cpu.OutMajor`.
    attn_lora: the LoRA factors of those projections ({name: {"a", "b"}}, `modules.LoRA` without L), or
        None (no LoRA; an empty dict reads the same).
    ffn: the layer's feed-forward, as `cfg.layer_kinds` says: its row of the `mlp` stack (`w_gate`, `w_up`
        [D, F], `w_down` [F, D]) or of the `moe` stack (`router` [D, E], experts `w_gate`, `w_up`
        [E, D, I], `w_down` [E, I, D], GLM-4.5's `e_bias` [E] and shared expert).
    ffn_lora: the LoRA factors of those, or None.
    """

    attn: Params
    attn_lora: Params | None
    ffn: Params
    ffn_lora: Params | None


def _attention(cfg: ModelConfig, lora_scale: float, x_BTD, positions_BT, w, lw, k_cache, v_cache, attend):
    """Attention with its residual. `attend(q [B, T, N, H], k, v [B, S, K, H]) -> [B, T, N, H]`: causal
    self-attention (`attention.attention`, training and prefill) or the einsum over the cache (decode).
    Returns the new residual stream and this layer's key/value cache."""
    b, t, _ = x_BTD.shape
    lw = lw or {}
    q_BTNH, k_BTKH, v_BTKH = attention_inputs(cfg, lora_scale, x_BTD, positions_BT, w, lw)

    if k_cache is None:  # self-attention over this chunk (training, prefill)
        k_BSKH, v_BSKH = k_BTKH, v_BTKH
    else:  # write this chunk at its positions, then attend over the whole cache (decode)
        rows = jnp.arange(b)[:, None]
        k_BSKH = k_cache.at[rows, positions_BT].set(k_BTKH.astype(k_cache.dtype))
        v_BSKH = v_cache.at[rows, positions_BT].set(v_BTKH.astype(v_cache.dtype))

    attn_BTNH = attend(q_BTNH, k_BSKH, v_BSKH).astype(x_BTD.dtype)
    out_BTD = project(attn_BTNH, w["wo"]) + lora_delta(attn_BTNH, lw.get("wo"), lora_scale,
                                                                             (cfg.hidden_size,))
    return x_BTD + out_BTD, k_BSKH, v_BSKH



def layer_runs(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """The stack as runs of consecutive layers of one kind, in order: `(kind, first layer, end layer, index
    of the first in the kind's group)`. A Qwen3 or Qwen3-MoE is one run; GLM-4.5 two, its dense first
    layers (`mlp` [0, Q)) then its MoE layers (`moe` [0, U))."""
    runs: list[list] = []
    seen = {"mlp": 0, "moe": 0}
    for i, kind in enumerate(cfg.layer_kinds):
        if runs and runs[-1][0] == kind:
            runs[-1][2] = i + 1
        else:
            runs.append([kind, i, i + 1, seen[kind]])
        seen[kind] += 1
    return [(kind, start, stop, first) for kind, start, stop, first in runs]


def scan_runs(cfg: ModelConfig, layer: Any, x: Any, params: Params, lora: Params | None,
              per_layer: tuple[Any, ...] = (), remat_policy: Any = False) -> tuple[Any, Any]:
    """The carry `x` (the residual stream, or any pytree the layers carry) through every layer, one
    `jax.lax.scan` per run of `layer_runs` (so the compiler keeps one layer's weights and scratch live per
    run, not every layer's as an unrolled stack does; a run of one layer is a loop of one trip, which XLA
    inlines).

    `layer(kind, x, weights, rows) -> (x, ys)` is one layer of `kind`: its `LayerWeights` (rows of the
    `layers` stack and its LoRA, of the `mlp` or `moe` stack and its LoRA; None where absent) and `rows`,
    its row of each tree of `per_layer` ([L, ...] stacks, or None: the KV cache, the layer indices). A
    stack that a run covers whole (every stack of a one-run model, GLM-4.5's `moe` group) is the scan's
    `xs`; one it covers in part (`layers` and the cache of a mixed stack) is read in the body at the
    layer's index (`lax.dynamic_index_in_dim`), inside the rematerialised body: a static slice of it would
    be a new buffer (the loop's operand), for INTELLECT-3's decode cache most of 23 GiB a chip.
    `remat_policy`: False, no remat; else the `jax.checkpoint` policy (None: save nothing) of each layer.
    Returns `x` and each run's `ys` joined along their first axis ([L, ...])."""
    lora = lora or {}
    outs = []
    for kind, start, stop, first in layer_runs(cfg):
        n = stop - start
        trees = ((params["layers"], start), (lora.get("layers"), start), (params[kind], first),
                 (lora.get(kind), first), *((t, start) for t in per_layer))
        whole = tuple(t is None or (off == 0 and jax.tree.leaves(t)[0].shape[0] == n) for t, off in trees)
        xs = tuple(t if w else None for (t, _), w in zip(trees, whole, strict=True))

        def body(x, xs, kind=kind, trees=trees, whole=whole):
            if not all(whole):  # (index in the run, the whole stacks' rows): the others are read at the index
                j, xs = xs
                xs = tuple(r if w else _row(t, off, j) for r, w, (t, off) in zip(xs, whole, trees, strict=True))
            return layer(kind, x, LayerWeights(*xs[:4]), xs[4:])

        if remat_policy is not False:
            body = jax.checkpoint(body, policy=remat_policy)
        x, ys = jax.lax.scan(body, x, xs if all(whole) else (jnp.arange(n), xs))
        outs.append(ys)
    return x, (outs[0] if len(outs) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *outs))


def _row(tree: Any, offset: int, j: jax.Array) -> Any:
    """Row `offset + j` (`j` traced) of each [n, ...] leaf of `tree`, the leading axis dropped."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, offset + j, 0, False), tree)


def unstack_layers(cfg: ModelConfig, tree: Params | None) -> list[tuple[Any, Any]]:
    """The per-layer view of stacked base weights or LoRA factors: one `(layers slice, mlp or moe slice)`
    pair per layer (the feed-forward group as `cfg.layer_kinds` says), each leaf a slice of its stack;
    `(None, None)` pairs for no tree (no LoRA). An unrolled stack runs its layers over these; called
    outside jit (the engine's decode weights, `jaxrl.model.decode`), each slice is a copy in its own array."""
    tree = tree or {}
    seen = {"mlp": 0, "moe": 0}
    out = []
    for i, kind in enumerate(cfg.layer_kinds):
        j = seen[kind]
        seen[kind] += 1
        out.append((jax.tree.map(lambda a, i=i: a[i], tree.get("layers")),
                    jax.tree.map(lambda a, j=j: a[j], tree.get(kind))))
    return out


def join_layers(base_layers: list[tuple[Any, Any]], lora_layers: list[tuple[Any, Any]]) -> list[LayerWeights]:
    """Each layer's `LayerWeights` from `unstack_layers`' pairs of the base weights and of the LoRA."""
    return [LayerWeights(w, lw, mw, mlw) for (w, mw), (lw, mlw) in zip(base_layers, lora_layers, strict=True)]


def _decoder_layer(cfg: ModelConfig, kind: str, lora_scale: float, mesh: Mesh | None, x_BTD, positions_BT,
                   attend, weights: LayerWeights, cache_rows):
    """One decoder layer of `kind` ("mlp" or "moe") with its `weights` and its cache slices `cache_rows`
    (k, v; None without a cache); `attend` as in `_attention`."""
    w = weights.attn
    kc, vc = cache_rows
    x_BTD, k, v = _attention(cfg, lora_scale, x_BTD, positions_BT, w, weights.attn_lora, kc, vc, attend)
    return feed_forward(cfg, kind, lora_scale, mesh, x_BTD, w, weights.ffn, weights.ffn_lora), k, v


def _attend_for(cfg: ModelConfig, x_BTD: jax.Array, positions_BT: jax.Array, cache: KVCache | None,
                mesh: Mesh | None, segment_ids: jax.Array | None,
                attention_impl: kernels.Implementation | None) -> tuple[str, Any]:
    """(the attention implementation, `_attention`'s `attend`) of a stack over activations `x_BTD` at
    `positions_BT`: self-attention by `attention_impl` (None: `kernels.attention_kernel`'s pick for
    the mesh's platform and the shapes), or with a `cache` the einsum over it. The einsum's mask is built
    here, once for every layer.

    Raises:
        ValueError: `segment_ids` with a cache.
    """
    b, t = x_BTD.shape[:2]
    if cache is None:
        impl = attention_impl or kernels.attention_kernel(
            kernels.platform_of(mesh), t, x_BTD.dtype, cfg.head_dim, segment_ids is not None)
        mask_BTS = attention.mask(positions_BT, positions_BT, segment_ids) if impl in ("einsum", "xla") else None
        return impl, functools.partial(attention.attention, positions_BT=positions_BT, segment_ids_BT=segment_ids,
                                       mesh=mesh, impl=impl, mask_BTS=mask_BTS)
    if segment_ids is not None:
        raise ValueError("segment_ids apply to self-attention within tokens_BT, not to a KV cache")
    s = cache["k"].shape[2]
    mask_BTS = attention.mask(positions_BT, jnp.broadcast_to(jnp.arange(s, dtype=positions_BT.dtype), (b, s)))
    return "einsum", functools.partial(attention.einsum_attention, mask_BTS=mask_BTS)


def decoder_stack(
    cfg: ModelConfig,
    params: Params,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    *,
    lora: Params | None = None,
    lora_scale: float = 0.0,
    cache: KVCache | None = None,
    remat: bool = False,
    mesh: Mesh | None = None,
    scan_layers: bool = True,
    segment_ids: jax.Array | None = None,
    layers: list[LayerWeights] | None = None,
    attention_impl: kernels.Implementation | None = None,
) -> tuple[jax.Array, KVCache, jax.Array]:
    """The decoder stack before the final norm (`forward` adds it), with every layer's output.

    Args:
        tokens_BT: int32 token ids [B, T].
        positions_BT: int32 absolute positions [B, T]. A query attends to keys whose position is <= its
            own, so right padding (positions after the real tokens) is never attended to by real tokens.
        lora: LoRA factors from `jaxrl.model.modules.init_lora` (or None); their product is scaled by `lora_scale`
            (alpha / rank).
        cache: None to attend within `tokens_BT` (training, prefill); or a cache {"k","v"} of shape
            [L, B, S, K, H] where index s holds position s: the chunk is written at `positions_BT` and
            attends to every cache entry at a position <= its own (decode).
        remat: rematerialise each layer's activations in the backward pass.
        mesh: the device mesh the params live on; MoE blocks are expert parallel when its `expert` axis
            is larger than 1 (`jaxrl.model.moe.moe_block`). None: no expert parallelism.
        scan_layers: run the stack with `lax.scan`, one scan per run of layers of one kind (`scan_runs`:
            compile time flat in depth); False unrolls it.
        segment_ids: int32 [B, T] (no cache only): a query attends only to keys of its own segment, so
            several samples packed into one row (each with positions from 0) stay independent (SFT's
            packing, `jaxrl.rl.sft`). None: one segment per row.
        layers: per layer `LayerWeights` as separate arrays (the rollout engine's copy on CPU,
            `jaxrl.inference.cpu`: XLA's CPU backend copies each layer's weights out of a stack before
            reading them), run unrolled in place of `params`' and `lora`'s stacks. The same numbers.
            None: the stacks.
        attention_impl: how self-attention runs (`jaxrl.model.kernels.IMPLEMENTATIONS`); None: chosen
            from the mesh's platform and the shapes (`kernels.attention_kernel`; the einsum without a
            mesh). A decode over a cache always runs the einsum.

    Returns:
        the residual stream [B, T, D] in the params' dtype (before the final norm); {"k","v"}: [L, B, T,
        K, H] (no cache given) or the updated [L, B, S, K, H] cache; and every layer's output [L, B, T, D].

    Raises:
        ValueError: the expert count is not a multiple of the mesh's `expert` axis, or `segment_ids` with
            a cache.
    """
    x_BTD = params["embed"][tokens_BT]
    impl, attend = _attend_for(cfg, x_BTD, positions_BT, cache, mesh, segment_ids, attention_impl)
    lora = lora or {}
    kc, vc = (None, None) if cache is None else (cache["k"], cache["v"])
    kinds = cfg.layer_kinds

    def layer(kind, x, weights, cache_rows):
        x, k, v = _decoder_layer(cfg, kind, lora_scale, mesh, x, positions_BT, attend, weights, cache_rows)
        return x, (k, v, x)

    policy = attention.remat_policy(impl) if remat else False
    if layers is None and scan_layers:
        x_BTD, (k_L, v_L, h_L) = scan_runs(cfg, layer, x_BTD, params, lora, (kc, vc), policy)
        return x_BTD, {"k": k_L, "v": v_L}, h_L

    bodies = {kind: (functools.partial(layer, kind) if policy is False
                     else jax.checkpoint(functools.partial(layer, kind), policy=policy)) for kind in set(kinds)}
    outs = []
    if layers is None:
        layers = join_layers(unstack_layers(cfg, params), unstack_layers(cfg, lora))
    for i, weights in enumerate(layers):
        kc_i, vc_i = (None, None) if kc is None else (kc[i], vc[i])
        x_BTD, out = bodies[kinds[i]](x_BTD, weights, (kc_i, vc_i))
        outs.append(out)
    k_L, v_L, h_L = (jnp.stack(z) for z in zip(*outs, strict=True))
    return x_BTD, {"k": k_L, "v": v_L}, h_L


def forward(cfg: ModelConfig, params: Params, tokens_BT: jax.Array, positions_BT: jax.Array,
            **options: Any) -> tuple[jax.Array, KVCache]:
    """Run the decoder stack; return final-norm hidden states [B, T, D] in the params' dtype and the
    key/value cache ({"k","v"}: [L, B, T, K, H] with no cache given, else the updated [L, B, S, K, H]).
    `decoder_stack`, whose keyword `options` (lora, lora_scale, cache, remat, mesh, scan_layers,
    segment_ids, layers, attention_impl) and errors are documented there, then the final norm."""
    x_BTD, cache, _ = decoder_stack(cfg, params, tokens_BT, positions_BT, **options)
    return rms_norm(x_BTD, params["final_norm"], cfg.rms_norm_eps), cache


def unembed_matrix(params: Params) -> jax.Array:
    """The output projection [D, V]: `unembed`, or the transposed input embedding when tied."""
    return params["unembed"] if "unembed" in params else params["embed"].T


def logits(params: Params, hidden_BTD: jax.Array) -> jax.Array:
    """fp32 logits [B, T, V] from final hidden states [B, T, D]."""
    return project(hidden_BTD, unembed_matrix(params)).astype(jnp.float32)
