"""Chunked prefill over the ragged paged pool (`jaxrl.inference.chunked.ChunkedScheduler`, a TPU's default
scheduler, here over the reference attention on a CPU mesh): several decode steps a dispatch while no prompt
is fed, the tokens of one step a dispatch."""

import asyncio

import jax
import numpy as np
import pytest
from test_paged import CFG, _params  # the tiny GQA model with sharp logits, LoRA on

from jaxrl.inference.chunked import ChunkedScheduler, make_scheduler
from jaxrl.inference.engine import Engine
from jaxrl.inference.protocol import SamplingParams
from jaxrl.kv.ragged import RaggedPaged
from jaxrl.parallel.sharding import make_mesh


def _serve(reqs, steps: int, slots: int = 3):
    """`reqs` through `make_scheduler`'s scheduler (a `ChunkedScheduler`, chunks of 8: steps of 32 flat tokens)
    over a ragged pool of `slots` slots x 96, `steps` decode steps a dispatch: the completions, the scheduler,
    the engine, and each multi-step dispatch's (budgets, counts)."""
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

    async def go():
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
