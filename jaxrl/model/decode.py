"""One decode step (T = 1) over a KV cache, written for memory bandwidth.

`qwen3.forward(..., cache=...)` is the reference: per layer it scatters the new key/value into the
cache, returns the whole updated cache as a scan output (a full copy of the cache every step) and
attends with batched dots whose batch (B x K) is large and whose matrices are tiny, which XLA's CPU
backend runs at about 1 GB/s. On the Qwen3-0.6B shape at 8 slots and 192 positions that made a
decode step 3.5x slower than the same forward without a cache. Here a step reads the cache once:

  * attention over the cache is a multiply-and-reduce (`q * k` summed over H, softmax over S, `p * v`
    summed over S) over the positions before this one, read from the cache as it is, with this
    step's key/value added as one more term of the softmax;
  * the layers return only this step's key/value [L, B, K, H]; after the last layer has read the
    cache, one scatter writes them into the (donated) cache in place;
  * the engine's per-layer cache is head-major (`split_cache`: keys [B, K, H, S], values [B, K, S, H],
    in chunks of `chunk_sizes` positions, of which a step reads only those it needs), so the query-key
    and probability-value products are batched matmuls over (B, K) of contiguous [G, H] x [H, C] and
    [G, C] x [C, H] operands. Over the stacked layout [B, S, K, H] they are
    reductions over H, the innermost axis, or over S across it: on the 0.6B shape at 8 slots and 192
    positions (28 layers, 352 MB of cache) 69 ms a step that way, 36 ms head-major (Nov 2026, 2 cores,
    each product's chain of 28 layers alone: 39 -> 18 ms and 30 -> 18 ms);
  * with the engine's per-layer weights (`unstack_layers` called outside jit, so each slice is its own
    array) and cache (`split_cache`), each matmul and each layer's attention reads its own buffer: XLA's
    CPU backend copies a weight out of its stack (a dynamic slice inside `lax.scan`, or a static slice in
    an unrolled loop) before every matmul or reduction that reads it, which more than doubled a decode
    step's memory traffic on the 0.6B shape (1.5 GB of MLP and attention weights at 8 rows: 216 ms
    stacked, 99 ms as separate arrays, 102 ms the bandwidth limit). The price is a second copy.

On the 0.6B shape at 8 slots (Nov 2026, 2 loaded cores) these took a step from about 490 ms to 230 ms:
the stacked cache had cost 130 ms of slice copies and 56 ms of whole-cache copies, the substituted
key/value a written copy of each layer's cache, and `wo` a transposed copy per layer (below).

Everything else is the training forward's own code: the attention inputs (norm, q/k/v projections
with LoRA, per-head norms, RoPE: `qwen3.attention_inputs`), the dense or MoE feed-forward with its
residual (`qwen3.feed_forward`) and the per-layer slicing (`qwen3.unstack_layers`); tests check the
step against `qwen3.forward` to 1e-4. Letters as in `jaxrl.model.qwen3`.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.model import qwen3
from jaxrl.model.qwen3 import KVCache, ModelConfig, Params, unstack_layers

# Positions in the first chunk of the engine's per-layer cache (`chunk_sizes`, `split_cache`). A decode step
# reads the chunks that hold the busy slots' positions, not the whole cache: XLA's CPU dot copies a sliced
# operand before it reads it (a [B, K, H, 1024] key cache sliced to 256 positions: 192 ms for 28 layers'
# attention, against 42 ms for a cache of 256 positions and 137 ms for all 1024; Nov 2026, 2 cores), so each
# chunk is its own array.
CACHE_CHUNK = 128


def _attend(q_BKGH, k_BKH, v_BKH, positions_B, scores_BKGS, weigh_values):
    """Attention of one new query per row, [B, K, G, H] in float32: the cache's `scores_BKGS` (float32
    [B, K, G, S], masked here to the positions before each row's own) and this step's key/value as one
    more term of the softmax; `weigh_values(probs_BKGS)` is the cache's value sum [B, K, G, H]."""
    f32 = jnp.float32
    before_B11S = (jnp.arange(scores_BKGS.shape[-1])[None] < positions_B[:, None])[:, None, None, :]
    scores_BKGS = jnp.where(before_B11S, scores_BKGS, -1e30)
    here_BKG = jnp.sum(q_BKGH * k_BKH[:, :, None, :].astype(f32), axis=-1)
    top_BKG = jnp.maximum(jnp.max(scores_BKGS, axis=-1), here_BKG)
    probs_BKGS = jnp.exp(scores_BKGS - top_BKG[..., None])
    here_BKG = jnp.exp(here_BKG - top_BKG)
    total_BKG = jnp.sum(probs_BKGS, axis=-1) + here_BKG
    attn_BKGH = weigh_values(probs_BKGS) + here_BKG[..., None] * v_BKH[:, :, None, :].astype(f32)
    return attn_BKGH / total_BKG[..., None]


