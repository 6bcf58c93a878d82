"""Chunked prefill over the ragged paged pool (`jaxrl.inference.chunked.ChunkedScheduler`, a TPU's default
scheduler, here over the reference attention on a CPU mesh): several decode steps a dispatch while no prompt
is fed, the tokens of one step a dispatch; a group's rollouts share their prompt's whole pages, fed once, and
sample the tokens of requests alone."""

import asyncio
import time

import jax
import numpy as np
import pytest
from test_paged import CFG, _params  # the tiny GQA model with sharp logits, LoRA on

from jaxrl.inference.chunked import ChunkedScheduler, make_scheduler
from jaxrl.inference.engine import Engine
from jaxrl.inference.protocol import SamplingParams
from jaxrl.kv.ragged import RaggedPaged
from jaxrl.parallel.sharding import make_mesh


def _serve(reqs, steps: int, slots: int = 3, alone: bool = False):
    """`reqs` through `make_scheduler`'s scheduler (a `ChunkedScheduler`, chunks of 8: steps of 32 flat tokens)
    over a ragged pool of `slots` slots x 96, `steps` decode steps a dispatch, all at once or each `alone`
    (queued once the one before finished): the completions, the scheduler, the engine (its `peak`: the most
    pages in use at a dispatch), and each multi-step dispatch's (budgets, counts)."""
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), slots, 96, lora_scale=0.5, kv=RaggedPaged(CFG, slots, 96),
                    decode_steps_per_dispatch=steps)
    sched = make_scheduler(engine, _params(), "tiny", prefill_chunk=8)
    assert isinstance(sched, ChunkedScheduler)
    programs, run = [], sched._steps

    def spy(budget_B, active, flags):  # the real program, its budgets and counts recorded
        state, result = run(budget_B, active, flags)
        programs.append((budget_B.copy(), result.counts))
        return state, result

    sched._steps = spy
    engine.peak, pages_for = 0, engine._pages_for

    def pages_spy(state, ahead_B):  # the real pages, the most in use recorded
        state = pages_for(state, ahead_B)
        engine.peak = max(engine.peak, engine.pages.in_use)
        return state

    engine._pages_for = pages_spy

    async def go():
        if alone:
            return [await sched.generate(p, s) for p, s in reqs]
        return await asyncio.gather(*[sched.generate(p, s) for p, s in reqs])

    try:
        return asyncio.run(go()), sched, engine, [(b, np.asarray(c)) for b, c in programs]
    finally:
        sched.stop()


def _requests():
    """Six requests through 3 slots (the last three admitted while others decode): greedy and seeded, one
    with a repetition penalty, prompts of whole and partial pages and longer than a step's 32 tokens, and
    request 1 stopping at token 36, which its seed first draws at its sixth token (draw 0 the step that fed
    its prompt's end, draw 1 a step that fed request 2's, draws 2-9 the first dispatch of 8: its fourth)."""
    rng = np.random.default_rng(0)
    return [(rng.integers(1, 96, size=n).tolist(),
             SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i, max_tokens=int(rng.integers(9, 30)),
                            repetition_penalty=1.3 if i == 3 else 1.0, stop_token_ids=(36,) if i == 1 else ()))
            for i, n in enumerate((3, 16, 33, 1, 40, 21))]


@pytest.mark.numerics
def test_eight_decode_steps_a_dispatch_serve_the_tokens_of_one():
    """`_requests()` with k = 1 and k = 8 decode steps a dispatch: the same tokens, logprobs and finish
    reasons, bit for bit (each of the k steps is the flat batch a single step of the same slots runs), in
    fewer than half the dispatches; with k = 8 the multi-step programs ran (request 1 stopping inside one,
    a slot running fewer steps than its budget), and every page is back in the pool after."""
    one, sched_one, _, none = _serve(_requests(), 1)
    eight, sched_eight, engine, programs = _serve(_requests(), 8)
    assert not none  # k = 1: every dispatch the ragged step
    assert one[1].token_ids[-1] == 36 and len(one[1].token_ids) == 6 and one[1].finish_reason == "stop"
    for a, b in zip(one, eight, strict=True):
        assert (b.token_ids, b.logprobs, b.finish_reason) == (a.token_ids, a.logprobs, a.finish_reason)
    assert sched_eight.dispatches < sched_one.dispatches / 2, (sched_eight.dispatches, sched_one.dispatches)
    assert any(((counts > 0) & (counts < budget)).any() for budget, counts in programs)
    assert max(int(budget.max()) for budget, _ in programs) == 8
    assert engine.pages.in_use == 0


