"""The chunk maths every cache kind that reads part of its positions shares: how a cache of S positions is
cut into chunks (`chunk_sizes`), how many chunks hold the positions in use (`chunks_holding`), and
attention over chunks of keys/values merged one chunk at a time (`attend_chunks`).

A decode step compiled to read the first n chunks reads the positions in use, not `max_seq_len`, at a
cost of about log2(S / 128) + 1 compiled steps (one per n). Letters as in `jaxrl.model.decoder`; C
positions of one chunk.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

# Positions in the first chunk (`chunk_sizes`): a step reads the chunks that hold its slots' positions, on
# CPU each its own array, since XLA's CPU dot copies a sliced operand before reading it.
CACHE_CHUNK = 128


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


def chunk_starts(sizes: tuple[int, ...]) -> list[int]:
    """The first position of each chunk of `sizes`."""
    return list(itertools.accumulate(sizes[:-1], initial=0))


def chunks_holding(sizes: tuple[int, ...], positions: int) -> int | None:
    """The fewest chunks of `sizes` that hold positions [0, `positions`); None when that is all of them
    (a step then reads the whole cache: one program for every count past the last chunk)."""
    held = itertools.accumulate(sizes)
    n = next((n for n, h in enumerate(held, 1) if h >= positions), len(sizes))
    return None if n == len(sizes) else n


def attend_chunks(q_BKGH: jax.Array, k_BKH: jax.Array, v_BKH: jax.Array, positions_B: jax.Array,
                  chunks: list[tuple[int, jax.Array, jax.Array]]) -> jax.Array:
    """Attention of each row's one new query (float32 [B, K, G, H], pre-scaled by 1/sqrt(H)) over cache
    chunks `(start, keys [B, C, K, H], values [B, C, K, H])` (positions start .. start + C - 1, those at or
    past a row's position masked out) and this step's key/value [B, K, H]; float32 [B, K, G, H].

    Each chunk is a multiply-and-reduce (`q * k` summed over H, `p * v` summed over C) and the softmax is
    merged chunk by chunk, this step's key/value first (the running max, sum and weighted values of
    flash-decoding: Dao et al. 2023, as `jaxrl.kv.chunked.Chunked.attend`), so a chunk wholly past a row's
    position changes nothing, bit for bit, and masked positions are never read into the sums: a dense
    cache (`jaxrl.kv.dense.Dense`) and a paged one (`jaxrl.kv.paged.Paged`) chunked alike give the same
    numbers, whatever the masked positions hold (finite)."""
    f32 = jnp.float32
    top_BKG = jnp.sum(q_BKGH * k_BKH[:, :, None, :].astype(f32), axis=-1)  # this step's score: weight 1
    total_BKG = jnp.ones_like(top_BKG)
    attn_BKGH = jnp.broadcast_to(v_BKH[:, :, None, :].astype(f32), q_BKGH.shape)
    for start, k_BCKH, v_BCKH in chunks:
        c = k_BCKH.shape[1]
        before_B11C = ((start + jnp.arange(c))[None] < positions_B[:, None])[:, None, None, :]
        scores_BKGC = jnp.sum(q_BKGH[:, None] * k_BCKH[:, :, :, None, :].astype(f32), axis=-1).transpose(0, 2, 3, 1)
        scores_BKGC = jnp.where(before_B11C, scores_BKGC, -1e30)
        top_c_BKG = jnp.max(scores_BKGC, axis=-1)
        probs_BKGC = jnp.where(before_B11C, jnp.exp(scores_BKGC - top_c_BKG[..., None]), 0.0)
        new_top_BKG = jnp.maximum(top_BKG, top_c_BKG)
        old_w_BKG, chunk_w_BKG = jnp.exp(top_BKG - new_top_BKG), jnp.exp(top_c_BKG - new_top_BKG)
        total_BKG = total_BKG * old_w_BKG + jnp.sum(probs_BKGC, axis=-1) * chunk_w_BKG
        values_BKGH = jnp.sum(probs_BKGC.transpose(0, 3, 1, 2)[..., None] * v_BCKH[:, :, :, None, :].astype(f32),
                              axis=1)
        attn_BKGH = attn_BKGH * old_w_BKG[..., None] + values_BKGH * chunk_w_BKG[..., None]
        top_BKG = new_top_BKG
    return attn_BKGH / total_BKG[..., None]