def _attend_chunks(q_BKGH, k_BKH, v_BKH, positions_B, k_chunks, v_chunks):
    """`_attend` over a per-layer cache in head-major chunks (`split_cache`): keys [B, K, H, C] and values
    [B, K, C, H], each chunk's products batched matmuls over (B, K) of contiguous operands. The softmax is
    merged chunk by chunk, this step's key/value first (the running max, sum and weighted values of
    flash-decoding: Dao et al. 2023), so a chunk wholly past a row's position changes nothing, bit for bit:
    a step's numbers do not depend on how many chunks it reads. Returns [B, K, G, H] float32."""
    f32, batch = jnp.float32, ((0, 1), (0, 1))
    top_BKG = jnp.sum(q_BKGH * k_BKH[:, :, None, :].astype(f32), axis=-1)  # this step's score: weight 1
    total_BKG = jnp.ones_like(top_BKG)
    attn_BKGH = jnp.broadcast_to(v_BKH[:, :, None, :].astype(f32), q_BKGH.shape)
    start = 0
    for k_BKHC, v_BKCH in zip(k_chunks, v_chunks, strict=True):
        c = k_BKHC.shape[-1]
        before_B11C = ((start + jnp.arange(c))[None] < positions_B[:, None])[:, None, None, :]
        scores_BKGC = jnp.where(before_B11C, jax.lax.dot_general(q_BKGH, k_BKHC.astype(f32), (((3,), (2,)), batch)),
                                -1e30)
        top_c_BKG = jnp.max(scores_BKGC, axis=-1)
        probs_BKGC = jnp.where(before_B11C, jnp.exp(scores_BKGC - top_c_BKG[..., None]), 0.0)
        new_top_BKG = jnp.maximum(top_BKG, top_c_BKG)
        old_w_BKG, chunk_w_BKG = jnp.exp(top_BKG - new_top_BKG), jnp.exp(top_c_BKG - new_top_BKG)
        total_BKG = total_BKG * old_w_BKG + jnp.sum(probs_BKGC, axis=-1) * chunk_w_BKG
        values_BKGH = jax.lax.dot_general(probs_BKGC, v_BKCH.astype(f32), (((3,), (2,)), batch))
        attn_BKGH = attn_BKGH * old_w_BKG[..., None] + values_BKGH * chunk_w_BKG[..., None]
        top_BKG, start = new_top_BKG, start + c
    return attn_BKGH / total_BKG[..., None]


def _layer(cfg: ModelConfig, kind: str, lora_scale: float, mesh: Mesh | None, x_BTD, positions_B, xs,
           head_major: bool = False):
    """One decoder layer for one new token per row; returns (x_BTD, k_BKH, v_BKH) of this step. `xs` ends
    with this layer's cache: stacked-layout slices [B, S, K, H], or with `head_major` a `split_cache` layer
    (its key chunks, its value chunks)."""
    w, lw, mw, mlw, k_cache, v_cache = xs
    lw = lw or {}
    b, nk, hd = x_BTD.shape[0], cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // nk
    q_BTNH, k_BTKH, v_BTKH = qwen3.attention_inputs(cfg, lora_scale, x_BTD, positions_B[:, None], w, lw)
    cache_dtype = (k_cache[0] if head_major else k_cache).dtype
    k_BKH = k_BTKH[:, 0].astype(cache_dtype)
    v_BKH = v_BTKH[:, 0].astype(cache_dtype)

    # The cache is read as it is (a copy with this step's key substituted would be written and read
    # again: 3x the cache traffic); positions before this one come from it, this one from k_BKH/v_BKH.
    q_BKGH = q_BTNH[:, 0].reshape(b, nk, g, hd).astype(jnp.float32) / math.sqrt(hd)
    f32 = jnp.float32
    if head_major:  # chunks of keys [B, K, H, C], values [B, K, C, H] (reductions over the stacked
        # layout's innermost H become batched matmuls over (B, K) of contiguous operands)
        attn_BKGH = _attend_chunks(q_BKGH, k_BKH, v_BKH, positions_B, k_cache, v_cache)
    else:  # slices [B, S, K, H] of the stacked cache: a multiply-and-reduce over the cache as it is
        scores_BKGS = jnp.sum(q_BKGH[:, None] * k_cache[:, :, :, None, :].astype(f32), axis=-1).transpose(0, 2, 3, 1)

        def weigh_values(probs_BKGS):
            probs_BSKG = probs_BKGS.transpose(0, 3, 1, 2)
            return jnp.sum(probs_BSKG[..., None] * v_cache[:, :, :, None, :].astype(f32), axis=1)
        attn_BKGH = _attend(q_BKGH, k_BKH, v_BKH, positions_B, scores_BKGS, weigh_values)
    attn_BTNH = attn_BKGH.reshape(b, 1, cfg.num_heads, hd).astype(x_BTD.dtype)
    # one contraction over N * H: with two contracting axes XLA's CPU backend transposed `wo` to [H, N, D]
    # (a copy of the weight, 3 ms of a 0.6B layer's 5) before every step's matmul
    wo = w["wo"] if isinstance(w["wo"], qwen3.OutMajor) else w["wo"].reshape(-1, cfg.hidden_size)
    out_BTD = qwen3.project(attn_BTNH.reshape(b, 1, -1), wo)
    out_BTD = out_BTD + qwen3.lora_delta(attn_BTNH, lw.get("wo"), lora_scale, (cfg.hidden_size,))
    return qwen3.feed_forward(cfg, kind, lora_scale, mesh, x_BTD + out_BTD, w, mw, mlw), k_BKH, v_BKH


