import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import generate_with_an_update, version_switch

from jaxrl.inference.cpu import CpuWeights
from jaxrl.inference.decode_state import DecodeState
from jaxrl.inference.engine import Engine, pad_prompt
from jaxrl.inference.engine_params import EngineParams
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.kv import chunked
from jaxrl.kv.chunks import chunk_sizes
from jaxrl.kv.dense import Dense
from jaxrl.model import decode, decoder, modules
from jaxrl.model.blocks import LORA_TARGETS
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import make_mesh, spec_shardings

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def _params(seed=0, lora_seed=None):
    base = modules.init_params(CFG, jax.random.key(seed))
    base = jax.tree.map(lambda x: x * 20 if x.ndim > 1 else x, base)  # sharper logits than std 0.02
    lora = None
    if lora_seed is not None:
        lora = modules.init_lora(CFG, 4, tuple(LORA_TARGETS), jax.random.key(lora_seed))
        lora = jax.tree.map(lambda x: x + 0.3, lora)
    return {"base": base, "lora": lora}


@jax.jit
def _padded_logits(params, ids_T, temperature):
    h, _ = decoder.forward(CFG, params["base"], ids_T[None], jnp.arange(ids_T.shape[0])[None], lora=params["lora"],
                           lora_scale=0.5)
    logits_TV = decoder.logits(params["base"], h)[0]
    return logits_TV, jax.nn.log_softmax(logits_TV / temperature, axis=-1)