def _group():
    """Four seeded rollouts of one 40-token prompt (pages of 16: two whole pages before its last token's,
    8 tokens after them) through 3 slots, the first finishing first so that the fourth is admitted while
    the second and third decode over the shared pages; one with a repetition penalty (its prompt's tokens
    seen, also those it shares and does not feed)."""
    prompt = np.random.default_rng(3).integers(1, 96, size=40).tolist()
    return [(prompt, SamplingParams(temperature=1.0, seed=20 + i, max_tokens=6 if i == 0 else 12,
                                    repetition_penalty=1.3 if i == 2 else 1.0)) for i in range(4)]


@pytest.mark.numerics
def test_a_groups_rollouts_share_their_prompts_whole_pages_and_sample_as_alone():
    """`_group()` at once against the same four requests each alone (nothing shared: the pages of the one
    before are back in the pool): the same tokens, logprobs and finish reasons, bit for bit. At once, the
    prompt's two whole pages are fed once and shared by the three others (`prefix_hits` 3, 6 pages not
    taken), each feeding its 8 last tokens itself (64 prompt positions fed, not 160), at most 8 pages in use
    (3 unshared rollouts would hold 12); alone, nothing is shared; every page back in the pool after."""
    at_once, _, engine, _ = _serve(_group(), 8)
    alone, _, engine_alone, _ = _serve(_group(), 8, alone=True)
    for a, b in zip(alone, at_once, strict=True):
        assert (b.token_ids, b.logprobs, b.finish_reason) == (a.token_ids, a.logprobs, a.finish_reason)
    assert len({tuple(c.token_ids) for c in at_once}) == 4  # four seeds, four completions
    alloc = engine.pages
    assert (alloc.prefix_hits, alloc.shared_pages, alloc.prefix_tokens) == (3, 6, 96)
    assert (engine.prefill_tokens, engine_alone.prefill_tokens) == (32 + 4 * 8, 4 * 40)
    assert engine.prefills == engine_alone.prefills == 4
    assert engine.peak <= 8 and engine_alone.peak == 4, (engine.peak, engine_alone.peak)
    assert engine_alone.pages.prefix_hits == 0
    assert alloc.in_use == engine_alone.pages.in_use == 0


def test_a_cancelled_feeder_hands_the_shared_pages_to_the_next_rollout():
    """Three seeded rollouts of a 70-token prompt (four whole pages before its last token's: two steps of
    32 tokens to feed them): the first is cancelled while it feeds the first 32, so the second, waiting for
    the shared pages, feeds on from position 32 (its pages hold the first 32 already) and the third waits
    for it. The two left sample the tokens of the same requests alone, and every page is back after."""
    prompt = np.random.default_rng(4).integers(1, 96, size=70).tolist()
    reqs = [(prompt, SamplingParams(temperature=1.0, seed=30 + i, max_tokens=5)) for i in range(3)]
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), 3, 96, lora_scale=0.5, kv=RaggedPaged(CFG, 3, 96))
    sched = make_scheduler(engine, _params(), "tiny", prefill_chunk=8)
    plans, plan = [], sched._plan

    def spy(active):  # the real plan, recorded; the first rollout cancelled at its first chunk, before it runs
        out = plan(active)
        plans.append([(sched._slots[slot].params.seed, first, n) for slot, first, n in out[0]])
        first = next(r for _, r in active if r.params.seed == 30) if len(plans) == 1 else None
        if first is not None:
            first.loop.call_soon_threadsafe(first.future.cancel)
            while not first.future.cancelled():
                time.sleep(0.001)
        return out

    sched._plan = spy

    async def go():
        return await asyncio.gather(*[sched.generate(p, s) for p, s in reqs], return_exceptions=True)

    try:
        out = asyncio.run(go())
    finally:
        sched.stop()
    assert isinstance(out[0], asyncio.CancelledError)
    assert plans[0] == [(30, 0, 32)]  # the others wait for the pages it feeds
    assert (31, 32, 32) in plans[1] and not any(seed == 32 and first < 64 for seed, first, _ in plans[1])
    alone = _serve(reqs[1:], 8, alone=True)[0]
    for a, b in zip(alone, out[1:], strict=True):
        assert (b.token_ids, b.logprobs, b.finish_reason) == (a.token_ids, a.logprobs, a.finish_reason)
    assert engine.pages.prefix_hits == 2 and engine.prefill_tokens == 64 + 2 * 6
    assert engine.pages.in_use == 0