def decode_step(cfg: ModelConfig, params: Params, tokens_B: jax.Array, positions_B: jax.Array, cache: KVCache, *,
                lora: Params | None = None, lora_scale: float = 0.0, mesh: Mesh | None = None,
                layers: list[tuple] | None = None) -> tuple[jax.Array, KVCache]:
    """Advance every row by one token: what `qwen3.forward` returns for `tokens_B[:, None]` at
    `positions_B[:, None]` with `cache`, faster.

    Args:
        tokens_B: int32 [B], the token at `positions_B` (int32 [B]) of each row.
        cache: {"k","v"} [L, B, S, K, H] where index s holds position s, or per layer a list of head-major
            chunks, {"k": L lists of [B, K, H, C], "v": L lists of [B, K, C, H]} (`split_cache`: each
            layer reads its own buffers, where XLA's CPU backend copies a layer's slice out of a stacked
            cache before reading it, and both attention products are plain batched matmuls). The chunks
            given are all the step reads and writes, so a caller may pass only the first few (those that
            hold every busy row's position: `jaxrl.inference.engine.Engine.generate`'s `chunks`), with
            the same numbers for those rows, bit for bit (`_attend_chunks`). Donate it to update in place.
        layers: per layer `(weights, lora, ffn weights, ffn lora)` from `unstack_layers` of `params`
            and of `lora`, to run the layers unrolled over separate arrays (faster on CPU); None scans
            the stacked `params` / `lora` (a mixed dense/MoE stack, or a per-layer cache, is unrolled).

    Returns:
        final-norm hidden states [B, 1, D] in the params' dtype, and the cache, in the form it came in,
        with this step's keys and values written at `positions_B`.
    """
    x_BTD = params["embed"][tokens_B][:, None]
    kinds = qwen3.layer_kinds(cfg)
    per_layer = isinstance(cache["k"], list | tuple)
    if layers is None and len(set(kinds)) == 1 and not per_layer:
        kind, lora = kinds[0], lora or {}

        def body(x, xs):
            x, k, v = _layer(cfg, kind, lora_scale, mesh, x, positions_B, xs)
            return x, (k, v)

        xs = (params["layers"], lora.get("layers"), params[kind], lora.get(kind), cache["k"], cache["v"])
        x_BTD, (k_LBKH, v_LBKH) = jax.lax.scan(body, x_BTD, xs)
    else:
        ks, vs = [], []
        if layers is None:
            layers = [(w, lw, mw, mlw) for (w, mw), (lw, mlw) in zip(unstack_layers(cfg, params),
                                                                     unstack_layers(cfg, lora), strict=True)]
        for i, (w, lw, mw, mlw) in enumerate(layers):
            x_BTD, k, v = _layer(cfg, kinds[i], lora_scale, mesh, x_BTD, positions_B,
                                 (w, lw, mw, mlw, cache["k"][i], cache["v"][i]), head_major=per_layer)
            ks.append(k)
            vs.append(v)
        k_LBKH, v_LBKH = jnp.stack(ks), jnp.stack(vs)
    # written after every layer has read the cache (the barrier orders it after the last layer): else
    # XLA copies the whole donated cache to keep the layers' reads from seeing this step's writes
    x_BTD, k_LBKH, v_LBKH = jax.lax.optimization_barrier((x_BTD, k_LBKH, v_LBKH))
    rows_B = jnp.arange(tokens_B.shape[0])
    if per_layer:
        # keys [B, K, H, C] at (row, :, :, position), values [B, K, C, H] at (row, :, position, :), in the
        # chunk that holds the position (elsewhere the index is past the chunk's end: dropped)
        def put(layer, new_BKH, axis):
            out, start = [], 0
            for c in layer:
                n = c.shape[axis]
                idx_B = jnp.where((positions_B >= start) & (positions_B < start + n), positions_B - start, n)
                out.append(c.at[rows_B, :, :, idx_B].set(new_BKH, mode="drop") if axis == 3
                           else c.at[rows_B, :, idx_B].set(new_BKH, mode="drop"))
                start += n
            return out

        cache = {"k": [put(layer, k, 3) for layer, k in zip(cache["k"], k_LBKH, strict=True)],
                 "v": [put(layer, v, 2) for layer, v in zip(cache["v"], v_LBKH, strict=True)]}
    else:
        cache = {"k": cache["k"].at[:, rows_B, positions_B].set(k_LBKH),
                 "v": cache["v"].at[:, rows_B, positions_B].set(v_LBKH)}
    return qwen3.rms_norm(x_BTD, params["final_norm"], cfg.rms_norm_eps), cache


