"""One decode step (T = 1) over a KV cache, written for memory bandwidth.

`decoder.forward(..., cache=...)` is the reference: per layer it scatters the new key/value into the
cache, returns the whole updated cache as a scan output (a full copy of the cache every step) and
attends with batched dots whose batch (B x K) is large and whose matrices are tiny. Here a step reads
the cache once:

  * attention over the cache is a multiply-and-reduce (`q * k` summed over H, softmax over S, `p * v`
    summed over S) over the positions before this one, read from the cache as it is, with this
    step's key/value added as one more term of the softmax;
  * the layers return only this step's key/value [L, B, K, H]; after the last layer has read the
    cache, one scatter writes them into the (donated) cache in place.

How the cache is laid out, written and attended over is a `CacheLayout`: a kind of `jaxrl.kv` (the
plain stacked `jaxrl.kv.dense.Dense`, the CPU's per-layer chunks `jaxrl.kv.chunked.Chunked`, whose engine
also passes per-layer weight copies, `layers`, or a page pool, `jaxrl.kv.paged`).

Everything else is the training forward's own code: the attention inputs (norm, q/k/v projections
with LoRA, per-head norms, RoPE: `blocks.attention_inputs`), the dense or MoE feed-forward with its
residual (`blocks.feed_forward`) and the per-layer slicing (`decoder.unstack_layers`); tests check the
step against `decoder.forward` to 1e-4. The figures behind these choices are in docs/benchmarks.md
(issue 4, 2026-11-23, and issue 13). Letters as in `jaxrl.model.decoder`.
"""

from __future__ import annotations

import math
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.model import blocks, decoder
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.decoder import KVCache, LayerWeights, join_layers, unstack_layers


class CacheLayout(Protocol):
    """How a decode step reads and writes its KV cache {"k", "v"}: `cache[n][i]` is layer i's part.

    per_layer: each layer's cache is its own buffers (the layers are then run unrolled, not scanned).
    attend(q_BKGH, k_BKH, v_BKH, positions_B, k_layer, v_layer): attention of each row's one new query
        (float32 [B, K, G, H], pre-scaled by 1/sqrt(H)) over the cache's positions before its own and this
        step's key/value [B, K, H]; float32 [B, K, G, H].
    write(cache, k_LBKH, v_LBKH, positions_B): the cache with this step's keys/values at `positions_B`.
    indexed (default False): the layout reads the whole cache at a layer index instead of the scan's
        per-layer slice, through `attend_layer(q_BKGH, k_BKH, v_BKH, positions_B, cache, layer)` ->
        (attention as `attend`'s, the cache): a paged pool (`jaxrl.kv.paged`), whose TPU kernel writes
        this step's key/value layer by layer (the cache is then the layer loop's carry).
    The kinds of `jaxrl.kv` implement it (`jaxrl.kv.kind.CacheKind`).
    """

    per_layer: bool
    indexed: bool = False

    def attend(self, q_BKGH: jax.Array, k_BKH: jax.Array, v_BKH: jax.Array, positions_B: jax.Array,
               k_layer, v_layer) -> jax.Array: ...

    def write(self, cache: KVCache, k_LBKH: jax.Array, v_LBKH: jax.Array, positions_B: jax.Array) -> KVCache: ...


def _layer(cfg: ModelConfig, kind: str, lora_scale: float, mesh: Mesh | None, attend, cache_dtype, x_BTD,
           positions_B, weights: LayerWeights):
    """One decoder layer for one new token per row; returns (x_BTD, k_BKH, v_BKH of this step, the cache
    `attend` returned). `weights` are this layer's; `attend(q_BKGH, k_BKH, v_BKH)` -> (attention float32
    [B, K, G, H], cache) reads the layer's cache as its layout holds it."""
    w, lw = weights.attn, weights.attn_lora or {}
    b, nk, hd = x_BTD.shape[0], cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // nk
    q_BTNH, k_BTKH, v_BTKH = blocks.attention_inputs(cfg, lora_scale, x_BTD, positions_B[:, None], w, lw)
    k_BKH = k_BTKH[:, 0].astype(cache_dtype)
    v_BKH = v_BTKH[:, 0].astype(cache_dtype)

    # The cache is read as it is (a copy with this step's key substituted would be written and read
    # again: 3x the cache traffic); positions before this one come from it, this one from k_BKH/v_BKH.
    q_BKGH = q_BTNH[:, 0].reshape(b, nk, g, hd).astype(jnp.float32) / math.sqrt(hd)
    attn_BKGH, cache = attend(q_BKGH, k_BKH, v_BKH)
    attn_BTNH = attn_BKGH.reshape(b, 1, cfg.num_heads, hd).astype(x_BTD.dtype)
    return layer_out(cfg, kind, lora_scale, mesh, x_BTD, attn_BTNH, weights), k_BKH, v_BKH, cache


