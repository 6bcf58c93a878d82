"""Sampling on device: each parameter checked against the distribution it should draw from, with fixed
seeds (40,000 draws: a frequency is within 0.01 of its probability with room to spare)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.inference.cpu import sample_unembedded, vocab_blocks
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.sampling import (
    CHUNK,
    TOP_K_CAP,
    Search,
    SlotSampling,
    _top_k_search,
    _truncate,
    draw,
    mark_seen,
    sample,
    sample_with_top,
    stop_ban,
)
from jaxrl.model import kernels

LOGITS = jnp.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
N = 40_000


def _rows(n, **kw):
    one = SlotSampling.of(SamplingParams(**kw))
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,)), one)


def _draws(logits=LOGITS, n=N, truncate=True, seen=None, seed=42, **kw):
    keys = jax.random.split(jax.random.key(seed), n)
    seen_BV = None if seen is None else jnp.broadcast_to(seen, (n, logits.shape[-1]))
    fn = jax.jit(lambda lg, k, sn: sample(lg, _rows(n, **kw), k, truncate=truncate, seen_BV=sn))
    toks, lps = fn(jnp.broadcast_to(logits, (n, logits.shape[-1])), keys, seen_BV)
    return np.asarray(toks), np.asarray(lps)


def _freq(toks, v=8):
    return np.bincount(toks, minlength=v) / toks.size


def _softmax(x):
    e = np.exp(np.asarray(x, np.float64) - np.max(x))
    return e / e.sum()


@pytest.mark.numerics
@pytest.mark.parametrize("truncate", [False, True])
def test_temperature_draws_from_the_tempered_softmax(truncate):
    toks, lps = _draws(truncate=truncate, temperature=0.7)
    want = _softmax(LOGITS / 0.7)
    np.testing.assert_allclose(_freq(toks), want, atol=0.01)
    np.testing.assert_allclose(lps, np.log(want)[toks], rtol=1e-5)


@pytest.mark.numerics
def test_temperature_zero_is_greedy_with_the_t1_logprob():
    toks, lps = _draws(n=64, temperature=0.0, top_k=3)
    assert (toks == 0).all()
    np.testing.assert_allclose(lps, np.log(_softmax(LOGITS)[0]), rtol=1e-5)


@pytest.mark.numerics
def test_top_k_keeps_k_tokens_renormalised_and_reports_the_full_logprob():
    toks, lps = _draws(top_k=3)
    p = _softmax(LOGITS)
    freq = _freq(toks)
    np.testing.assert_allclose(freq[:3], p[:3] / p[:3].sum(), atol=0.01)
    assert freq[3:].sum() == 0
    np.testing.assert_allclose(lps, np.log(p)[toks], rtol=1e-5)


@pytest.mark.numerics
def test_top_p_keeps_the_smallest_nucleus_with_that_mass():
    p = _softmax(LOGITS)
    toks, _ = _draws(top_p=0.6)
    nucleus = int(np.searchsorted(np.cumsum(p), 0.6) + 1)
    freq = _freq(toks)
    np.testing.assert_allclose(freq[:nucleus], p[:nucleus] / p[:nucleus].sum(), atol=0.01)
    assert freq[nucleus:].sum() == 0


@pytest.mark.numerics
def test_top_p_applies_to_the_top_k_set_renormalised():
    # vLLM's order: top_k first, then top_p over the renormalised top-k distribution.
    p = _softmax(LOGITS)
    q = p[:4] / p[:4].sum()
    keep = int(np.searchsorted(np.cumsum(q), 0.8) + 1)
    toks, _ = _draws(top_k=4, top_p=0.8)
    freq = _freq(toks)
    np.testing.assert_allclose(freq[:keep], q[:keep] / q[:keep].sum(), atol=0.01)
    assert freq[keep:].sum() == 0


@pytest.mark.numerics
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    p = _softmax(LOGITS / 0.5)
    kept = p >= 0.2 * p.max()
    toks, lps = _draws(temperature=0.5, min_p=0.2)
    freq = _freq(toks)
    np.testing.assert_allclose(freq, np.where(kept, p, 0) / p[kept].sum(), atol=0.01)
    np.testing.assert_allclose(lps, np.log(p)[toks], rtol=1e-5)


@pytest.mark.numerics
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    seen = jnp.array([True, False, False, False, False, True, False, False])
    toks, lps = _draws(seen=seen, repetition_penalty=2.0)
    lg = np.asarray(LOGITS).copy()
    lg[0] /= 2.0  # positive: divided
    lg[5] *= 2.0  # negative: multiplied
    want = _softmax(lg)
    np.testing.assert_allclose(_freq(toks), want, atol=0.01)
    np.testing.assert_allclose(lps, np.log(want)[toks], rtol=1e-5)
    # penalty 1 leaves a seen row unchanged
    toks1, _ = _draws(seen=seen, repetition_penalty=1.0)
    np.testing.assert_allclose(_freq(toks1), _softmax(LOGITS), atol=0.01)


def test_greedy_sees_the_penalty():
    seen = jnp.zeros(8, bool).at[0].set(True)
    toks, _ = _draws(n=4, seen=seen, temperature=0.0, repetition_penalty=10.0)
    assert (toks == 1).all()


@pytest.mark.numerics
def test_stop_ban_masks_stop_tokens_until_min_tokens_and_the_logprob_is_renormalised():
    """`min_tokens`: a row short of it draws from the softmax without its stop tokens, greedy included,
    and reports the logprob of that distribution; a row past it, or one that would ban every token,
    draws from the whole."""
    stop = jnp.zeros((2, 8), bool).at[:, jnp.array([0, 2])].set(True)
    ban = stop_ban(stop, jnp.array([1, 3]), jnp.array([3, 3]))
    assert np.asarray(ban).tolist() == [[True, False, True] + [False] * 5, [False] * 8]
    n = N
    banned = jnp.broadcast_to(ban[0], (n, 8))
    keys = jax.random.split(jax.random.key(3), n)
    toks, lps = jax.jit(lambda lg, k, b: sample(lg, _rows(n, temperature=0.7, top_k=4), k, truncate=True, ban_BV=b))(
        jnp.broadcast_to(LOGITS, (n, 8)), keys, banned)
    toks, lps = np.asarray(toks), np.asarray(lps)
    want = _softmax(np.where(np.asarray(ban[0]), -np.inf, LOGITS / 0.7))
    kept = want * (np.arange(8) < 6)  # top_k = 4 of what the ban leaves: 1, 3, 4, 5
    np.testing.assert_allclose(_freq(toks), kept / kept.sum(), atol=0.01)
    np.testing.assert_allclose(lps, np.log(want[toks]), rtol=1e-5)
    greedy, lp = sample(LOGITS[None], _rows(1, temperature=0.0), keys[:1], truncate=False, ban_BV=ban[:1])
    assert int(greedy[0]) == 1
    np.testing.assert_allclose(float(lp[0]), np.log(_softmax(np.where(ban[0], -np.inf, LOGITS))[1]), rtol=1e-5)
    every, _ = sample(LOGITS[None], _rows(1, temperature=0.0), keys[:1], truncate=False,
                      ban_BV=jnp.ones((1, 8), bool))
    assert int(every[0]) == 0


def test_top_logprobs_rank_the_distribution_the_token_logprob_is_from():
    """`sample_with_top`'s alternatives: the top of log_softmax(penalised, banned logits / T) (T = 1 when
    greedy), before top_k cuts what is drawn; the same tokens and logprobs as `sample`; a greedy row's token
    first in its list with the very same logprob."""
    seen = jnp.zeros((2, 8), bool).at[:, 0].set(True)
    ban = jnp.zeros((2, 8), bool).at[:, 1].set(True)
    rows = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), _rows(1, temperature=0.7, top_k=2,
                                                                    repetition_penalty=2.0), _rows(1, temperature=0.0))
    keys = jax.random.split(jax.random.key(5), 2)
    logits = jnp.broadcast_to(LOGITS, (2, 8))
    toks, lps, ids, top_lps = jax.jit(lambda lg, k: sample_with_top(lg, rows, k, truncate=True, seen_BV=seen,
                                                                    ban_BV=ban, top=4))(logits, keys)
    for row, (t, penalty) in enumerate(((0.7, 2.0), (1.0, 1.0))):
        processed = np.where(np.arange(8) == 1, -np.inf, np.asarray(LOGITS) / np.where(np.arange(8) == 0, penalty, 1))
        with np.errstate(divide="ignore"):  # the banned token: log 0 = -inf, as the engine reports it
            want = np.log(_softmax(processed / t))
        assert np.asarray(ids[row]).tolist() == np.argsort(-want, kind="stable")[:4].tolist()
        np.testing.assert_allclose(np.asarray(top_lps[row]), np.sort(want)[::-1][:4], rtol=1e-5)
    assert int(ids[1, 0]) == int(toks[1]) and float(top_lps[1, 0]) == float(lps[1])
    plain = sample(logits, rows, keys, truncate=True, seen_BV=seen, ban_BV=ban)
    assert np.asarray(plain[0]).tolist() == np.asarray(toks).tolist()
    assert np.asarray(plain[1]).tolist() == np.asarray(lps).tolist()


def test_seed_fixes_the_draws_and_different_seeds_differ():
    a, _ = _draws(n=256, seed=1)
    b, _ = _draws(n=256, seed=1)
    c, _ = _draws(n=256, seed=2)
    assert (a == b).all() and (a != c).any()


@pytest.mark.numerics
def test_large_vocab_across_chunks_and_per_row_settings():
    # V not a multiple of CHUNK; mass spread over several chunks; each row its own settings.
    v = 3 * CHUNK + 37
    logits = jnp.full((v,), -30.0).at[jnp.array([5, CHUNK + 1, 2 * CHUNK + 200, v - 1])].set(
        jnp.array([1.0, 0.5, 0.0, 0.8]))
    n = N // 2
    rows = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), _rows(n, temperature=1.0), _rows(n, top_k=2))
    keys = jax.random.split(jax.random.key(0), 2 * n)
    toks, _ = jax.jit(lambda lg, k: sample(lg, rows, k, truncate=True))(jnp.broadcast_to(logits, (2 * n, v)), keys)
    toks = np.asarray(toks)
    p = _softmax(np.asarray(logits))
    idx = np.array([5, CHUNK + 1, 2 * CHUNK + 200, v - 1])
    np.testing.assert_allclose(np.bincount(toks[:n], minlength=v)[idx] / n, p[idx] / p[idx].sum(), atol=0.01)
    top2 = np.array([5, v - 1])
    np.testing.assert_allclose(np.bincount(toks[n:], minlength=v)[top2] / n, p[top2] / p[top2].sum(), atol=0.01)
    assert set(toks[n:]) <= set(top2.tolist())


def test_draw_never_picks_a_zero_weight_token():
    w = jnp.zeros((6, 2 * CHUNK)).at[:, 3].set(1.0).at[:, CHUNK + 7].set(2.0)
    u = jnp.array([1e-9, 0.2, 1 / 3, 0.5, 0.999999, 1.0])
    got = np.asarray(draw(w, u))
    assert set(got) <= {3, CHUNK + 7}
    assert got[0] == 3 and got[-1] == CHUNK + 7


def test_mark_seen():
    seen = mark_seen(jnp.zeros((2, 5), bool), jnp.array([1, 4]))
    assert np.asarray(seen).tolist() == [[False, True, False, False, False], [False, False, False, False, True]]


def test_chi_square_with_every_truncation_at_once():
    """Temperature, then top_k, min_p and top_p together, over a vocabulary of several chunks: the draws'
    frequencies pass Pearson's chi-square test against the truncated, renormalised distribution (fixed
    seed, p > 0.001), nothing outside it is drawn, and the logprobs are the untruncated tempered ones."""
    from scipy.stats import chisquare

    v, n = 2 * CHUNK + 11, N
    logits = jax.random.normal(jax.random.key(7), (v,)) * 2.0
    toks, lps = _draws(logits=logits, n=n, temperature=0.8, top_k=20, min_p=0.05, top_p=0.9)
    p = _softmax(np.asarray(logits) / 0.8)
    order = np.argsort(-p)
    q = np.zeros(v)
    q[order[:20]] = p[order[:20]]  # top_k
    q[q < 0.05 * p.max()] = 0.0  # min_p
    q /= q.sum()
    kept_sorted = np.cumsum(np.sort(q)[::-1])
    nucleus = order[: int(np.searchsorted(kept_sorted, 0.9) + 1)]  # top_p over what is left, renormalised
    want = np.zeros(v)
    want[nucleus] = q[nucleus] / q[nucleus].sum()
    counts = np.bincount(toks, minlength=v)
    assert counts[want == 0].sum() == 0 and len(nucleus) > 3
    assert chisquare(counts[nucleus], want[nucleus] * n).pvalue > 1e-3
    np.testing.assert_allclose(lps, np.log(p)[toks], rtol=1e-5)


def _unembedded(hidden, unembed, n, seed=3, **kw):
    """`n` draws of `sample_unembedded` at a toy chunk of 8 and block of 32 (V = 87: two whole blocks and a
    tail of 23, padded to 24), every row the same hidden state. `unembed`: [D, V], given to the sampler as
    its [V, D] rows."""
    keys = jax.random.split(jax.random.key(seed), n)
    fn = jax.jit(lambda h, e, k: sample_unembedded(h, e, _rows(n, **kw), k, blocks=vocab_blocks(e, 32), chunk=8))
    toks, lps = fn(jnp.broadcast_to(hidden, (n, hidden.shape[-1])), jnp.asarray(unembed).T, keys)
    return np.asarray(toks), np.asarray(lps)


@pytest.mark.numerics
def test_blocked_sampler_chi_square_and_logprobs():
    """The unembedding fused with the draw over vocabulary blocks: the draws pass Pearson's chi-square
    test against softmax(h @ E / T) (fixed seed, p > 0.001; bins under 5 expected draws pooled),
    the logprobs are its log_softmax to 1e-5, and the seed fixes the draws as `sample` does (the same
    uniform per row: the same tokens as `sample` over the full logits, up to float rounding)."""
    from scipy.stats import chisquare

    v, n = 87, N
    hidden = jax.random.normal(jax.random.key(1), (4,))
    unembed = jax.random.normal(jax.random.key(2), (4, v))
    toks, lps = _unembedded(hidden, unembed, n, temperature=0.8)
    logits = np.asarray(hidden, np.float64) @ np.asarray(unembed, np.float64) / 0.8
    want = _softmax(logits) * n
    counts = np.bincount(toks, minlength=v)
    assert toks.max() < v and len(set(toks.tolist())) > 40
    big = want >= 5
    obs, exp = counts[big], want[big]
    if not big.all():
        obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, want[~big].sum())
    assert chisquare(obs, exp).pvalue > 1e-3
    log_p = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    np.testing.assert_allclose(lps, log_p[toks], atol=1e-5)
    keys = jax.random.split(jax.random.key(3), 512)
    full, _ = sample(jnp.broadcast_to(hidden @ unembed, (512, v)), _rows(512, temperature=0.8), keys, truncate=False)
    assert (np.asarray(full) == toks[:512]).mean() > 0.99


@pytest.mark.numerics
def test_blocked_sampler_greedy_is_the_first_argmax_with_the_t1_logprob():
    # the maximum, tied, in the second block and in the tail: the first one wins, as jnp.argmax
    logits = jnp.linspace(-2.0, 1.0, 87).at[40].set(3.0).at[80].set(3.0)
    toks, lps = _unembedded(jnp.ones((1,)), logits[None], 16, temperature=0.0)
    assert (toks == 40).all()
    np.testing.assert_allclose(lps, np.log(_softmax(np.asarray(logits))[40]), atol=1e-5)


def test_blocked_sampler_never_draws_padding_or_a_zero_probability_token():
    """All the mass on the first and the last real token (the tail block's last, next to its padding);
    every other weight underflows to zero. Uniforms near 0 and near 1 included."""
    logits = jnp.full((87,), -1e4).at[0].set(0.0).at[86].set(0.0)
    toks, lps = _unembedded(jnp.ones((1,)), logits[None], 4096, temperature=1.0)
    assert set(toks.tolist()) == {0, 86}
    np.testing.assert_allclose(lps, np.log(0.5), atol=1e-5)
    assert abs((toks == 86).mean() - 0.5) < 0.05


@pytest.mark.numerics
def test_logprobs_are_never_above_zero_at_any_temperature():
    """Issue 35 item 6: at temperature 1e-4 the sampler reported logprobs of +0.0156 (l / T rounded once
    in the max and again, fused into an FMA, in the exp; in the blocked sampler the token's logit a second
    product). Both samplers, 256 rows of logits of magnitude ~50, temperatures 1e-4 to 2: every logprob
    <= 0, and equal to float64's log_softmax(l / T) to 1e-5 relative to the logits' scale / T."""
    n, v = 256, 1000
    h = jax.random.normal(jax.random.key(1), (n, 64)) * 3
    e = jax.random.normal(jax.random.key(2), (v, 64))
    keys = jax.random.split(jax.random.key(3), n)
    full = jax.jit(lambda h, e, k, r: sample(h @ e.T, r, k, truncate=False))
    fused = jax.jit(lambda h, e, k, r: sample_unembedded(h, e, r, k, blocks=vocab_blocks(e, 256), chunk=64))
    for t in (1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0, 2.0):
        rows = _rows(n, temperature=t)
        (toks, lps), (blocked, blps) = full(h, e, keys, rows), fused(h, e, keys, rows)
        assert float(lps.max()) <= 0.0 and float(blps.max()) <= 0.0, (t, float(lps.max()), float(blps.max()))
        logits = np.asarray(h, np.float64) @ np.asarray(e, np.float64).T / t
        want = logits - logits.max(-1, keepdims=True)
        want -= np.log(np.exp(want).sum(-1, keepdims=True))
        for tk, lp in ((toks, lps), (blocked, blps)):
            got = want[np.arange(n), np.asarray(tk)]
            np.testing.assert_allclose(np.asarray(lp), got, atol=1e-5 * 50 / t + 1e-5)


def _settings(b, rng):
    """`b` rows of mixed truncations: top_k off, small, at and past `TOP_K_CAP`; top_p off and on; min_p."""
    f32 = jnp.float32
    top_k = rng.choice([0, 1, 3, 50, TOP_K_CAP, TOP_K_CAP + 1, 1000], b)
    top_p = rng.choice([1.0, 0.5, 0.9, 0.95, 0.999], b)
    min_p = rng.choice([0.0, 0.0, 0.01], b)
    return SlotSampling(jnp.ones((b,), f32), jnp.asarray(top_p, f32), jnp.asarray(top_k, jnp.int32),
                        jnp.asarray(min_p, f32), jnp.ones((b,), f32), jnp.zeros((b,), jnp.int32))


@pytest.mark.numerics
@pytest.mark.parametrize(("scale", "nucleus"), [(0.5, 0.02), (3.0, 0.5), (12.0, 0.999)])  # flat to peaked
def test_top_k_search_keeps_exactly_the_bisections_tokens(scale, nucleus):
    """The accelerators' search (`Search.TOP_K`, forced here on CPU) keeps bit for bit the weights the CPU's
    bisection keeps, over 64 rows of 4,096 tokens at three logit scales with every mix of top_k / top_p /
    min_p, ties included (logits rounded to 1/8); each setting alone too, so that rows within the cap take
    the top-k path rather than the whole step falling back (top_p at most `nucleus`, small enough that
    each row's nucleus fits the cap)."""
    rng = np.random.default_rng(int(scale * 10))
    logits = np.round(rng.standard_normal((64, 4096)) * scale * 8) / 8
    p_BV = jnp.exp(jnp.asarray(logits - logits.max(-1, keepdims=True), jnp.float32))
    s = _settings(64, rng)
    bisect = jax.jit(lambda p, s: _truncate(p, s, Search.BISECT))
    top_k = jax.jit(lambda p, s: _truncate(p, s, Search.TOP_K))
    beyond = jax.jit(lambda p, s: _top_k_search(p, s)[2])
    assert np.asarray(beyond(p_BV, s)).any()  # top_k past the cap: this step is the bisection's
    np.testing.assert_array_equal(np.asarray(top_k(p_BV, s)), np.asarray(bisect(p_BV, s)))
    within = s.replace(top_k=jnp.where(s.top_k > TOP_K_CAP, 5, s.top_k), top_p=jnp.minimum(s.top_p, nucleus))
    assert not np.asarray(beyond(p_BV, within)).any()  # every row by the top-k search
    np.testing.assert_array_equal(np.asarray(top_k(p_BV, within)), np.asarray(bisect(p_BV, within)))
    choose = kernels.sampler_search
    assert choose("cpu") is Search.BISECT and choose("gpu") is choose("tpu") is Search.TOP_K


@pytest.mark.numerics
def test_top_k_search_draws_the_same_tokens_and_logprobs():
    """`sample` through either search: the same tokens and logprobs, seeded, greedy rows included."""
    rng = np.random.default_rng(5)
    b = 32
    logits = jnp.asarray(rng.standard_normal((b, 1000)) * 4, jnp.float32)
    s = _settings(b, rng)  # within the cap (top_k <= 256, nuclei of 0.9 at most of these peaked rows)
    s = s.replace(temperature=jnp.asarray(rng.choice([0.0, 0.7, 1.0], b), jnp.float32),
                  top_k=jnp.where(s.top_k > TOP_K_CAP, 5, s.top_k), top_p=jnp.minimum(s.top_p, 0.9))
    keys = jax.random.split(jax.random.key(1), b)
    fn = jax.jit(lambda lg, s, k, search: sample(lg, s, k, truncate=True, search=search), static_argnums=3)
    want, got = fn(logits, s, keys, Search.BISECT), fn(logits, s, keys, Search.TOP_K)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
