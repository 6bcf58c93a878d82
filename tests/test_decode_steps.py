"""Several decode steps per dispatch (`Engine.generate_steps`, `[jax] decode_steps_per_dispatch`): the same
tokens, logprobs, finish reasons and policy versions as one step a dispatch, over the CPU's chunked cache,
the dense one and the paged one; stops at a stop token and at a length in the middle of a dispatch; a
stopped slot keeps its state; new weights land between two dispatches."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import generate_with_an_update, version_switch

from jaxrl.inference.engine import Engine, pad_prompt
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.kv.dense import Dense
from jaxrl.kv.paged import Paged
from jaxrl.model import decoder, modules
from jaxrl.model.blocks import LORA_TARGETS
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import make_mesh

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
SLOTS, SEQ = 3, 64


def _params(lora_seed=1):
    base = modules.init_params(CFG, jax.random.key(0))
    base = jax.tree.map(lambda x: x * 20 if x.ndim > 1 else x, base)  # sharp logits, as test_engine's
    lora = jax.tree.map(lambda x: x + 0.3, modules.init_lora(CFG, 4, tuple(LORA_TARGETS), jax.random.key(lora_seed)))
    return {"base": base, "lora": lora}


def _engine(kind: str, steps: int) -> Engine:
    kv = {"chunked": None, "dense": Dense(CFG, SLOTS, SEQ), "paged": Paged(CFG, SLOTS, SEQ)}[kind]
    return Engine(CFG, make_mesh({}, jax.devices()[:1]), SLOTS, SEQ, lora_scale=0.5, kv=kv,
                  decode_steps_per_dispatch=steps)


def _serve(engine: Engine, reqs):
    sched = Scheduler(engine, _params(), "tiny")

    async def go():
        return await asyncio.gather(*[sched.generate(p, s) for p, s in reqs])

    try:
        return asyncio.run(go()), sched.dispatches
    finally:
        sched.stop()


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["chunked", "dense", "paged"])
def test_four_steps_a_dispatch_serve_the_tokens_of_one(kind):
    """Six requests through 3 slots, k = 1 against k = 4: greedy and seeded, a group of two sharing a
    prompt (the paged cache shares its pages), one stopping at a stop token in the middle of a dispatch and
    one at its `max_tokens` in the middle of one (slots freed mid-dispatch, refilled by the requests that
    wait). Tokens, logprobs, finish reasons and policy versions are the same, bit for bit, with fewer
    dispatches; a paged engine holds no page after."""
    # seed 11 draws 49, 73, 76, 67, 49, 62, 62, 68, 39, ...: 68 first at draw 7 (draw 0 is the prefill's),
    # the third of the second dispatch of 4
    reqs = [([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=16, seed=11, stop_token_ids=(68,))),
            ([4, 5], SamplingParams(temperature=1.0, max_tokens=11, seed=3)),  # 1 + 4 + 4 + 2 draws
            ([7] * 20, SamplingParams(temperature=1.0, max_tokens=9, seed=4)),
            ([8, 9, 10], SamplingParams(temperature=0.7, top_k=5, max_tokens=14, seed=5)),
            ([8, 9, 10], SamplingParams(temperature=0.7, top_k=5, max_tokens=14, seed=6)),
            ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=16))]
    one, k_one = _serve(_engine(kind, 1), reqs)
    engine = _engine(kind, 4)
    four, k_four = _serve(engine, reqs)
    assert one[0].token_ids[-2:] == [62, 68] and one[0].finish_reason == "stop" and len(one[0].token_ids) == 8
    assert [len(c.token_ids) for c in one[1:3]] == [11, 9]
    for a, b in zip(one, four, strict=True):
        assert (b.token_ids, b.logprobs, b.finish_reason, b.policy_versions) == \
               (a.token_ids, a.logprobs, a.finish_reason, a.policy_versions)
    assert k_four < k_one / 2
    if engine.pages is not None:
        assert engine.pages.in_use == 0


@pytest.mark.numerics
def test_a_stopped_slot_keeps_its_state_and_runs_no_more_steps():
    """`Engine.generate_steps` over two seeded slots against `generate` step by step: slot 0 given 6 steps
    and a stop token it first samples at its second to fifth, slot 1 a budget of 3. Each slot's tokens and
    logprobs are the single steps', and a slot's position and token count move by its count only; a second
    dispatch runs nothing for either (slot 0 stopped, slot 1 out of budget) and slot 0's key stays."""
    engine = _engine("dense", 6)
    params = engine.prepare(_params())
    prompts = [[1, 2, 3], [4, 5, 6, 7]]

    def inserted(stop=()):  # the state and slot 0's first token (the prefill's)
        state, firsts = engine.init_decode_state(), []
        for slot, prompt in enumerate(prompts):
            sampling = SamplingParams(temperature=1.0, stop_token_ids=stop if slot == 0 else ())
            prefix = engine.prefill(params=params, padded_tokens=pad_prompt(prompt, 16), true_length=len(prompt),
                                    sampling=sampling, key=jax.random.key(slot))
            state = engine.insert(prefix, state, slot)
            firsts.append(int(prefix.token[0]))
        return state, firsts[0]

    (state, prefilled), ref_tokens, ref_logprobs = inserted(), [], []
    for _ in range(6):
        state, res = engine.generate(params, state, truncate=False)
        ref_tokens.append(np.asarray(res.tokens))
        ref_logprobs.append(np.asarray(res.logprobs))
    ref_tokens, ref_logprobs = np.stack(ref_tokens), np.stack(ref_logprobs)
    column = [prefilled, *ref_tokens[:, 0].tolist()]  # a stop token first drawn by a decode step, not the first
    first = next(i for i in range(2, 6) if column.index(column[i]) == i) - 1
    state, _ = inserted(stop=(column[first + 1],))
    state, out = engine.generate_steps(params, state, np.array([6, 3, 0]), truncate=False)
    counts = np.asarray(out.counts)
    assert counts.tolist() == [first + 1, 3, 0]
    for slot in (0, 1):
        n = counts[slot]
        np.testing.assert_array_equal(np.asarray(out.tokens)[:n, slot], ref_tokens[:n, slot])
        np.testing.assert_array_equal(np.asarray(out.logprobs)[:n, slot], ref_logprobs[:n, slot])
    positions = [len(p) + n for p, n in zip(prompts, counts[:2], strict=True)]
    assert np.asarray(state.positions)[:2].tolist() == positions
    assert np.asarray(state.generated)[:2].tolist() == (1 + counts[:2]).tolist()
    keys = np.asarray(jax.random.key_data(state.keys))
    state, again = engine.generate_steps(params, state, np.array([6, 0, 0]), truncate=False)
    assert np.asarray(again.counts).tolist() == [0, 0, 0]
    assert np.asarray(state.positions)[:2].tolist() == positions
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(state.keys)), keys)


@pytest.mark.numerics
def test_new_weights_land_between_two_dispatches():
    """An update while a request decodes 4 steps a dispatch: the policy version changes at a dispatch's
    first draw (draws 1 + 4m), every draw before it scored by the old weights (the full forward's
    logprobs), those after it by the new."""
    p0, p1 = _params(1), _params(2)
    engine = _engine("chunked", 4)
    sched = Scheduler(engine, p0, "tiny")
    c = generate_with_an_update(sched, [4, 5, 6], SamplingParams(max_tokens=40, seed=3), p1,
                                when=lambda: sched.dispatches >= 2)
    ids = jnp.asarray([4, 5, 6] + c.token_ids + [0] * (64 - 3 - len(c.token_ids)), jnp.int32)
    h, _ = decoder.forward(CFG, p0["base"], ids[None], jnp.arange(64)[None], lora=p0["lora"], lora_scale=0.5)
    ref = np.asarray(jax.nn.log_softmax(decoder.logits(p0["base"], h)[0], axis=-1))
    switch = version_switch(c, np.array([ref[2 + i, t] for i, t in enumerate(c.token_ids)]))
    assert switch > 1 and (switch - 1) % 4 == 0, switch
