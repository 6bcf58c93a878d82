"""The model's CPU-only layouts, behind one seam: the weights and KV cache as the rollout engine's decode
reads them on CPU (`jaxrl.inference.cpu`, the engine's seam, makes and passes them).

  * `OutMajor`: a projection's weight stored output-major, [O, Y]. The model's code multiplies by a
    weight as `x @ w` (`qwen3.project`); with an `OutMajor` that product is `w_OI @ x.T`, the orientation
    XLA's CPU dot reads fastest at a few rows (about 2.4x at the Qwen3-0.6B decode shape).
    `out_major` converts the per-layer weights.
  * `CHUNKED`, the per-layer, head-major cache in chunks (`chunk_sizes`, `split_cache`): keys [B, K, H, C]
    and values [B, K, C, H] per layer, so each layer reads its own buffers (XLA's CPU backend copies a
    layer's slice out of a stacked cache before reading it), both attention products are batched matmuls
    over (B, K) of contiguous operands, and a step reads only the chunks that hold its positions. It is a
    `jaxrl.model.decode.CacheLayout`, as the plain stacked cache (`decode.STACKED`) a TPU or GPU reads.

The figures behind each choice are in docs/benchmarks.md (2026-11-23 .. 2026-11-26). Letters as in
`jaxrl.model.qwen3`.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.model import qwen3
from jaxrl.model.qwen3 import KVCache, ModelConfig, Params

# Positions in the first chunk of the per-layer cache (`chunk_sizes`): a step reads the chunks that hold
# its slots' positions, each its own array, since XLA's CPU dot copies a sliced operand before reading it.
CACHE_CHUNK = 128


@struct.dataclass
class OutMajor:
    """A projection's weight of logical `shape` [Y..., O...] stored output-major: `w_OI` [O, Y], its output
    axes flattened first. It stands where `qwen3.project` expects the weight: its `reshape` to the flat
    [Y, O] keeps it output-major, and `x_MY @ w` (Python's `__rmatmul__`: a jax array defers to an operand
    it does not know) computes `w_OI @ x_MY.T`, transposed back outside the dot, where an optimization
    barrier keeps XLA's algebraic simplifier from folding the transpose into the dot (which would undo the
    orientation). Made outside jit (`of`, `out_major`): a transposed copy."""

    w_OI: jax.Array
    shape: tuple[int, ...] = struct.field(pytree_node=False)

    @classmethod
    def of(cls, w: jax.Array, n_in: int) -> OutMajor:
        """`w` [Y..., O...] with `n_in` input axes, as a new output-major array (a transposed copy)."""
        return cls(jnp.asarray(w.reshape(math.prod(w.shape[:n_in]), -1).T), tuple(w.shape))

    def reshape(self, *shape: int) -> OutMajor:
        """The same array as the flat [Y, O] weight (`shape` that, one entry may be -1).

        Raises:
            ValueError: `shape` is not [Y, O].
        """
        o, y = self.w_OI.shape
        known = math.prod(n for n in shape if n != -1)
        want = tuple((y * o) // known if n == -1 else n for n in shape)
        if want != (y, o):
            raise ValueError(f"an OutMajor weight of shape {self.shape} reshapes to its flat ({y}, {o}) only, "
                             f"not {shape}")
        return OutMajor(self.w_OI, (y, o))

    def __rmatmul__(self, x_MY: jax.Array) -> jax.Array:
        y_OM = jax.lax.dot_general(self.w_OI, x_MY, (((1,), (1,)), ((), ())))
        return jax.lax.optimization_barrier(y_OM).T


def out_major(cfg: ModelConfig, layers: list[tuple]) -> list[tuple]:
    """Per-layer base weights `(layers slice, mlp or moe slice)` from `qwen3.unstack_layers`, with each
    attention and dense-MLP projection as an `OutMajor` (a transposed copy, made outside jit, in place of
    the slice); norms, routers and experts as they are."""
    n_in = dict(qwen3.LORA_TARGETS.values())

    def convert(group: Params) -> Params:
        return {k: OutMajor.of(a, n_in[k]) if k in n_in else a for k, a in group.items()}

    return [(convert(w), convert(mw) if kind == "mlp" else mw)
            for (w, mw), kind in zip(layers, qwen3.layer_kinds(cfg), strict=True)]


def unembedding(base: Params) -> OutMajor:
    """The unembedding [D, V] as an `OutMajor` [V, D]: a tied embedding as it is (no copy), an untied
    `unembed` transposed."""
    if "unembed" in base:
        return OutMajor.of(base["unembed"], 1)
    v, d = base["embed"].shape
    return OutMajor(base["embed"], (d, v))


def chunk_sizes(max_seq_len: int) -> tuple[int, ...]:
    """Positions per chunk of a cache of `max_seq_len`: `CACHE_CHUNK`, then each chunk as long as all before
    it (128, 128, 256, 512, ...; the last one what is left), so the first n chunks hold 128 * 2**(n - 1)
    positions and a cache of S has about log2(S / 128) + 1 chunks (6 for 4096: one compiled step per count).
    Long chunks because XLA's CPU dot runs a chunk of 512 positions or fewer on one thread and of 1024 or
    more on both (docs/benchmarks.md, 2026-11-25 evening)."""
    sizes: list[int] = []
    while (held := sum(sizes)) < max_seq_len:
        sizes.append(min(max(CACHE_CHUNK, held), max_seq_len - held))
    return tuple(sizes)


def split_cache(cache: KVCache, sizes: tuple[int, ...] | None = None) -> KVCache:
    """A stacked cache {"k","v"} [L, B, S, K, H] (or a prefix's [L, 1, T, K, H]) as the per-layer cache: per
    layer, a list of head-major chunks of `sizes` positions (default: one chunk of all S; chunks past S
    dropped, the last one cut at S), keys [B, K, H, C] and values [B, K, C, H] (transposed copies)."""
    s = cache["k"].shape[2]
    starts = list(itertools.accumulate(sizes or (s,), initial=0))
    cuts = [(a, min(b, s)) for a, b in itertools.pairwise(starts) if a < s]
    return {"k": [[c[:, a:b].transpose(0, 2, 3, 1) for a, b in cuts] for c in cache["k"]],
            "v": [[c[:, a:b].transpose(0, 2, 1, 3) for a, b in cuts] for c in cache["v"]]}


def join_cache(cache: KVCache) -> KVCache:
    """The inverse of `split_cache`: per-layer head-major chunks back to a stacked {"k","v"} [L, B, S, K, H]."""
    return {"k": jnp.stack([jnp.concatenate([c.transpose(0, 3, 1, 2) for c in layer], axis=1) for layer in cache["k"]]),
            "v": jnp.stack([jnp.concatenate([c.transpose(0, 2, 1, 3) for c in layer], axis=1) for layer in cache["v"]])}


class Chunked:
    """The per-layer, head-major cache in chunks (`split_cache`) as a `jaxrl.model.decode.CacheLayout`:
    {"k": L lists of [B, K, H, C], "v": L lists of [B, K, C, H]}. The chunks given are all a step reads
    and writes, so a caller may pass only the first few (those that hold every busy row's position), with
    the same numbers for those rows, bit for bit (`attend`)."""

    per_layer = True
    indexed = False  # `CacheLayout`'s default, declared here: `decode` imports this module, so it is not a base

    @staticmethod
    def attend(q_BKGH, k_BKH, v_BKH, positions_B, k_chunks, v_chunks) -> jax.Array:
        """Attention of one new query per row over one layer's chunks: keys [B, K, H, C] and values
        [B, K, C, H], each chunk's products batched matmuls over (B, K) of contiguous operands. The softmax
        is merged chunk by chunk, this step's key/value first (the running max, sum and weighted values of
        flash-decoding: Dao et al. 2023), so a chunk wholly past a row's position changes nothing, bit for
        bit. `q_BKGH` float32, pre-scaled; returns [B, K, G, H] float32."""
        f32, batch = jnp.float32, ((0, 1), (0, 1))
        top_BKG = jnp.sum(q_BKGH * k_BKH[:, :, None, :].astype(f32), axis=-1)  # this step's score: weight 1
        total_BKG = jnp.ones_like(top_BKG)
        attn_BKGH = jnp.broadcast_to(v_BKH[:, :, None, :].astype(f32), q_BKGH.shape)
        start = 0
        for k_BKHC, v_BKCH in zip(k_chunks, v_chunks, strict=True):
            c = k_BKHC.shape[-1]
            before_B11C = ((start + jnp.arange(c))[None] < positions_B[:, None])[:, None, None, :]
            scores_BKGC = jnp.where(before_B11C,
                                    jax.lax.dot_general(q_BKGH, k_BKHC.astype(f32), (((3,), (2,)), batch)), -1e30)
            top_c_BKG = jnp.max(scores_BKGC, axis=-1)
            probs_BKGC = jnp.where(before_B11C, jnp.exp(scores_BKGC - top_c_BKG[..., None]), 0.0)
            new_top_BKG = jnp.maximum(top_BKG, top_c_BKG)
            old_w_BKG, chunk_w_BKG = jnp.exp(top_BKG - new_top_BKG), jnp.exp(top_c_BKG - new_top_BKG)
            total_BKG = total_BKG * old_w_BKG + jnp.sum(probs_BKGC, axis=-1) * chunk_w_BKG
            values_BKGH = jax.lax.dot_general(probs_BKGC, v_BKCH.astype(f32), (((3,), (2,)), batch))
            attn_BKGH = attn_BKGH * old_w_BKG[..., None] + values_BKGH * chunk_w_BKG[..., None]
            top_BKG, start = new_top_BKG, start + c
        return attn_BKGH / total_BKG[..., None]

    @staticmethod
    def write(cache: KVCache, k_LBKH: jax.Array, v_LBKH: jax.Array, positions_B: jax.Array) -> KVCache:
        """Each layer's new keys at (row, :, :, position) of [B, K, H, C] and values at (row, :, position, :)
        of [B, K, C, H], in the chunk that holds the position (elsewhere the index is past the chunk's end:
        dropped)."""
        rows_B = jnp.arange(positions_B.shape[0])

        def put(layer, new_BKH, axis):
            out, start = [], 0
            for c in layer:
                n = c.shape[axis]
                idx_B = jnp.where((positions_B >= start) & (positions_B < start + n), positions_B - start, n)
                out.append(c.at[rows_B, :, :, idx_B].set(new_BKH, mode="drop") if axis == 3
                           else c.at[rows_B, :, idx_B].set(new_BKH, mode="drop"))
                start += n
            return out

        return {"k": [put(layer, k, 3) for layer, k in zip(cache["k"], k_LBKH, strict=True)],
                "v": [put(layer, v, 2) for layer, v in zip(cache["v"], v_LBKH, strict=True)]}


CHUNKED = Chunked()
