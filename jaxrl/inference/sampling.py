"""Token sampling on device, one pass or a few over the vocabulary, no sort.

Per row: repetition penalty, then the ban (tokens that may not be sampled yet: the stop tokens of a
request still short of its `min_tokens`, whose logits become -inf), then temperature, then the
truncations (min_p, top_k, top_p over the top-k set renormalised, in vLLM's order), then one draw by
inverse CDF. Each truncation keeps the tokens whose probability is at least a threshold; the top_k and
top_p thresholds are found by bisection over the bit patterns of float32 probabilities (monotone for
non-negative floats), so 31 fused compare-and-reduce passes over [B, V] give the exact threshold with
no sort (a sort of 151,936 logits per row cost about 50 ms per row on 2 CPU cores). The draw uses one
uniform per row and a two-level cumulative sum (chunk sums, then within the chosen chunk), so no
per-token random numbers (Tunix spends 115 ms per step in `jax.random.categorical` over that vocabulary).

The reported logprob is that of the drawn token under `log_softmax(processed_logits / T)`, computed as
`(l - max l) / T - log(sum exp((l - max l) / T))` in float32, so it is <= 0 at any temperature, where the
processed logits are the penalised ones with the banned tokens at -inf: the distribution the token was
drawn from, up to the truncations, which cut what is sampled but not the reported logprob, as in vLLM's
default. The ban and the penalty change the distribution itself, so the logprob reflects them (an
early token of a `min_tokens` request reports its probability renormalised over the tokens that were
allowed); the trainer recomputes `log_softmax(logits / T)` with neither, so its importance ratio sees
both as the difference between the sampling and the trained policy. T = 0, greedy, reports T = 1.

When no row truncates, penalises or bans (the common RL case: temperature only), `sample_unembedded`
draws from the same distribution with the same uniform without the [B, V] logits: the unembedding runs
over vocabulary blocks whose logits stay in cache, each leaving its chunk maxima and chunk sums (the online
softmax, Milakov & Gimelshein 2018), and only the chosen chunk's logits are computed again for the draw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.inference.protocol import SamplingParams

CHUNK = 256  # tokens per chunk of the two-level cumulative sum
BLOCK = 8192  # vocabulary rows per step of `sample_unembedded`'s scan (a multiple of CHUNK)
_ONE_BITS = 0x3F800000  # float32 1.0


@struct.dataclass
class SlotSampling:
    """Sampling settings of each row, all [B]: float32 temperature, top_p, min_p, repetition_penalty;
    int32 top_k (<= 0: off) and min_tokens (tokens sampled before a stop token may be; 0: off)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    min_tokens: jax.Array

    @classmethod
    def of(cls, params: SamplingParams) -> SlotSampling:
        """One row with `params`' settings."""
        f32 = jnp.float32
        return cls(jnp.array([params.temperature], f32), jnp.array([params.top_p], f32),
                   jnp.array([params.top_k], jnp.int32), jnp.array([params.min_p], f32),
                   jnp.array([params.repetition_penalty], f32), jnp.array([params.min_tokens], jnp.int32))

    @classmethod
    def neutral(cls, b: int) -> SlotSampling:
        """`b` greedy rows with every truncation, the penalty and `min_tokens` off."""
        f32 = jnp.float32
        return cls(jnp.zeros((b,), f32), jnp.ones((b,), f32), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), f32),
                   jnp.ones((b,), f32), jnp.zeros((b,), jnp.int32))


def _largest_threshold(ok, b: int) -> jax.Array:
    """Per row, the largest float32 t in [0, 1] with `ok(t_B1)` true, for `ok` true at 0 and monotone
    (true up to the threshold, false above it). Bisection over bit patterns; float32 [B]."""

    def step(_, lo_hi):
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        good = ok(jax.lax.bitcast_convert_type(mid, jnp.float32)[:, None])[:, 0]
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

    lo = jnp.zeros((b,), jnp.int32)
    hi = jnp.full((b,), _ONE_BITS + 1, jnp.int32)
    lo, _ = jax.lax.fori_loop(0, 31, step, (lo, hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def _truncate(p_BV: jax.Array, s: SlotSampling) -> jax.Array:
    """Zero every token that min_p, top_k or top_p drops. `p_BV`: unnormalised probabilities with
    each row's maximum equal to 1."""
    b, v = p_BV.shape
    k_B = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, v), v)[:, None]
    t_k = _largest_threshold(lambda t: jnp.sum(p_BV >= t, axis=-1, keepdims=True) >= k_B, b)
    p_BV = jnp.where(p_BV >= jnp.maximum(t_k, s.min_p)[:, None], p_BV, 0.0)
    need_B1 = (s.top_p * jnp.sum(p_BV, axis=-1))[:, None]
    t_p = _largest_threshold(lambda t: jnp.sum(jnp.where(p_BV >= t, p_BV, 0.0), axis=-1, keepdims=True) >= need_B1,
                             b)
    return jnp.where(p_BV >= t_p[:, None], p_BV, 0.0)