def layer_out(cfg: ModelConfig, kind: str, lora_scale: float, mesh: Mesh | None, x_BTD: jax.Array,
              attn_BTNH: jax.Array, weights: LayerWeights) -> jax.Array:
    """The rest of a decoder layer after its attention `attn_BTNH` [B, T, N, H] (in `x_BTD`'s dtype): the
    output projection `wo` with its LoRA, the residual, and the feed-forward with its residual; [B, T, D].
    The decode step's and the ragged step's (`jaxrl.model.ragged`)."""
    w, lw = weights.attn, weights.attn_lora or {}
    b, t = attn_BTNH.shape[:2]
    # one contraction over N * H: with two contracting axes XLA's CPU backend transposed `wo` to [H, N, D]
    # (a copy of the weight) before every step's matmul
    out_BTD = blocks.project(attn_BTNH.reshape(b, t, -1), w["wo"].reshape(-1, cfg.hidden_size))
    out_BTD = out_BTD + blocks.lora_delta(attn_BTNH, lw.get("wo"), lora_scale, (cfg.hidden_size,))
    return blocks.feed_forward(cfg, kind, lora_scale, mesh, x_BTD + out_BTD, w, weights.ffn, weights.ffn_lora)


def _attend(layout: CacheLayout, positions_B, cache, layer, k_layer, v_layer):
    """`_layer`'s `attend` for `layout`: `attend_layer` over the whole cache at `layer` (an `indexed`
    layout), else `attend` over the layer's own `k_layer`, `v_layer` (the cache passed through)."""
    if layout.indexed:
        return lambda q, k, v: layout.attend_layer(q, k, v, positions_B, cache, layer)
    return lambda q, k, v: (layout.attend(q, k, v, positions_B, k_layer, v_layer), cache)


def decode_step(cfg: ModelConfig, params: Params, tokens_B: jax.Array, positions_B: jax.Array, cache: KVCache, *,
                lora: Params | None = None, lora_scale: float = 0.0, mesh: Mesh | None = None,
                layers: list[LayerWeights] | None = None, layout: CacheLayout) -> tuple[jax.Array, KVCache]:
    """Advance every row by one token: what `decoder.forward` returns for `tokens_B[:, None]` at
    `positions_B[:, None]` with `cache`, faster.

    Args:
        tokens_B: int32 [B], the token at `positions_B` (int32 [B]) of each row.
        cache: the KV cache as `layout` holds it: for `jaxrl.kv.dense.Dense`, {"k","v"} [L, B, S, K, H] where
            index s holds position s; for the CPU engine's `jaxrl.kv.chunked.Chunked`, per layer a list of
            head-major chunks (those given are all the step reads and writes). Donate it to update in place.
        layers: per layer `LayerWeights` from `unstack_layers` of `params` and of `lora` (`join_layers`;
            the CPU engine's copies, `jaxrl.inference.cpu.CpuWeights`), run unrolled; None scans the
            stacked `params` / `lora`, one scan per run of layers of one kind (`decoder.scan_runs`; a
            `per_layer` cache is unrolled).
        layout: how the cache is held (`CacheLayout`).

    Returns:
        final-norm hidden states [B, 1, D] in the params' dtype, and the cache, in the form it came in,
        with this step's keys and values written at `positions_B`.
    """
    x_BTD = params["embed"][tokens_B][:, None]
    kinds = cfg.layer_kinds
    indexed = layout.indexed
    cache_dtype = jax.tree.leaves(cache["k"])[0].dtype
    # an indexed layout carries the whole cache through the layers; the others' layers read their slice
    carried = cache if indexed else None
    if layers is None and not layout.per_layer:
        def layer(kind, carry, weights, rows):
            x, c = carry
            index, k_layer, v_layer = rows
            x, k, v, c = _layer(cfg, kind, lora_scale, mesh, _attend(layout, positions_B, c, index, k_layer, v_layer),
                                cache_dtype, x, positions_B, weights)
            return (x, c), (k, v)

        per_layer = (None, None) if indexed else (cache["k"], cache["v"])
        (x_BTD, carried), (k_LBKH, v_LBKH) = decoder.scan_runs(cfg, layer, (x_BTD, carried), params, lora,
                                                               (jnp.arange(cfg.num_layers), *per_layer))
    else:
        ks, vs = [], []
        if layers is None:
            layers = join_layers(unstack_layers(cfg, params), unstack_layers(cfg, lora))
        for i, weights in enumerate(layers):
            k_layer, v_layer = (None, None) if indexed else (cache["k"][i], cache["v"][i])
            x_BTD, k, v, carried = _layer(cfg, kinds[i], lora_scale, mesh,
                                          _attend(layout, positions_B, carried, i, k_layer, v_layer), cache_dtype,
                                          x_BTD, positions_B, weights)
            ks.append(k)
            vs.append(v)
        k_LBKH, v_LBKH = jnp.stack(ks), jnp.stack(vs)
    if indexed:
        cache = carried
    # written after every layer has read the cache (the barrier orders it after the last layer): else
    # XLA copies the whole donated cache to keep the layers' reads from seeing this step's writes
    x_BTD, k_LBKH, v_LBKH = jax.lax.optimization_barrier((x_BTD, k_LBKH, v_LBKH))
    cache = layout.write(cache, k_LBKH, v_LBKH, positions_B)
    return blocks.rms_norm(x_BTD, params["final_norm"], cfg.rms_norm_eps), cache