def _full_logits(params, ids: list[int], temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(logits, log_softmax(logits / temperature)), each [T, V] float32, after each of the T tokens `ids`, from
    one full forward pass of the whole sequence, padded with token 0 to the next power of two >= 16 (attention
    is causal: the positions after the sequence cannot change the logits before them). Jitted, so a few widths
    compile once each for the whole file, where an eager forward compiles each of its operations at each new
    length (the greedy references of one test took 2.6 x the CPU time eagerly, jitted at their exact lengths)."""
    t = 16
    while t < len(ids):
        t *= 2
    padded = jnp.asarray(list(ids) + [0] * (t - len(ids)), jnp.int32)
    return tuple(np.asarray(x)[:len(ids)] for x in _padded_logits(params, padded, temperature))


def _reference_logprobs(params, ids, temperature=1.0):
    """log_softmax(logits / T) of every next token, from one full forward pass."""
    return _full_logits(params, ids, temperature)[1]


@pytest.mark.numerics
@pytest.mark.parametrize("plain", [False, True], ids=["cpu-layout", "plain-layout"])
def test_prefill_insert_generate_match_full_forward(plain):
    """On the CPU's layout (the default here) and on the plain one a TPU or GPU engine runs (stacked cache,
    training weights read in place, the layers scanned), forced on this CPU."""
    params = _params(lora_seed=1)
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), max_concurrent_decodes=3, max_seq_len=48, lora_scale=0.5,
                    kv=Dense(CFG, 3, 48) if plain else None)
    weights = EngineParams.of(params)  # not `prepare`d: the CPU layout over the stacks
    state = engine.init_decode_state()
    prompts = {0: [5, 7, 9, 11, 3], 2: list(range(1, 20))}
    out = {}
    for slot, prompt in prompts.items():
        prefix = engine.prefill(params=weights, padded_tokens=pad_prompt(prompt, engine.bucket(len(prompt))),
                                true_length=len(prompt), sampling=SamplingParams(temperature=1.0),
                                key=jax.random.key(slot))
        state = engine.insert(prefix, state, slot)
        out[slot] = ([int(prefix.token[0])], [float(prefix.logprob[0])])
    for _ in range(12):
        state, res = engine.generate(weights, state, truncate=False)
        for slot in prompts:
            out[slot][0].append(int(res.tokens[slot]))
            out[slot][1].append(float(res.logprobs[slot]))
    for slot, prompt in prompts.items():
        toks, lps = out[slot]
        ref = _reference_logprobs(params, prompt + toks)
        want = [ref[len(prompt) - 1 + i, t] for i, t in enumerate(toks)]
        np.testing.assert_allclose(lps, want, atol=1e-4)
        assert len(set(toks)) > 3  # sampled, not a degenerate repetition


@pytest.mark.numerics
@pytest.mark.parametrize(("unstacked", "split"), [(False, ()), (True, ()), (True, (24,)), (True, (4, 4, 8, 8))])
def test_decode_step_matches_model_forward_with_cache(unstacked, split):
    """`unstacked`: the per-layer weights (the CPU engine's); `split`: the per-layer head-major cache in chunks
    of those many positions (of the 24: `chunked.Chunked`); neither: the plain path a TPU runs (`Dense`)."""
    params = _params(lora_seed=1)
    layers = None
    if unstacked:
        layers = decoder.join_layers(decoder.unstack_layers(CFG, params["base"]),
                                     decoder.unstack_layers(CFG, params["lora"]))
    b, s = 3, 24
    ks = jax.random.split(jax.random.key(5), 3)
    cache = {"k": jax.random.normal(ks[0], (CFG.num_layers, b, s, CFG.num_kv_heads, CFG.head_dim)),
             "v": jax.random.normal(ks[1], (CFG.num_layers, b, s, CFG.num_kv_heads, CFG.head_dim))}
    tokens = jnp.array([3, 50, 7], jnp.int32)
    positions = jnp.array([0, 9, 23], jnp.int32)
    want_h, want_cache = decoder.forward(CFG, params["base"], tokens[:, None], positions[:, None], lora=params["lora"],
                                         lora_scale=0.5, cache=cache)
    layout = chunked.Chunked(CFG, b, s) if split else Dense(CFG, b, s)
    step = jax.jit(lambda p, c, ly: decode.decode_step(CFG, p["base"], tokens, positions, c, lora=p["lora"],
                                                       lora_scale=0.5, layers=ly, layout=layout))
    got_h, got_cache = step(params, chunked.split_cache(cache, split) if split else cache, layers)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-4, atol=1e-4)
    assert isinstance(got_cache["k"], list) == bool(split)
    if split:
        assert [[c.shape[-1] for c in layer] for layer in got_cache["k"]] == [list(split)] * CFG.num_layers
    got_cache = chunked.join_cache(got_cache) if split else got_cache
    for name in ("k", "v"):
        np.testing.assert_allclose(got_cache[name], want_cache[name], rtol=1e-5, atol=1e-5)


@pytest.mark.numerics
def test_decode_step_over_the_first_chunks_is_the_same_bit_for_bit():
    """A step given only the first chunks of each layer's cache (`Engine.generate`'s `chunks`) computes the
    rows whose positions they hold exactly as over every chunk (`chunked.Chunked.attend` merges the softmax
    chunk by chunk), writes their keys/values in them, and leaves the other chunks to the caller."""
    params = _params(lora_seed=1)
    layers = decoder.join_layers(decoder.unstack_layers(CFG, params["base"]),
                                 decoder.unstack_layers(CFG, params["lora"]))
    ks = jax.random.split(jax.random.key(6), 2)
    shape = (CFG.num_layers, 3, 32, CFG.num_kv_heads, CFG.head_dim)
    cache = chunked.split_cache({"k": jax.random.normal(ks[0], shape), "v": jax.random.normal(ks[1], shape)},
                            (8, 8, 16))
    tokens, positions = jnp.array([3, 50, 7], jnp.int32), jnp.array([0, 9, 15], jnp.int32)
    step = jax.jit(lambda c: decode.decode_step(CFG, params["base"], tokens, positions, c, lora=params["lora"],
                                                lora_scale=0.5, layers=layers, layout=chunked.Chunked(CFG, 3, 32)))
    all_h, all_cache = step(cache)
    first = {n: [layer[:2] for layer in cache[n]] for n in ("k", "v")}  # positions 0..15 of 32
    some_h, some_cache = step(first)
    assert [len(layer) for layer in some_cache["k"]] == [2] * CFG.num_layers
    np.testing.assert_array_equal(np.asarray(some_h), np.asarray(all_h))
    for name in ("k", "v"):
        for got, want in zip(some_cache[name], all_cache[name], strict=True):
            for g, w in zip(got, want[:2], strict=True):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.numerics
def test_scheduler_serves_a_stream_of_mixed_requests_through_few_slots():
    params = _params(lora_seed=1)
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), max_concurrent_decodes=3, max_seq_len=64, lora_scale=0.5)
    sched = Scheduler(engine, params, "tiny")
    rng = np.random.default_rng(0)
    stops = tuple(range(0, 96, 3))  # some requests stop early on one, freeing their slot mid-stream
    reqs = [(rng.integers(1, 96, size=int(rng.integers(1, 30))).tolist(),
             SamplingParams(temperature=1.0, max_tokens=int(rng.integers(1, 12)), seed=i,
                            stop_token_ids=stops if i % 2 else ()))
            for i in range(12)]

    async def arrive(prompt, sampling, delay):
        await asyncio.sleep(delay)
        return await sched.generate(prompt, sampling)

    async def stream():
        return await asyncio.gather(*[arrive(p, s, 0.02 * i) for i, (p, s) in enumerate(reqs)])

    async def one_at_a_time(which):
        return [await sched.generate(*reqs[i]) for i in which]

    try:
        outs = _run(stream())
        assert sched.active == 0
        alone = _run(one_at_a_time([1, 4, 11]))
    finally:
        sched.stop()
    for (prompt, sampling), c in zip(reqs, outs, strict=True):
        stopped_at = [i for i, t in enumerate(c.token_ids) if t in sampling.stop_token_ids]
        if stopped_at:
            assert stopped_at == [len(c.token_ids) - 1] and c.finish_reason == "stop"
        else:
            assert len(c.token_ids) == sampling.max_tokens and c.finish_reason == "length"
        ref = _reference_logprobs(params, prompt + c.token_ids)
        want = [ref[len(prompt) - 1 + i, t] for i, t in enumerate(c.token_ids)]
        np.testing.assert_allclose(c.logprobs, want, atol=1e-4)
    assert any(c.finish_reason == "stop" for c in outs)
    # a seeded request samples the same tokens whatever shares its batch and whichever slot it gets
    for i, c in zip([1, 4, 11], alone, strict=True):
        assert (c.token_ids, c.logprobs) == (outs[i].token_ids, outs[i].logprobs)
    # far fewer decode steps than a padded batch-at-a-time schedule would take
    assert sched.decode_steps < sum(len(c.token_ids) for c in outs)


def _greedy_reference(params, prompt, n, penalty=1.0):
    """`n` greedy tokens from full forward passes, with a repetition penalty over prompt and output."""
    ids = list(prompt)
    for _ in range(n):
        lg = _full_logits(params, ids)[0][-1]
        seen = np.isin(np.arange(CFG.vocab_size), ids)
        lg = np.where(seen, np.where(lg > 0, lg / penalty, lg * penalty), lg)
        ids.append(int(np.argmax(lg)))
    return ids[len(prompt):]


def test_scheduler_keeps_each_requests_settings_in_a_shared_batch():
    params = _params(lora_seed=1)
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), max_concurrent_decodes=4, max_seq_len=32, lora_scale=0.5)
    prompt = [5, 7, 9, 11, 3]
    greedy, penalised = _greedy_reference(params, prompt, 10), _greedy_reference(params, prompt, 10, penalty=3.0)
    assert penalised != greedy
    one = dict(temperature=1.0, max_tokens=10, seed=1)
    requests = {  # nine requests through four slots; each truncation alone leaves the top token only
        "greedy": SamplingParams(temperature=0.0, max_tokens=10),
        "top_k": SamplingParams(top_k=1, **one),
        "top_p": SamplingParams(top_p=1e-3, **one),
        "min_p": SamplingParams(min_p=1.0, **one),
        "penalised": SamplingParams(temperature=0.0, repetition_penalty=3.0, max_tokens=10),
        "first_token_stops": SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(greedy[0],)),
        "one_token": SamplingParams(temperature=0.0, max_tokens=1),
        # min_tokens: the stop token (and one beyond the vocabulary, ignored) banned from the first draws
        "min_tokens_4": SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(greedy[0], 99), min_tokens=4),
        "min_tokens_1": SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(greedy[0],), min_tokens=1),
    }
    sched = Scheduler(engine, params, "tiny")

    async def go():
        return await asyncio.gather(*[sched.generate(prompt, s) for s in requests.values()])

    try:
        out = dict(zip(requests, _run(go()), strict=True))
    finally:
        sched.stop()
    for name in ("greedy", "top_k", "top_p", "min_p"):
        assert out[name].token_ids == greedy, name
    assert out["penalised"].token_ids == penalised
    assert (out["first_token_stops"].token_ids, out["first_token_stops"].finish_reason) == (greedy[:1], "stop")
    assert (out["one_token"].token_ids, out["one_token"].finish_reason) == (greedy[:1], "length")
    _check_min_tokens(params, prompt, out["min_tokens_4"], greedy[0], 4)
    _check_min_tokens(params, prompt, out["min_tokens_1"], greedy[0], 1)


@pytest.mark.numerics
def test_ban_only_while_a_slot_is_short_of_min_tokens():
    """The scheduler asks for the `min_tokens` ban only in dispatches where some slot still needs it (two
    decode steps a dispatch here); the other dispatches take the blocked sampler (`sample_unembedded`):
    greedy tokens and logprobs as the full forward."""
    params = _params(lora_seed=1)
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), max_concurrent_decodes=2, max_seq_len=32, lora_scale=0.5,
                    weights=CpuWeights(CFG, 2, blocked_sampling=True), decode_steps_per_dispatch=2)
    prompt = [5, 7, 9, 11, 3]
    greedy = _greedy_reference(params, prompt, 6)
    bans, generate = [], engine.generate_steps

    def spy(*args, **kwargs):  # the real steps, their `ban` flag recorded
        bans.append(kwargs["ban"])
        return generate(*args, **kwargs)

    engine.generate_steps = spy
    sched = Scheduler(engine, params, "tiny")
    held = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(greedy[0],), min_tokens=3)
    try:
        plain = _run(sched.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6)))
        assert bans == [False] * 3  # 5 decode steps: 2, 2, 1
        bans.clear()
        got = _run(sched.generate(prompt, held))
    finally:
        sched.stop()
    assert bans[:1] == [True] and not any(bans[1:])  # draws 2 and 3 of 3 banned (1: prefill), in the first
    _check_min_tokens(params, prompt, got, greedy[0], 3)
    assert plain.token_ids == greedy
    ref = _reference_logprobs(params, prompt + greedy)[len(prompt) - 1:-1]
    np.testing.assert_allclose(plain.logprobs, ref[np.arange(6), greedy], atol=1e-5)


@pytest.mark.numerics
def test_scheduler_seed_reproducible_and_stop_tokens():
    params = _params()
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), max_concurrent_decodes=2, max_seq_len=32)
    sched = Scheduler(engine, params, "tiny")
    try:
        a = _run(sched.generate([1, 2, 3], SamplingParams(max_tokens=10, seed=7)))
        b = _run(sched.generate([1, 2, 3], SamplingParams(max_tokens=10, seed=7)))
        assert a.token_ids == b.token_ids

        async def group():  # one prompt, admitted together: one forward pass, each its own first draw
            return await asyncio.gather(*[sched.generate([1, 2, 3], SamplingParams(max_tokens=10, seed=s))
                                          for s in (8, 7)])

        other, shared = _run(group())
        assert (shared.token_ids, shared.logprobs) == (a.token_ids, a.logprobs) and other.token_ids != a.token_ids
        stop_at = a.token_ids[3]
        first = a.token_ids.index(stop_at)
        c = _run(sched.generate([1, 2, 3], SamplingParams(max_tokens=10, seed=7, stop_token_ids=(stop_at,))))
        assert c.token_ids == a.token_ids[: first + 1] and c.finish_reason == "stop"
        long = _run(sched.generate([1] * 30, SamplingParams(max_tokens=100)))
        assert len(long.token_ids) == 2 and long.finish_reason == "length"  # capped by max_seq_len
        with pytest.raises(ValueError, match="no room"):
            _run(sched.generate([1] * 32, SamplingParams()))
    finally:
        sched.stop()


@pytest.mark.numerics
def test_scheduler_steps_read_the_cache_chunks_in_use():
    """With a cache in three chunks (128, 128, 44 positions), a decode step reads the chunks that hold its
    busy slots' positions (`Engine.cache_chunks`): a short seeded request samples the same tokens and
    logprobs alone (one chunk) and beside a long prompt (two), and requests that cross a chunk boundary
    mid-generation match the full forward pass."""
    params = _params(lora_seed=1)
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), max_concurrent_decodes=2, max_seq_len=300, lora_scale=0.5)
    assert engine.kv.chunk_sizes == (128, 128, 44)
    assert chunk_sizes(32) == (32,) and chunk_sizes(1000) == (128, 128, 256, 488)
    assert chunk_sizes(4096) == (128, 128, 256, 512, 1024, 2048)  # each as long as those before it
    # all three chunks: None, the whole cache (one compiled step for it, however it is asked for)
    assert [engine.cache_chunks(n) for n in (1, 128, 129, 256, 257, 300)] == [1, 1, 2, 2, None, None]
    rng = np.random.default_rng(3)
    short = ([5, 7, 9, 11, 3], SamplingParams(temperature=1.0, max_tokens=12, seed=4))
    crossing = (rng.integers(0, CFG.vocab_size, 120).tolist(), SamplingParams(temperature=1.0, max_tokens=20, seed=5))
    long = (rng.integers(0, CFG.vocab_size, 200).tolist(), SamplingParams(temperature=1.0, max_tokens=70, seed=6))
    sched = Scheduler(engine, params, "tiny")

    async def together(*reqs):
        return await asyncio.gather(*[sched.generate(*r) for r in reqs])

    try:
        (alone,) = _run(together(short))
        steps = sched.decode_steps
        beside, far = _run(together(short, long))
        (cross,) = _run(together(crossing))
    finally:
        sched.stop()
    assert sched.decode_steps - steps >= 69  # the long request's steps ran over two or three chunks
    assert (beside.token_ids, beside.logprobs) == (alone.token_ids, alone.logprobs)
    for (prompt, _), c in ((long, far), (crossing, cross)):  # up to 270 positions of x20 weights: rounding
        ref = _reference_logprobs(params, prompt + c.token_ids)  # of 1e-4 (9e-5 unchunked, 2e-4 chunked)
        np.testing.assert_allclose(c.logprobs, [ref[len(prompt) - 1 + i, t] for i, t in enumerate(c.token_ids)],
                                   atol=5e-4)


@pytest.mark.numerics
def test_update_params_in_flight_keeps_request_and_records_versions():
    p0, p1 = _params(lora_seed=1), _params(lora_seed=2)
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), max_concurrent_decodes=2, max_seq_len=96, lora_scale=0.5)
    sched = Scheduler(engine, p0, "tiny")
    c = generate_with_an_update(sched, [4, 5, 6], SamplingParams(max_tokens=80, seed=3), p1,
                                when=lambda: sched.decode_steps >= 5)
    # before the switch the old weights scored every token; after it, the new ones (over the kept cache)
    ref0 = _reference_logprobs(p0, [4, 5, 6] + c.token_ids)
    switch = version_switch(c, np.array([ref0[2 + i, t] for i, t in enumerate(c.token_ids)]))
    assert 0 < switch < len(c.policy_versions), switch


def _six_greedy_steps(engine: Engine, params, slot: int) -> tuple[DecodeState, list[int], list[float]]:
    """The prompt [3, 1, 4, 1, 5] prefilled greedily into `slot` of a fresh decode state, then 6 decode steps:
    the state after them, and the slot's 6 tokens and their logprobs."""
    state = engine.init_decode_state()
    prefix = engine.prefill(params=params, padded_tokens=pad_prompt([3, 1, 4, 1, 5], 16), true_length=5,
                            sampling=SamplingParams(temperature=0.0))
    state = engine.insert(prefix, state, slot)
    toks, lps = [], []
    for _ in range(6):
        state, res = engine.generate(params, state, truncate=False)
        toks.append(int(res.tokens[slot]))
        lps.append(float(res.logprobs[slot]))
    return state, toks, lps


