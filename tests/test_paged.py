"""The engine's paged KV cache (`jaxrl.inference.paged`, `jaxrl.inference.pages`, `jaxrl.model.paged`):
the same tokens and logprobs, bit for bit, as the dense cache; pages follow the tokens in flight; a
group's rollouts share their prompt's pages."""

import asyncio
import math

import jax
import numpy as np
import pytest

from jaxrl.inference.engine import Engine, pad_prompt
from jaxrl.inference.layout import Plain
from jaxrl.inference.paged import PAGE, PagedLayout, pool_pages
from jaxrl.inference.pages import PageAllocator, PoolExhausted
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.model import modules
from jaxrl.model.qwen3 import LORA_TARGETS, ModelConfig
from jaxrl.parallel.sharding import make_mesh

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def _params():
    base = modules.init_params(CFG, jax.random.key(0))
    base = jax.tree.map(lambda x: x * 20 if x.ndim > 1 else x, base)  # sharp logits, as test_engine's
    lora = jax.tree.map(lambda x: x + 0.3, modules.init_lora(CFG, 4, tuple(LORA_TARGETS), jax.random.key(1)))
    return {"base": base, "lora": lora}


def _serve(layout, reqs, slots, seq_len):
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), slots, seq_len, lora_scale=0.5, layout=layout)
    sched = Scheduler(engine, _params(), "tiny")
    peak = []
    if engine.pages is not None:  # the pages in use after each decode step
        generate = engine.generate

        def spy(*args, **kwargs):  # the real step
            out = generate(*args, **kwargs)
            peak.append(engine.pages.in_use)
            return out

        engine.generate = spy

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
    dense, dense_engine, _ = _serve(Plain(CFG, 3, 160), reqs, 3, 160)  # chunks of 128 and 32 positions
    # a pool of 224 positions (14 pages), not 3 x 160: requests wait for pages (the 130-token prompt needs 9)
    paged, engine, peak = _serve(PagedLayout(CFG, 3, 160, kv_cache_tokens=224), reqs, 3, 160)
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
    dense, _, _ = _serve(Plain(CFG, 2, 64), reqs, 2, 64)
    paged, engine, peak = _serve(PagedLayout(CFG, 2, 64, kv_cache_tokens=64), reqs, 2, 64)
    for d, p in zip(dense, paged, strict=True):
        assert (p.token_ids, p.logprobs, p.policy_versions) == (d.token_ids, d.logprobs, d.policy_versions)
    assert engine.preemptions == 1 and peak == 4 and engine.pages.in_use == 0


@pytest.mark.numerics
def test_pages_follow_the_tokens_in_flight_and_a_group_shares_its_prompt():
    """Through the engine's API: a group of 4 rollouts of a 37-token prompt holds its 3 pages once until
    the first decode step, which gives 3 of them a copy of the partial page (copy on write); each decode
    step's pages are exactly those the positions need; a later prefill of the prompt runs no forward while
    a slot holds its pages; a released slot's pages return (the shared ones when their last holder goes)."""
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), 4, 80, lora_scale=0.5, layout=PagedLayout(CFG, 4, 80))
    alloc, params = engine.pages, engine.prepare(_params())
    prompt = list(range(1, 38))
    prefixes = engine.prefill_shared(params, pad_prompt(prompt, engine.bucket(37)), 37,
                                     [SamplingParams(temperature=1.0, seed=s) for s in range(4)],
                                     [jax.random.key(s) for s in range(4)])
    state = engine.init_decode_state()
    for slot, prefix in enumerate(prefixes):
        state = engine.insert(prefix, state, slot)
    assert (alloc.prefix_hits, alloc.shared_pages, alloc.in_use) == (3, 9, 3)
    assert engine.metrics() == {"engine/prefills": 1.0, "engine/prefix_hits": 3.0, "engine/kv_pages": 3.0}
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
