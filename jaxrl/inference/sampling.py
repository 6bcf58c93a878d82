"""Token sampling on device, one pass or a few over the vocabulary, no sort.

Per row: repetition penalty, then the ban (tokens that may not be sampled yet: the stop tokens of a
request still short of its `min_tokens`, whose logits become -inf), then temperature, then the
truncations (min_p, top_k, top_p over the top-k set renormalised, in vLLM's order), then one draw by
inverse CDF. Each truncation keeps the tokens whose probability is at least a threshold: top_k's is the
k-th largest probability, top_p's the smallest probability of the smallest set of most likely tokens
(top-k and min_p applied) whose mass reaches `top_p` of theirs. Two searches find the same thresholds
(`Search`; `jaxrl.model.kernels.sampler_search` picks one by platform, the one place that does, and the
engine passes it: `search`):

* `Search.BISECT` (CPU): bisection over the bit patterns of float32 probabilities (monotone for
  non-negative floats): 31 fused compare-and-reduce passes over [B, V] per threshold, no sort (a sort of
  151,936 logits per row cost about 50 ms per row on 2 CPU cores; `lax.top_k` there sorts, and neither
  search won throughout: docs/benchmarks-log.md, 2026-11-27).
* `Search.TOP_K` (GPU, TPU): one `lax.top_k` of `TOP_K_CAP` per row, whose sorted values give top_k's
  threshold by index and top_p's by a cumulative sum, then one pass that checks top_p's candidate and
  its neighbours with the bisection's own test (the masked sum over [B, V]), so the kept sets are the
  bisection's. A row whose top_k exceeds the cap, or whose nucleus is wider than it, sends the whole
  step to the bisection (`lax.cond`). `lax.approx_max_k` is not used: below a recall of 1 it would drop
  tokens from the nucleus, changing the distribution.

Passes over [B, V] per step (each reads the [B, V] float32 once; XLA fuses the elementwise work into
them): the penalty and ban (1), the row max (1), exp and its sum (1), the greedy argmax (1), the draw's
chunk sums (1) and the logprob's gather; with truncation, TOP_K adds the top-k (1), the min_p / top-k
mask and its sum (1) and the top-p test of 4 candidates (1 fused pass, 4 at worst): about 9 to 12
(BISECT: 6 + 64). The draw uses one uniform per row
and a two-level cumulative sum (chunk sums, then within the chosen chunk), so no per-token random numbers
(Tunix spends 115 ms per step in `jax.random.categorical` over that vocabulary).

The reported logprob is that of the drawn token under `log_softmax(processed_logits / T)`, computed as
`(l - max l) / T - log(sum exp((l - max l) / T))` in float32, so it is <= 0 at any temperature, where the
processed logits are the penalised ones with the banned tokens at -inf: the distribution the token was
drawn from, up to the truncations, which cut what is sampled but not the reported logprob, as in vLLM's
default. The ban and the penalty change the distribution itself, so the logprob reflects them (an
early token of a `min_tokens` request reports its probability renormalised over the tokens that were
allowed); the trainer recomputes `log_softmax(logits / T)` with neither, so its importance ratio sees
both as the difference between the sampling and the trained policy. T = 0, greedy, reports T = 1.
A request's `top_logprobs` alternatives come from that same distribution (`sample_with_top`: one
`lax.top_k` pass over [B, V], compiled and run only in steps where some row asked for them).

The rollout engine on CPU may draw without the [B, V] logits where only a temperature applies
(`jaxrl.inference.cpu.sample_unembedded`, over `pick_chunk` and `pick_within`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.inference.protocol import SamplingParams
from jaxrl.model import kernels
from jaxrl.model.kernels import Search

CHUNK = 256  # tokens per chunk of the two-level cumulative sum
TOP_K_CAP = 256
"""Values `Search.TOP_K`'s `lax.top_k` takes per row: a top_k above it, or a nucleus wider than it, falls
back to the bisection for that step."""
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


def _truncate(p_BV: jax.Array, s: SlotSampling, search: Search | None = None) -> jax.Array:
    """Zero every token that min_p, top_k or top_p drops. `p_BV`: unnormalised probabilities with
    each row's maximum equal to 1. `search`: the thresholds' search (None: `kernels.sampler_search` of the
    default backend's platform)."""
    match search or kernels.sampler_search(kernels.default_platform()):
        case Search.BISECT:
            return _truncate_bisect(p_BV, s)
        case Search.TOP_K:
            return _truncate_top_k(p_BV, s)


def _top_p_test(p_BV: jax.Array, need_B1: jax.Array):
    """top_p's test of a threshold t [B, 1]: whether the tokens at or above it hold `need` of the mass."""
    return lambda t: jnp.sum(jnp.where(p_BV >= t, p_BV, 0.0), axis=-1, keepdims=True) >= need_B1


def _next_above(x_BC: jax.Array, t_B: jax.Array) -> jax.Array:
    """Per row, the smallest value of `x_BC` above `t_B`; +inf where none is."""
    return jnp.min(jnp.where(x_BC > t_B[:, None], x_BC, jnp.inf), axis=-1)


def _truncate_bisect(p_BV: jax.Array, s: SlotSampling) -> jax.Array:
    b, v = p_BV.shape
    k_B = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, v), v)[:, None]
    t_k = _largest_threshold(lambda t: jnp.sum(p_BV >= t, axis=-1, keepdims=True) >= k_B, b)
    p_BV = jnp.where(p_BV >= jnp.maximum(t_k, s.min_p)[:, None], p_BV, 0.0)
    need_B1 = (s.top_p * jnp.sum(p_BV, axis=-1))[:, None]
    t_p = _largest_threshold(_top_p_test(p_BV, need_B1), b)
    return jnp.where(p_BV >= t_p[:, None], p_BV, 0.0)