@pytest.mark.numerics
@pytest.mark.parametrize("plain", [False, True], ids=["cpu-layout", "plain-layout"])
def test_sharded_engine_matches_single_device(plain):
    """Sharded over 8 devices as on a TPU slice: on the CPU's layout and on the plain one a TPU runs."""
    params = _params(lora_seed=1)
    outs = []
    for shape in ({}, {"data": 2, "fsdp": 2, "tensor": 2}):
        mesh = make_mesh(shape, jax.devices()[: 8 if shape else 1])
        base = jax.device_put(params["base"], spec_shardings(modules.param_specs(CFG), CFG.dims(), mesh))
        p = EngineParams(base=base, lora=params["lora"])
        engine = Engine(CFG, mesh, max_concurrent_decodes=4, max_seq_len=32, lora_scale=0.5,
                        kv=Dense(CFG, 4, 32) if plain else None)
        state, toks, lps = _six_greedy_steps(engine, p, slot=1)
        if shape:
            assert all(len(c.sharding.device_set) == 8 for c in jax.tree.leaves(state.cache))
        outs.append((toks, lps))
    assert outs[0][0] == outs[1][0]
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-5)


@pytest.mark.numerics
def test_weight_copies_only_on_cpu_and_the_same_tokens_without_them():
    """The per-layer copy and the [V, D] unembedding are made by the CPU's layout only; the plain one (what
    a TPU or GPU engine runs, forced here) reads the training arrays themselves, keeps one stacked cache,
    and samples the same tokens."""
    params = _params(lora_seed=1)
    mesh = make_mesh({}, jax.devices()[:1])
    outs = []
    for kv in (None, Dense(CFG, 2, 32)):
        engine = Engine(CFG, mesh, max_concurrent_decodes=2, max_seq_len=32, lora_scale=0.5, kv=kv)
        prepared = engine.prepare(params)
        if kv is None:  # decided by the CPU mesh
            assert isinstance(engine.weights, CpuWeights) and None not in (prepared.layers, prepared.unembed)
        else:
            assert (prepared.layers, prepared.unembed, prepared.unembed_blocks) == (None, None, None)
            assert prepared.base is params["base"] and prepared.lora is params["lora"]
            assert engine.init_decode_state().cache["k"].shape == (CFG.num_layers, 2, 32, 2, 8)
        outs.append(_six_greedy_steps(engine, prepared, slot=0)[1:])
    assert outs[0][0] == outs[1][0]
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-5)
    with pytest.raises(ValueError, match="KV cache for"):
        Engine(CFG, mesh, max_concurrent_decodes=4, max_seq_len=32, kv=Dense(CFG, 2, 32))


