"""The CPU's KV cache: per layer, head-major, in chunks that grow (`jaxrl.kv.chunks.chunk_sizes`: 128, 128,
256, ...), keys [B, K, H, C] and values [B, K, C, H] per chunk, so each layer reads its own buffers (XLA's
CPU backend copies a layer's slice out of a stacked cache before reading it), both attention products are
batched matmuls over (B, K) of contiguous operands, and a step reads only the chunks that hold its slots'
positions. The engine over it keeps per-layer weight copies (`jaxrl.inference.cpu.CpuWeights`). The figures
behind each choice are in docs/benchmarks.md (issues 4 and 13, 2026-11-23 .. 2026-11-26). Letters as in
`jaxrl.model.decoder`; C positions of one chunk.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.kv.chunks import chunk_sizes, chunks_holding
from jaxrl.kv.kind import MakeBuffer
from jaxrl.model.config import ModelConfig
from jaxrl.model.decoder import KVCache


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


@dataclasses.dataclass(frozen=True)
class Chunked:
    """The CPU's `jaxrl.kv.kind.CacheKind` for `cfg`, `slots` slots of `max_seq_len` positions:
    {"k": L lists of [B, K, H, C], "v": L lists of [B, K, C, H]}. The chunks a step is given are all it
    reads and writes, so `decode` passes only the first few (those that hold every busy row's position),
    with the same numbers for those rows, bit for bit (`attend`)."""

    cfg: ModelConfig
    slots: int
    max_seq_len: int
    reads_training_weights = False
    per_layer = True
    indexed = False

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """Positions per chunk of each layer's cache."""
        return chunk_sizes(self.max_seq_len)

    def allocator(self) -> None:
        return None

    def cache(self, make: MakeBuffer) -> KVCache:
        """Per layer, head-major chunks of `chunk_sizes` positions: keys [B, K, H, C], values [B, K, C, H]."""
        c, b, axes = self.cfg, self.slots, ("batch", "kv_heads", None, None)
        return {"k": [[make((b, c.num_kv_heads, c.head_dim, n), axes) for n in self.chunk_sizes]
                      for _ in range(c.num_layers)],
                "v": [[make((b, c.num_kv_heads, n, c.head_dim), axes) for n in self.chunk_sizes]
                      for _ in range(c.num_layers)]}

    def insert(self, cache: KVCache, prefix_cache: KVCache, slot: jax.Array, pages: None = None) -> KVCache:
        """The prompt's chunks (`split_cache` of its [L, 1, T, K, H]) at `slot`; those after it keep their data."""
        src = split_cache(prefix_cache, self.chunk_sizes)

        def put_chunks(dst, pieces):
            return [jax.lax.dynamic_update_slice(d, x, (slot, 0, 0, 0))
                    for d, x in zip(dst[:len(pieces)], pieces, strict=True)] + dst[len(pieces):]

        return {n: [put_chunks(dst, pieces) for dst, pieces in zip(cache[n], src[n], strict=True)]
                for n in ("k", "v")}

    def chunks(self, positions: int) -> int | None:
        """The fewest chunks that hold positions [0, `positions`) (`chunks_holding`)."""
        return chunks_holding(self.chunk_sizes, positions)

    def decode(self, model, layers, tokens_B, positions_B, cache, chunks, mesh: Mesh):
        """The step over the first `chunks` chunks of each layer's cache (None: all), the others as they
        were: a slot's numbers are the same, bit for bit, for any `chunks` that holds its position."""
        read = cache if chunks is None else {n: [layer[:chunks] for layer in cache[n]] for n in ("k", "v")}
        hidden_BTD, new = model.decode(tokens_B, positions_B, read, mesh=mesh, layers=layers, layout=self)
        if chunks is not None:
            new = {n: [a + b[chunks:] for a, b in zip(new[n], cache[n], strict=True)] for n in ("k", "v")}
        return hidden_BTD, new

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
