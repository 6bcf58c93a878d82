"""The engine's paged KV cache (`jaxrl.kv.paged`, `jaxrl.kv.pages`):
the same tokens and logprobs, bit for bit, as the dense cache; pages follow the tokens in flight; a
group's rollouts share their prompt's pages."""

import asyncio
import math

import jax
import numpy as np
import pytest

from jaxrl.inference.engine import Engine, pad_prompt
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.kv.dense import Dense
from jaxrl.kv.paged import PAGE, Paged, pool_pages
from jaxrl.kv.pages import PageAllocator, PoolExhausted
from jaxrl.model import modules
from jaxrl.model.blocks import LORA_TARGETS
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import make_mesh

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def _params():
    base = modules.init_params(CFG, jax.random.key(0))
    base = jax.tree.map(lambda x: x * 20 if x.ndim > 1 else x, base)  # sharp logits, as test_engine's
    lora = jax.tree.map(lambda x: x + 0.3, modules.init_lora(CFG, 4, tuple(LORA_TARGETS), jax.random.key(1)))
    return {"base": base, "lora": lora}


def _serve(kv, reqs, slots, seq_len, steps=None):
    """`reqs` through a scheduler over an engine of cache `kv` (`steps` decode steps a dispatch; None: the
    default): the completions, the engine and its peak of pages in use."""
    more = {} if steps is None else {"decode_steps_per_dispatch": steps}
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), slots, seq_len, lora_scale=0.5, kv=kv, **more)
    sched = Scheduler(engine, _params(), "tiny")
    peak = []
    if engine.pages is not None:  # the pages in use after each dispatch of decode steps
        generate = engine.generate_steps

        def spy(*args, **kwargs):  # the real steps
            out = generate(*args, **kwargs)
            peak.append(engine.pages.in_use)
            return out

        engine.generate_steps = spy

    async def go():
        return await asyncio.gather(*[sched.generate(p, s) for p, s in reqs])

    try:
        return asyncio.run(go()), engine, max(peak, default=0)
    finally:
        sched.stop()
        engine.preemptions = sched.preemptions


@pytest.mark.numerics
def test_paged_engine_matches_the_dense_cache_bit_for_bit():
    """A stream of seeded and greedy requests through 3 slots (more requests than slots, prompts of whole
    and partial pages, a group of 8 sharing one prompt, stops that free slots mid-stream): the paged engine,
    with a pool smaller than the dense cache (requests wait for pages: admission by pages), samples the
    dense engine's tokens and logprobs exactly (steps reading one chunk or both: the same numbers), and
    every page is back in the pool after."""
    rng = np.random.default_rng(0)
    group = rng.integers(1, 96, size=21).tolist()
    reqs = [(rng.integers(1, 96, size=n).tolist(),
             SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, max_tokens=int(rng.integers(3, 40)), seed=i,
                            stop_token_ids=(5, 6) if i % 2 else ()))
            for i, n in enumerate((3, 16, 32, 17, 40, 1))]
    reqs += [(group, SamplingParams(temperature=1.0, max_tokens=10 + 3 * i, seed=100 + i)) for i in range(8)]
    reqs += [(rng.integers(1, 96, size=130).tolist(), SamplingParams(temperature=1.0, max_tokens=12, seed=9))]
    # one decode step a dispatch, so that a slot frees and the next request takes it while another rollout of
    # the group still holds its prompt's pages (with 8 a dispatch the three finish in one dispatch, and the
    # next ones prefill the prompt again); several steps a dispatch on the paged cache: test_decode_steps.py
    dense, dense_engine, _ = _serve(Dense(CFG, 3, 160), reqs, 3, 160, steps=1)  # chunks of 128 and 32 positions
    # a pool of 224 positions (14 pages), not 3 x 160: requests wait for pages (the 130-token prompt needs 9)
    paged, engine, peak = _serve(Paged(CFG, 3, 160, kv_cache_tokens=224), reqs, 3, 160, steps=1)
    for d, p in zip(dense, paged, strict=True):
        assert (p.token_ids, p.logprobs, p.finish_reason) == (d.token_ids, d.logprobs, d.finish_reason)
    assert engine.pages.in_use == 0 and 9 <= peak <= 14
    # the group of 8, admitted over several steps (3 slots), runs its prompt through the model once: each
    # later rollout shares the pages a running one holds, copying the partial page on its first write
    assert engine.metrics()["engine/prefills"] == 8 and dense_engine.metrics() == {"engine/prefills": 15}
    assert engine.pages.prefix_hits == engine.pages.copies == 7