def _truncate_top_k(p_BV: jax.Array, s: SlotSampling) -> jax.Array:
    """`_truncate_bisect`'s result from one `lax.top_k` of `TOP_K_CAP` per row (module docstring); the
    bisection itself for a step where some row needs more than the cap."""
    kept_BV, t_p_B, beyond_B = _top_k_search(p_BV, s)
    return jax.lax.cond(jnp.any(beyond_B), lambda: _truncate_bisect(p_BV, s),
                        lambda: jnp.where(kept_BV >= t_p_B[:, None], kept_BV, 0.0))


def _top_k_search(p_BV: jax.Array, s: SlotSampling) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`_truncate_top_k`'s search: `p_BV` with top_k and min_p applied [B, V], top_p's threshold [B]
    (0: off), and whether a row needs more than `TOP_K_CAP` values (bool [B]: then neither is right)."""
    v = p_BV.shape[-1]
    cap = min(TOP_K_CAP, v)
    top_BC, _ = jax.lax.top_k(p_BV, cap)  # descending
    k_on_B = (s.top_k > 0) & (s.top_k < v)
    k_B = jnp.clip(s.top_k, 1, cap)
    t_k_B = jnp.where(k_on_B, jnp.take_along_axis(top_BC, k_B[:, None] - 1, axis=-1)[:, 0], 0.0)
    floor_B = jnp.maximum(t_k_B, s.min_p)
    kept_BV = jnp.where(p_BV >= floor_B[:, None], p_BV, 0.0)
    need_B = s.top_p * jnp.sum(kept_BV, axis=-1)
    kept_BC = jnp.where(top_BC >= floor_B[:, None], top_BC, 0.0)
    cdf_BC = jnp.cumsum(kept_BC, axis=-1)
    p_on_B = s.top_p < 1.0
    j_B = jnp.minimum(jnp.sum(cdf_BC < need_B[:, None], axis=-1), cap - 1)  # where the cumsum reaches `need`
    # The cumulative sum rounds unlike the masked sum, and values tie: test the distinct values around the
    # candidate with the bisection's own test. The threshold is the largest of u > v > w that passes, if
    # u2 (the value above u) fails; values past the cap are unknown, so w = 0 there says nothing.
    v_B = jnp.take_along_axis(kept_BC, j_B[:, None], axis=-1)[:, 0]
    u_B = _next_above(kept_BC, v_B)
    w_B = jnp.max(jnp.where(kept_BC < v_B[:, None], kept_BC, 0.0), axis=-1)
    cand_B4 = jnp.stack([_next_above(kept_BC, u_B), u_B, v_B, w_B], axis=-1)
    test = _top_p_test(kept_BV, need_B[:, None])
    good_B4 = jnp.stack([test(cand_B4[:, i:i + 1])[:, 0] for i in range(4)], axis=-1)
    good_B4 = good_B4.at[:, 3].set(good_B4[:, 3] & ((w_B > 0) | (kept_BC[:, -1] <= 0)))
    first_B = 1 + jnp.argmax(good_B4[:, 1:], axis=-1)
    found_B = jnp.any(good_B4[:, 1:], axis=-1) & ~good_B4[:, 0]
    t_p_B = jnp.where(p_on_B, jnp.take_along_axis(cand_B4, first_B[:, None], axis=-1)[:, 0], 0.0)
    return kept_BV, t_p_B, (k_on_B & (s.top_k > cap)) | (p_on_B & ~found_B)


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
           seen_BV: jax.Array | None = None, ban_BV: jax.Array | None = None,
           search: Search | None = None) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row; return (tokens int32 [B], logprobs float32 [B]).

    Args:
        logits_BV: float32 logits.
        keys_B: one PRNG key per row.
        truncate: (static) apply min_p / top_k / top_p; False skips their passes (every row has them off).
        seen_BV: bool, tokens already in each row's prompt or output; None: no repetition penalty.
        ban_BV: bool, tokens each row may not sample (`min_tokens`: `stop_ban`); a row that bans every
            token bans none. None: no ban.
        search: (static) how the truncations' thresholds are found (`Search`, the engine's
            `kernels.sampler_search` of its mesh); None: that of the default backend. Either gives the same
            tokens.
    """
    tokens_B, logprobs_B, _, _ = sample_with_top(logits_BV, s, keys_B, truncate=truncate, seen_BV=seen_BV,
                                                 ban_BV=ban_BV, top=0, search=search)
    return tokens_B, logprobs_B