def out_major(cfg: ModelConfig, layers: list[tuple]) -> list[tuple]:
    """Per-layer base weights `(layers slice, mlp or moe slice)` from `unstack_layers`, with each attention
    and dense-MLP projection as a `qwen3.OutMajor` (a transposed copy, made outside jit, in place of the
    slice); norms, routers and experts as they are. What the engine's decode reads on CPU (`Engine.prepare`)."""
    n_in = dict(qwen3.LORA_TARGETS.values())

    def convert(group: Params) -> Params:
        return {k: qwen3.OutMajor.of(a, n_in[k]) if k in n_in else a for k, a in group.items()}

    return [(convert(w), convert(mw) if kind == "mlp" else mw)
            for (w, mw), kind in zip(layers, qwen3.layer_kinds(cfg), strict=True)]


def chunk_sizes(max_seq_len: int) -> tuple[int, ...]:
    """Positions per chunk of a cache of `max_seq_len`: `CACHE_CHUNK`, then each chunk as long as all before
    it (128, 128, 256, 512, ...; the last one what is left), so the first n chunks hold 128 * 2**(n - 1)
    positions and a cache of S has about log2(S / 128) + 1 chunks (6 for 4096: one compiled step per count,
    and a step's program grows with its chunks: 32 chunks of 128 compiled in 13 s at 8 layers, one chunk in 1.2 s).

    Long chunks because a short one reads slowly: XLA's CPU dot runs the attention products of a chunk of
    512 positions or fewer on one thread, and of 1024 or more on both (2 cores, Nov 2026: 28 layers'
    attention over 4096 positions at 8 slots took 430-460 ms in one chunk or four of 1024, 550-590 ms in
    eight of 512, 480-500 ms in these six; over the first 512 positions, 93 ms in chunks of 128, 128 and 256).
    """
    sizes: list[int] = []
    while (held := sum(sizes)) < max_seq_len:
        sizes.append(min(max(CACHE_CHUNK, held), max_seq_len - held))
    return tuple(sizes)


def split_cache(cache: KVCache, sizes: tuple[int, ...] | None = None) -> KVCache:
    """A stacked cache {"k","v"} [L, B, S, K, H] (or a prefix's [L, 1, T, K, H]) as the engine's per-layer
    cache: per layer, a list of head-major chunks of `sizes` positions (default: one chunk of all S; chunks
    past S dropped, the last one cut at S), keys [B, K, H, C] and values [B, K, C, H] (transposed copies).
    What the engine's per-layer decode reads (`_layer` with `head_major`)."""
    s = cache["k"].shape[2]
    starts = list(itertools.accumulate(sizes or (s,), initial=0))
    cuts = [(a, min(b, s)) for a, b in itertools.pairwise(starts) if a < s]
    return {"k": [[c[:, a:b].transpose(0, 2, 3, 1) for a, b in cuts] for c in cache["k"]],
            "v": [[c[:, a:b].transpose(0, 2, 1, 3) for a, b in cuts] for c in cache["v"]]}


def join_cache(cache: KVCache) -> KVCache:
    """The inverse of `split_cache`: per-layer head-major chunks back to a stacked {"k","v"} [L, B, S, K, H]."""
    return {"k": jnp.stack([jnp.concatenate([c.transpose(0, 3, 1, 2) for c in layer], axis=1) for layer in cache["k"]]),
            "v": jnp.stack([jnp.concatenate([c.transpose(0, 2, 1, 3) for c in layer], axis=1) for layer in cache["v"]])}