@pytest.mark.numerics
def test_a_request_the_pool_cannot_hold_is_preempted_and_completes():
    """Two requests of up to 50 positions admitted together into a pool of 64 (4 pages: admission counts
    their prompts' pages and one of growth each): at position 32 both need a page and one is free, so the
    one admitted last is preempted, computed again once the other is done, and both sample the dense
    cache's tokens and logprobs."""
    reqs = [([3 + i] * 10, SamplingParams(temperature=1.0, max_tokens=40, seed=i)) for i in range(2)]
    dense, _, _ = _serve(Dense(CFG, 2, 64), reqs, 2, 64)
    paged, engine, peak = _serve(Paged(CFG, 2, 64, kv_cache_tokens=64), reqs, 2, 64)
    for d, p in zip(dense, paged, strict=True):
        assert (p.token_ids, p.logprobs, p.policy_versions) == (d.token_ids, d.logprobs, d.policy_versions)
    assert engine.preemptions == 1 and peak == 4 and engine.pages.in_use == 0


@pytest.mark.numerics
def test_pages_follow_the_tokens_in_flight_and_a_group_shares_its_prompt():
    """Through the engine's API: a group of 4 rollouts of a 37-token prompt holds its 3 pages once until
    the first decode step, which gives 3 of them a copy of the partial page (copy on write); each decode
    step's pages are exactly those the positions need; a later prefill of the prompt runs no forward while
    a slot holds its pages; a released slot's pages return (the shared ones when their last holder goes)."""
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), 4, 80, lora_scale=0.5, kv=Paged(CFG, 4, 80))
    alloc, params = engine.pages, engine.prepare(_params())
    prompt = list(range(1, 38))
    prefixes = engine.prefill_shared(params, pad_prompt(prompt, engine.bucket(37)), 37,
                                     [SamplingParams(temperature=1.0, seed=s) for s in range(4)],
                                     [jax.random.key(s) for s in range(4)])
    state = engine.init_decode_state()
    for slot, prefix in enumerate(prefixes):
        state = engine.insert(prefix, state, slot)
    assert (alloc.prefix_hits, alloc.shared_pages, alloc.in_use) == (3, 9, 3)
    assert engine.metrics() == {"engine/prefills": 1.0, "engine/prefix_hits": 3.0, "engine/prefill_tokens": 37.0,
                                "engine/prefix_tokens": 3 * 37.0, "engine/kv_pages": 3.0, "engine/kv_kept_pages": 0.0}
    for step in range(30):
        state, _ = engine.generate(params, state)
        written = 37 + step + 1  # positions each slot holds after this step
        assert alloc.in_use == 2 + 4 * (math.ceil(written / PAGE) - 2)
    assert alloc.copies == 3
    for slot in range(3):
        engine.release(slot)
    assert alloc.in_use == 2 + (math.ceil(67 / PAGE) - 2)  # the last holder keeps the shared pages
    again = engine.prefill_shared(params, pad_prompt(prompt, engine.bucket(37)), 37, [SamplingParams()],
                                  [jax.random.key(0)])
    assert engine.prefills == 1 and again[0].cache is None  # its pages are still held: no forward
    engine.release(3)
    assert alloc.in_use == 0 and alloc.free == pool_pages(4, 80, None) - 1
    with pytest.raises(ValueError, match="shares pages that were released since its prefill"):
        engine.insert(again[0], state, 0)


def test_allocator_refuses_past_the_pool_and_sizes_in_tokens():
    assert pool_pages(32, 4096, None) == 32 * 256 + 1  # the dense cache's positions, plus scratch
    assert pool_pages(32, 4096, 100_000) == 6250 + 1
    with pytest.raises(ValueError, match="kv_cache_tokens 100 holds fewer positions than one sequence"):
        pool_pages(2, 4096, 100)
    alloc = PageAllocator(4, PAGE, 2, 64)  # 3 pages to hand out
    alloc.assign(0, 40, 64, object())  # 3 pages
    with pytest.raises(PoolExhausted, match="kv_cache_tokens"):
        alloc.assign(1, 1, 16, object())
    assert alloc.in_use == 3 and not alloc.table[1].any()
    alloc.release(0)
    assert alloc.in_use == 0



def _conversation(kv, keep: bool):
    """Two conversations of 3 turns (one greedy, one seeded) through a scheduler over the cache `kv` (3 slots of
    64 positions): each next prompt is the last prompt, its completion of 5 tokens and 2 new tokens (a
    multi-turn environment's reply; every prompt in one prefill bucket). The weights are updated (the same
    values, a new version) before the third turn. Returns per turn the prompts, their completions and the
    engine's metrics after them."""
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), 3, 64, lora_scale=0.5, kv=kv)
    params = _params()
    sched = Scheduler(engine, params, "tiny", keep_turns=keep)
    rng = np.random.default_rng(0)

    async def go():
        turns, prompts = [], [rng.integers(1, 96, size=n).tolist() for n in (17, 18)]
        for turn in range(3):
            if turn == 2:
                sched.update_params(params, 1)
            done = await asyncio.gather(*[sched.generate(p, SamplingParams(temperature=float(i), max_tokens=5,
                                                                           seed=7 + i + 10 * turn))
                                          for i, p in enumerate(prompts)])
            turns.append((prompts, done, engine.metrics()))
            replies = [rng.integers(1, 96, size=2).tolist() for _ in prompts]
            prompts = [p + d.token_ids + r for p, d, r in zip(prompts, done, replies, strict=True)]
        return turns

    try:
        return asyncio.run(go())
    finally:
        sched.stop()