MOE_CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      mlp_only_layers=(1,))


@pytest.mark.numerics
@pytest.mark.parametrize("cfg", [CFG, MOE_CFG], ids=["dense", "mixed-moe"])
def test_prefill_through_the_per_layer_copy_matches_the_stacks(cfg):
    """On CPU a prefill runs the layers of `Engine.prepare`'s per-layer copy unrolled (`decoder.forward`'s
    `layers`) where XLA would copy each layer's weights out of the stack: the same cache and logits as the
    stacked weights (the plain layout), LoRA included, for a dense and a mixed dense/MoE stack."""
    base = jax.tree.map(lambda x: x * 20 if x.ndim > 1 else x, modules.init_params(cfg, jax.random.key(0)))
    lora = jax.tree.map(lambda x: x + 0.3, modules.init_lora(cfg, 4, tuple(LORA_TARGETS), jax.random.key(1)))
    mesh = make_mesh({}, jax.devices()[:1])
    tokens = pad_prompt([5, 7, 9, 11, 3, 2, 8], 16)
    outs = []
    for kv in (None, Dense(cfg, 2, 32)):
        engine = Engine(cfg, mesh, max_concurrent_decodes=2, max_seq_len=32, lora_scale=0.5, kv=kv)
        prepared = engine.prepare({"base": base, "lora": lora})
        assert (prepared.layers is not None) == (kv is None)
        outs.append(engine._prefill_forward(prepared, tokens, jnp.int32(7)))
        if kv is None:  # the copy is what it reads: its layers in reverse order give other logits
            swapped = engine._prefill_forward(prepared.replace(layers=prepared.layers[::-1]), tokens, jnp.int32(7))
            assert np.abs(np.asarray(swapped[1]) - np.asarray(outs[0][1])).max() > 1e-2
    (cache, logits), (want_cache, want_logits) = outs
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
    for name in ("k", "v"):
        np.testing.assert_allclose(cache[name], want_cache[name], rtol=1e-4, atol=1e-4)


def _check_min_tokens(params, prompt, got, stop, m):
    """`got` is greedy decoding with `stop` banned from its first `m` draws: each token the argmax of the
    logits with `stop` at -inf for the first m, its logprob that of that masked distribution, and it
    ends at `stop` or at its length (one teacher-forced forward pass checks all)."""
    toks = got.token_ids
    assert len(toks) > m and stop not in toks[:-1] and (toks[-1] == stop) == (got.finish_reason == "stop")
    lg = _full_logits(params, prompt + toks)[0][len(prompt) - 1:-1].astype(np.float64)
    lg[:m, stop] = -np.inf
    assert lg.argmax(axis=-1).tolist() == toks
    lp = lg - lg.max(axis=-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(got.logprobs, lp[np.arange(len(toks)), toks], atol=1e-4)