def _last_positive(w_BZ: jax.Array) -> jax.Array:
    x = w_BZ.shape[-1]
    return x - 1 - jnp.argmax(w_BZ[:, ::-1] > 0, axis=-1)


def pick_chunk(chunk_BJ: jax.Array, u_B: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first level of the inverse CDF: of non-negative chunk weights [B, J] and u in (0, 1], the chunk
    whose cumulative weight first reaches `u * total` (never a zero-weight chunk), int32 [B]; the weight
    left to cover inside it, `u * total` minus the chunks before it, [B]; and the total [B]."""
    cdf_BJ = jnp.cumsum(chunk_BJ, axis=-1)
    target_B = u_B * cdf_BJ[:, -1]
    c_B = jnp.minimum(jnp.sum(cdf_BJ < target_B[:, None], axis=-1), _last_positive(chunk_BJ))
    rest_B = target_B - jnp.take_along_axis(cdf_BJ - chunk_BJ, c_B[:, None], axis=-1)[:, 0]
    return c_B.astype(jnp.int32), rest_B, cdf_BJ[:, -1]


def pick_within(w_BC: jax.Array, rest_B: jax.Array) -> jax.Array:
    """The second level: the index in the chosen chunk's weights [B, C] where their cumulative sum first
    reaches `rest_B` (`pick_chunk`'s), never a zero-weight token; int32 [B]."""
    i_B = jnp.minimum(jnp.sum(jnp.cumsum(w_BC, axis=-1) < rest_B[:, None], axis=-1), _last_positive(w_BC))
    return i_B.astype(jnp.int32)


def draw(w_BV: jax.Array, u_B: jax.Array) -> jax.Array:
    """Index of the token whose cumulative weight first reaches `u * total`, for u in (0, 1]; never a
    zero-weight token. `w_BV`: non-negative weights, each row with one positive at least. int32 [B]."""
    b, v = w_BV.shape
    n = -(-v // CHUNK)
    w_BJC = jnp.pad(w_BV, ((0, 0), (0, n * CHUNK - v))).reshape(b, n, CHUNK)
    c_B, rest_B, _ = pick_chunk(jnp.sum(w_BJC, axis=-1), u_B)
    w_BC = jnp.take_along_axis(w_BJC, c_B[:, None, None], axis=1)[:, 0]
    return c_B * CHUNK + pick_within(w_BC, rest_B)


def sample(logits_BV: jax.Array, s: SlotSampling, keys_B: jax.Array, *, truncate: bool,
           seen_BV: jax.Array | None = None, ban_BV: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row; return (tokens int32 [B], logprobs float32 [B]).

    Args:
        logits_BV: float32 logits.
        keys_B: one PRNG key per row.
        truncate: (static) apply min_p / top_k / top_p; False skips their passes (every row has them off).
        seen_BV: bool, tokens already in each row's prompt or output; None: no repetition penalty.
        ban_BV: bool, tokens each row may not sample (`min_tokens`: `stop_ban`); a row that bans every
            token bans none. None: no ban.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    if seen_BV is not None:
        r_B1 = s.repetition_penalty[:, None]
        logits_BV = jnp.where(seen_BV, jnp.where(logits_BV > 0, logits_BV / r_B1, logits_BV * r_B1), logits_BV)
    if ban_BV is not None:
        ban_BV = ban_BV & ~jnp.all(ban_BV, axis=-1, keepdims=True)
        logits_BV = jnp.where(ban_BV, -jnp.inf, logits_BV)
    greedy_B = s.temperature <= 0.0
    # The max subtracted before the scaling: (l - max) / T is <= 0, exactly 0 at the max whatever XLA fuses
    # (l / T - max(l / T) fused into exp as one FMA left the max at +-1 ulp of l / T: logprobs of +0.03 at T 1e-4).
    rel_BV = (logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)) / jnp.where(greedy_B, 1.0, s.temperature)[:, None]
    p_BV = jnp.exp(rel_BV)  # unnormalised, max exp(0) = 1
    log_z_B = jnp.log(jnp.sum(p_BV, axis=-1))  # >= log 1 = 0
    w_BV = _truncate(p_BV, s) if truncate else p_BV
    u_B = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_B)  # (0, 1]
    tokens_B = jnp.where(greedy_B, jnp.argmax(logits_BV, axis=-1), draw(w_BV, u_B)).astype(jnp.int32)
    return tokens_B, jnp.take_along_axis(rel_BV, tokens_B[:, None], axis=-1)[:, 0] - log_z_B


def vocab_blocks(unembed_VD: jax.Array, block: int = BLOCK) -> tuple[jax.Array, ...]:
    """The unembedding's rows [V, D] as `sample_unembedded`'s blocks: `block` rows each, the last shorter.
    Called outside jit (`Engine.prepare`) each block is a copy in its own array; XLA's CPU backend copies a
    block out of a larger array (a dynamic or static slice) before every dot that reads it, which cost a
    32-row, hidden-256 step 42 ms scanning 8192-row slices against 26 ms over separate arrays (the
    [V, D] x [D, 32] product alone: 23 ms; Nov 2026, 2 loaded cores, one process)."""
    return tuple(unembed_VD[i:i + block] for i in range(0, unembed_VD.shape[0], block))


def _block_stats(l_XB: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """Of scaled logits [X, B] (X a multiple of `chunk`, padding at -inf), per chunk of `chunk` rows: the
    max [X / chunk, B], and the sum of exp(l - the block's max) [X / chunk, B]. Two fused passes over the
    logits (max, then exp-sum); no argmax, whose variadic (value, index) reduce cost XLA's CPU backend a
    sixth of a 32-row decode step."""
    x, b = l_XB.shape
    l_KCB = l_XB.reshape(x // chunk, chunk, b)
    m_KB = jnp.max(l_KCB, axis=1)
    return m_KB, jnp.sum(jnp.exp(l_KCB - jnp.max(m_KB, axis=0)[None, None]), axis=1)


def _scaled(h_BD: jax.Array, inv_t_B: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """(h', post) such that `(rows @ h'.T) * post` are the logits over the temperature: a float32 `h_BD`
    is scaled by `inv_t_B` before the dots (post None: no pass over the logits); another dtype keeps its
    precision and its products are scaled (post `inv_t_B`)."""
    return (h_BD * inv_t_B[:, None], None) if h_BD.dtype == jnp.float32 else (h_BD, inv_t_B)


def _blocks_stats(h_BD, blocks_XD, post_B, chunk: int):
    """`_block_stats` of each vocabulary block's `rows_XD @ h_BD.T (* post_B)` (`_scaled`), unrolled over
    the blocks (each its own buffer): the chunk maxima [B, N] and the chunk weights [B, N] (the chunk sums
    scaled by exp(block max - row max)), N chunks in all, and the row max [B]. A block short of whole
    chunks (the last) is padded at -inf."""
    m_KB, e_KB = [], []
    for rows_XD in blocks_XD:  # the rows as the dot's left operand, as `qwen3.OutMajor`
        l_XB = jax.lax.dot_general(rows_XD, h_BD, (((1,), (1,)), ((), ()))).astype(jnp.float32)
        l_XB = l_XB if post_B is None else l_XB * post_B[None]
        l_XB = jnp.pad(l_XB, ((0, -l_XB.shape[0] % chunk), (0, 0)), constant_values=-jnp.inf)
        m, e = _block_stats(l_XB, chunk)
        m_KB, e_KB = [*m_KB, m], [*e_KB, e]
    top_JB = jnp.stack([jnp.max(m, axis=0) for m in m_KB])
    top_B = jnp.max(top_JB, axis=0)
    scale_JB = jnp.exp(top_JB - top_B[None])
    w_BN = jnp.concatenate([e * scale_JB[j][None] for j, e in enumerate(e_KB)]).T
    return jnp.concatenate(m_KB).T, w_BN, top_B


def sample_unembedded(hidden_BD: jax.Array, unembed_VD: jax.Array, s: SlotSampling, keys_B: jax.Array, *,
                      blocks: tuple[jax.Array, ...] | None = None, chunk: int = CHUNK
                      ) -> tuple[jax.Array, jax.Array]:
    """`sample(hidden_BD @ unembed_VD.T, s, keys_B, truncate=False)` without the [B, V] logits: the same
    distribution (temperature only: no truncation, penalty or ban) and the same uniform per row, so the
    same tokens up to float rounding near a chunk or token boundary. Returns (tokens int32 [B], logprobs
    float32 [B]).

    The unembedding runs over vocabulary blocks (`vocab_blocks`), each block's logits [X, B] staying in
    cache: per chunk of `chunk` tokens the max and the sum of exp(l - block max), as in the online softmax
    (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", arXiv:1805.02867): rescaled
    by exp(block max - row max) afterwards they give the chunk weights and the log normaliser `lse` over
    the whole vocabulary. The draw is `draw`'s inverse CDF (`pick_chunk`, `pick_within`): the chunk from
    the chunk weights, then, within it, from that chunk's logits, recomputed ([C, D] x [D] per row,
    cheaper than writing and reading back the [B, V] logits); its logprob is l_token / T - lse. A row
    whose recomputed chunk underflows to zero everywhere (weights below the float32 range) takes the
    chunk's largest logit. Greedy rows (T = 0) take the first chunk whose max is the row's max and, in
    it, the first maximum of the recomputed logits (the first maximum of the logits, up to rounding
    between the two products), reported with T = 1. Vocabulary padding (rows past V) is at -inf and never
    drawn.

    Args:
        hidden_BD: final hidden states, any float dtype (the product is cast to float32, as `qwen3.logits`).
        unembed_VD: the unembedding as [V, D] rows: a tied embedding as it is, or `qwen3.OutMajor.w_OI`
            (the rows as the dot's left operand: XLA's CPU dot's fast orientation at a few rows).
        keys_B: one PRNG key per row.
        blocks: `unembed_VD`'s rows in blocks, every one but the last a multiple of `chunk` rows
            (`vocab_blocks`, made once outside jit); None: `vocab_blocks(unembed_VD)` here, slices copied
            at every call.

    Raises:
        ValueError: a block other than the last is not a multiple of `chunk` rows.
    """
    v = unembed_VD.shape[0]
    if v < chunk:  # a toy vocabulary: one chunk
        chunk = v
    blocks = vocab_blocks(unembed_VD) if blocks is None else blocks
    if any(b.shape[0] % chunk for b in blocks[:-1]):
        raise ValueError(f"vocabulary blocks of {[b.shape[0] for b in blocks]} rows: not all whole chunks of {chunk}")
    greedy_B = s.temperature <= 0.0
    inv_t_B = 1.0 / jnp.where(greedy_B, 1.0, s.temperature).astype(jnp.float32)
    h_BD, post_B = _scaled(hidden_BD, inv_t_B)
    m_BN, w_BN, top_B = _blocks_stats(h_BD, blocks, post_B, chunk)
    u_B = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_B)  # (0, 1], as `sample`
    drawn_B, rest_B, total_B = pick_chunk(w_BN, u_B)
    c_B = jnp.where(greedy_B, jnp.argmax(m_BN, axis=-1), drawn_B)
    start_B = jnp.minimum(c_B * chunk, v - chunk)  # the last chunk may be short: its window ends at V
    rows_BCD = jax.vmap(lambda i: jax.lax.dynamic_slice_in_dim(unembed_VD, i, chunk))(start_B)
    l_BC = jnp.einsum("BD,BCD->BC", h_BD, rows_BCD).astype(jnp.float32)
    l_BC = l_BC if post_B is None else l_BC * post_B[:, None]
    l_BC = jnp.where(start_B[:, None] + jnp.arange(chunk)[None] >= c_B[:, None] * chunk, l_BC, -jnp.inf)
    w_BC = jnp.exp(l_BC - top_B[:, None])
    i_B = pick_within(w_BC, rest_B)
    i_B = jnp.where(jnp.any(w_BC > 0, axis=-1) & ~greedy_B, i_B, jnp.argmax(l_BC, axis=-1))
    # log p = (l - max) - log(sum exp(l - max)): l - max <= 0 and the sum >= exp(0) = 1 hold exactly, but the
    # token's logit is a second product (rounded apart from the blocks' max by an ulp of l / T: +0.3 at T 1e-4)
    # and the weights' exp may fuse with the scaling, so both bounds are applied: a logprob is never above 0.
    rel_B = jnp.minimum(jnp.take_along_axis(l_BC, i_B[:, None], axis=-1)[:, 0] - top_B, 0.0)
    return (start_B + i_B).astype(jnp.int32), rel_B - jnp.maximum(jnp.log(total_B), 0.0)


def mark_seen(seen_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """`seen_BV` with each row's token set."""
    return seen_BV.at[jnp.arange(tokens_B.shape[0]), tokens_B].set(True)


def stop_ban(stop_BV: jax.Array, generated_B: jax.Array, min_tokens_B: jax.Array) -> jax.Array:
    """The tokens `sample` may not draw for `min_tokens` (vLLM's): each row's stop tokens (`stop_BV`, bool)
    while it has sampled fewer than `min_tokens_B` tokens (`generated_B`, int32, before this draw). bool [B, V]."""
    return stop_BV & (generated_B < min_tokens_B)[:, None]