@pytest.mark.numerics
def test_a_conversations_next_turn_shares_its_last_turns_pages():
    """Multi-turn continuation, greedy and seeded, keeping each finished turn's pages (`keep_turns`): the
    next turn prefills only the positions after the tokens they hold (the 2 new ones and the completion's
    last, never fed back: 3 a conversation, not 24 and 25), and samples the dense engine's tokens with
    logprobs within float rounding of its whole prefill's (the kept keys and values of sampled tokens come
    from decode steps, not a prefill: not bit for bit). The first turn, and the turn after new weights
    (which drop the kept pages: prefilled whole), are the dense engine's bit for bit."""
    dense = _conversation(Dense(CFG, 3, 64), False)
    kept = _conversation(Paged(CFG, 3, 64), True)
    for turn, ((_, d, _), (_, k, _)) in enumerate(zip(dense, kept, strict=True)):
        for a, b in zip(d, k, strict=True):
            assert b.token_ids == a.token_ids and len(a.token_ids) == 5
            if turn == 1:
                np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=0, atol=1e-5)
            else:
                assert (b.logprobs, b.policy_versions) == (a.logprobs, a.policy_versions)
    lengths = [[len(p) for p in prompts] for prompts, _, _ in kept]
    assert lengths[1] == [24, 25]
    ran = [m["engine/prefill_tokens"] for _, _, m in kept]
    assert ran[0] == sum(lengths[0]) and ran[1] - ran[0] == 2 * 3 and ran[2] - ran[1] == sum(lengths[2])
    shared = [n - 3 for n in lengths[1]]  # the turn-1 prompt and the 4 completion tokens fed back
    assert kept[1][2]["engine/prefix_tokens"] == sum(shared) and kept[1][2]["engine/prefix_hits"] == 2
    assert kept[2][2]["engine/prefix_tokens"] == sum(shared)  # nothing shared after the update
    assert kept[2][2]["engine/kv_pages"] == 0 and kept[2][2]["engine/kv_kept_pages"] > 0


def test_kept_pages_are_shared_by_prefix_and_evicted_least_recently_used():
    """The allocator's kept sequences (`retire`, `remember`): a prompt extending one shares its whole pages
    (the partial one is read, then let go: the new sequence writes its own), a kept sequence that a later
    one extends is dropped, kept pages count as free and go least recently used first when a page is
    needed, and `forget_all` (new weights) drops them all."""
    alloc = PageAllocator(9, PAGE, 2, 128)  # 8 pages to hand out
    alloc.assign(0, 40, 64)  # pages 1, 2, 3
    alloc.step()
    alloc.retire(0, handle=1)
    alloc.remember(1, list(range(45)))  # its 45 positions: still 3 pages
    assert (alloc.kept, alloc.in_use, alloc.free) == (3, 0, 8)
    turn = list(range(30)) + [99]
    assert alloc.match(tuple(turn)) == 30  # 2 pages read, the second partial
    assert alloc.assign(1, 31, 32, prompt=tuple(turn)).tolist() == [0, 4]  # the partial page's copy: page 4
    assert alloc.table[1, :2].tolist() == [1, 4]
    assert (alloc.prefix_hits, alloc.prefix_tokens, alloc.in_use) == (1, 30, 2)
    alloc.step()
    alloc.retire(1, handle=2)
    alloc.remember(2, turn + [5])  # 32 positions, pages 1 and 4; sequence 1 is not a prefix of it: both kept
    assert alloc.kept == 4 and alloc.match(tuple(turn + [5, 8])) == 32
    alloc.assign(1, 33, 48, prompt=tuple(turn + [5, 8]))  # pages 1, 4 shared whole, 5 new
    alloc.step()
    alloc.retire(1, handle=3)
    alloc.remember(3, turn + [5, 8, 9])  # extends sequence 2, which goes (its pages are sequence 3's)
    assert sorted(alloc._kept) == [1, 3] and alloc.kept == 5 and alloc.free == 8
    alloc.assign(0, 128, 128)  # 8 pages: 6, 7, 8 free, then sequence 1 (least recently used), then 3
    assert alloc.evictions == 2 and alloc.kept == 0 and alloc.match(tuple(range(50))) == 0
    alloc.retire(0, handle=4)
    alloc.remember(4, [7] * 100)
    assert (alloc.kept, alloc.free, alloc.in_use) == (7, 8, 0)  # 100 positions: 7 pages, the 8th returned
    alloc.forget_all()
    assert (alloc.kept, alloc.free, alloc.in_use) == (0, 8, 0)