def _turns(keep: bool):
    """A conversation's two turns through a `ChunkedScheduler` that keeps finished turns' pages or not
    (`keep_turns`): a 37-token prompt, then that prompt, its completion and 5 more tokens. The completions
    and the engine."""
    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), 3, 96, lora_scale=0.5, kv=RaggedPaged(CFG, 3, 96))
    sched = make_scheduler(engine, _params(), "tiny", keep_turns=keep, prefill_chunk=8)
    prompt = np.random.default_rng(5).integers(1, 96, size=37).tolist()
    sampling = SamplingParams(temperature=1.0, seed=7, max_tokens=10)

    async def go():
        first = await sched.generate(prompt, sampling)
        return first, await sched.generate(prompt + first.token_ids + [5, 6, 7, 8, 9], sampling)

    try:
        return asyncio.run(go()), engine
    finally:
        sched.stop()


def test_a_next_turn_shares_the_kept_whole_pages_of_the_last():
    """With `keep_turns`, the second turn's prompt (52 tokens) extends the first turn's kept 46 positions
    (its prompt and completion but the last token): it shares their two whole pages and feeds the 20
    positions after them (37 + 20 fed, 32 shared); its tokens are those of a prompt fed whole (the kept keys
    and values are those a prompt feed computes, within float rounding: logprobs within 1e-5). Off, nothing
    is kept or shared (37 + 52 fed)."""
    (first, second), engine = _turns(True)
    (first_off, second_off), engine_off = _turns(False)
    assert (engine.pages.prefix_hits, engine.pages.prefix_tokens, engine.prefill_tokens) == (1, 32, 37 + 20)
    assert (engine_off.pages.prefix_hits, engine_off.prefill_tokens) == (0, 37 + 52)
    assert engine.pages.kept > 0 and engine_off.pages.kept == 0
    for a, b in ((first_off, first), (second_off, second)):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=0, atol=1e-5)


def test_the_multi_step_program_compiles_for_a_tpu_slice_without_a_copy_of_the_pool():
    """`RaggedSteps._steps` (8 ragged steps in a `lax.while_loop`) over the pool `jaxrl.kv.pick` gives a TPU,
    64 slots x 2,048, compiled for v5p-8 from this CPU host with the Pallas kernel, as
    tests/test_kv_ragged.py compiles the single step: its temporaries under 10% of its KV cache (the loop's
    state is not copied into layouts of its own: measured 3.5%, the single step's 3.0%)."""
    import dataclasses

    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl.compile import programs, slices
    from jaxrl.inference.chunked import PREFILL_CHUNK, RaggedSteps
    from jaxrl.kv.ragged import pack

    model = dataclasses.replace(CFG, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=128)
    mesh = make_mesh({"tensor": 4}, slices.topology_devices(slices.parse_slice("v5p-8")))
    shapes = programs.Shapes(model, jnp.bfloat16, 4, ("q_proj", "v_proj"), 2.0, False, 8, 2048, 1, 64)
    engine, params = programs.abstract_engine(shapes, mesh)
    assert isinstance(engine.kv, RaggedPaged) and engine.decode_steps_per_dispatch == 8
    state = programs.abstract_decode_state(engine)
    steps = RaggedSteps(engine, engine.max_concurrent_decodes + PREFILL_CHUNK)
    replicated = NamedSharding(mesh, PartitionSpec())

    def placed(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree)

    batch = placed(jax.eval_shape(lambda: pack([], steps.tokens, 64)))
    last, budget = placed(jax.eval_shape(lambda: (jnp.zeros((64,), jnp.int32), jnp.zeros((64,), jnp.int32))))
    lowered = steps._steps.lower(params, state, batch, last, budget, steps=8, truncate=True, penalize=True, ban=True,
                                 top=0)
    cache = programs.shard_bytes(state.cache)
    program = programs.measure("decode", lowered, {"kv_cache": cache})
    assert program.temp < 0.1 * cache, (program.temp, cache)