def sample_with_top(logits_BV: jax.Array, s: SlotSampling, keys_B: jax.Array, *, truncate: bool,
                    seen_BV: jax.Array | None = None, ban_BV: jax.Array | None = None, top: int = 0,
                    search: Search | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`sample`, and each row's `top` most likely tokens under the distribution the sampled token's logprob
    is reported from (`log_softmax(processed_logits / T)`, T = 1 for a greedy row; before the truncations,
    as that logprob): (tokens int32 [B], logprobs float32 [B], top ids int32 [B, top], top logprobs float32
    [B, top], most likely first; ties: the lower id first). The top logprobs are the same float32 numbers
    as the sampled token's (`rel - log_z`), so a greedy row's token is its first entry, logprob for logprob
    (OpenAI's `top_logprobs`; vLLM reports its alternatives from the same distribution as the token's).
    A banned token's logprob is -inf. `top` (static) 0: no ranking pass, [B, 0] arrays. `search`: `sample`'s."""
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
    w_BV = _truncate(p_BV, s, search) if truncate else p_BV
    u_B = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_B)  # (0, 1]
    tokens_B = jnp.where(greedy_B, jnp.argmax(logits_BV, axis=-1), draw(w_BV, u_B)).astype(jnp.int32)
    logprobs_B = jnp.take_along_axis(rel_BV, tokens_B[:, None], axis=-1)[:, 0] - log_z_B
    if not top:
        b = logits_BV.shape[0]
        return tokens_B, logprobs_B, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
    top_rel_BK, top_ids_BK = jax.lax.top_k(rel_BV, top)
    return tokens_B, logprobs_B, top_ids_BK.astype(jnp.int32), top_rel_BK - log_z_B[:, None]


def mark_seen(seen_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """`seen_BV` with each row's token set."""
    return seen_BV.at[jnp.arange(tokens_B.shape[0]), tokens_B].set(True)


def stop_ban(stop_BV: jax.Array, generated_B: jax.Array, min_tokens_B: jax.Array) -> jax.Array:
    """The tokens `sample` may not draw for `min_tokens` (vLLM's): each row's stop tokens (`stop_BV`, bool)
    while it has sampled fewer than `min_tokens_B` tokens (`generated_B`, int32, before this draw). bool [B, V]."""
    return stop_BV & (generated_B < min_tokens_B)[:, None]
