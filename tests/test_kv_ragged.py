"""The ragged paged KV cache (`jaxrl.kv.ragged.RaggedPaged`, the layout of JAX's Pallas ragged
paged-attention kernel): its CPU attention against the kernel module's own reference; a ragged step of
prompt chunks beside decode tokens against a prefill of the whole prompt; the engine over it against the
gather-based `Paged` (the same tokens, logprobs within float rounding), on a mesh that splits its heads,
with prefill buckets and with chunked prefill (`jaxrl.inference.chunked`); and its step compiled for a TPU
slice with the kernel, its temporaries under 10% of its KV cache."""

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention
from test_paged import CFG, _params  # the tiny GQA model with sharp logits, LoRA on

from jaxrl.inference.chunked import ChunkedScheduler, make_scheduler
from jaxrl.inference.engine import Engine
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.kv.paged import Paged
from jaxrl.kv.ragged import RaggedPaged, pack, reference_attention
from jaxrl.model import decoder, modules
from jaxrl.parallel.sharding import make_mesh


def test_reference_attention_is_the_kernel_modules_reference():
    """Three sequences in one flat batch (a decode token at position 5, a whole 6-token prompt, a 3-token
    chunk after 9 cached positions) over pages scattered in a pool of random keys and values, and two
    padding tokens: the jitted reference matches `ref_ragged_paged_attention` (the kernel module's, eager)
    to float32 rounding, and the padding comes back 0. `pack` refuses runs that do not fit."""
    rng = np.random.default_rng(0)
    pages, page = 20, 4
    pool = jnp.asarray(rng.standard_normal((pages, page, 2 * CFG.num_kv_heads, CFG.head_dim)), jnp.float32)
    runs = [(2, 5, 1), (0, 0, 6), (1, 9, 3)]
    batch = pack(runs, 12, 4)
    table = np.zeros((4, 5), np.int32)
    free = rng.permutation(np.arange(1, pages))
    for i, (_, start, n) in enumerate(runs):
        need = -(-(start + n) // page)
        table[i, :need], free = free[:need], free[need:]
    q = jnp.asarray(rng.standard_normal((12, CFG.num_heads, CFG.head_dim)), jnp.float32)
    ours = jax.jit(lambda *a: reference_attention(*a, sm_scale=0.3))(q, pool, batch.kv_lens, table,
                                                                       batch.cu_q_lens, batch.num_seqs)
    ref = ref_ragged_paged_attention(q, pool, *(jnp.asarray(x) for x in (batch.kv_lens, table, batch.cu_q_lens,
                                                                          batch.num_seqs)), sm_scale=0.3)
    assert ref.shape[0] == 10  # the reference's tokens: the runs', no padding
    np.testing.assert_allclose(np.asarray(ours[:10]), np.asarray(ref), rtol=0, atol=1e-5)
    assert not np.any(np.asarray(ours[10:]))
    with pytest.raises(ValueError, match="do not fit a ragged batch of 8 tokens"):
        pack(runs, 8, 4)


@pytest.mark.numerics
def test_a_chunked_prompt_beside_decode_tokens_matches_its_prefill():
    """A 13-token prompt in slot 1 prefilled in three ragged steps (chunks of 5, 5 and 3 tokens, each beside
    slot 0's decode token, and padding) on a mesh that splits the kv heads (tensor 2): its last token's
    hidden state and its keys and values in the pool match a prefill of the whole prompt (`decoder.forward`),
    and slot 0's decode tokens match the same kind's decode step."""
    mesh = make_mesh({"tensor": 2}, jax.devices()[:2])
    kind = RaggedPaged(CFG, 2, 32, page=4)
    params = _params()
    model = modules.bind(CFG, params["base"], params["lora"], 0.5)
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 96, size=13)
    alloc = kind.allocator()
    alloc.assign(0, 6, 8)  # slot 0: pages for 6 positions, 3 decoded already (random keys and values)
    alloc.assign(1, 13, 16)
    cache = kind.cache(lambda shape, axes, dtype=None: jnp.zeros(shape, dtype or jnp.float32))
    cache = {**cache, "kv": cache["kv"].at[:, 1:].set(rng.standard_normal(cache["kv"][:, 1:].shape)),
             "pages": jnp.asarray(alloc.table)}
    step = jax.jit(lambda tokens, batch, c: kind.step(model, tokens, batch, c, mesh))
    decode = jax.jit(lambda tokens, positions, c: kind.decode(model, None, tokens, positions, c, None, mesh))
    hidden = []
    for i, (start, n) in enumerate(((0, 5), (5, 5), (10, 3))):
        tokens = np.zeros((8,), np.int32)
        tokens[0], tokens[1:1 + n] = 7 + i, prompt[start:start + n]
        alone, _ = decode(jnp.array([7 + i, 0], jnp.int32), jnp.array([3 + i, 0], jnp.int32), cache)
        out, cache = step(jnp.asarray(tokens), pack([(0, 3 + i, 1), (1, start, n)], 8, 2), cache)
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(alone[0, 0]), rtol=0, atol=1e-5)
        hidden.append(out[n])
    ref_hidden, ref_kv = decoder.forward(CFG, params["base"], jnp.asarray(prompt)[None], jnp.arange(13)[None],
                                       lora=params["lora"], lora_scale=0.5)
    np.testing.assert_allclose(np.asarray(hidden[-1]), np.asarray(ref_hidden[0, -1]), rtol=0, atol=1e-4)
    ours = kind.extend_cache(cache, jnp.asarray(alloc.table[1]))
    for n in ("k", "v"):  # (keys up to 35: layer 1's off by 5e-4 at most, float32 rounding of the layer below)
        np.testing.assert_allclose(np.asarray(ours[n][:, 0, :13]), np.asarray(ref_kv[n][:, 0]), rtol=0, atol=2e-3)


def _serve(kv, mesh, reqs, scheduler=Scheduler, **kwargs):
    engine = Engine(CFG, mesh, 3, 96, lora_scale=0.5, kv=kv)
    sched = scheduler(engine, _params(), "tiny", **kwargs)

    async def go():
        return await asyncio.gather(*[sched.generate(p, s) for p, s in reqs])

    try:
        return asyncio.run(go()), engine, sched
    finally:
        sched.stop()


def _requests():
    """More requests than 3 slots: prompts of whole and partial pages and longer than a chunk of 8, greedy,
    seeded and one with a repetition penalty."""
    rng = np.random.default_rng(0)
    return [(rng.integers(1, 96, size=n).tolist(),
             SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i, max_tokens=int(rng.integers(3, 20)),
                            repetition_penalty=1.3 if i == 3 else 1.0))
            for i, n in enumerate((3, 16, 33, 1, 40, 70))]


@pytest.fixture(scope="module")
def paged():
    """The gather-based paged engine's completions of `_requests()`, on one device."""
    return _serve(Paged(CFG, 3, 96), make_mesh({}, jax.devices()[:1]), _requests())[0]


def _same(ours, paged):
    """The same tokens, logprobs within float rounding (the reference's softmax is another sum than the
    chunks': 1.3e-4 at most, measured)."""
    for r, p in zip(ours, paged, strict=True):
        assert (r.token_ids, r.finish_reason) == (p.token_ids, p.finish_reason)
        np.testing.assert_allclose(r.logprobs, p.logprobs, rtol=0, atol=1e-3)


@pytest.mark.numerics
def test_the_engine_over_the_ragged_pool_samples_the_paged_caches_tokens(paged):
    """`_requests()` through the bucketed prefill and the ragged pool's decode step, its heads split over
    tensor 2 of the mesh: the paged engine's tokens (`_same`), and every page back in the pool after."""
    ragged, engine, _ = _serve(RaggedPaged(CFG, 3, 96), make_mesh({"tensor": 2}, jax.devices()[:2]), _requests())
    _same(ragged, paged)
    assert engine.pages.in_use == 0


@pytest.mark.numerics
def test_chunked_prefill_feeds_prompts_beside_decode_tokens_and_samples_the_same(paged):
    """`_requests()` through `ChunkedScheduler` (`make_scheduler`'s for this kind) in ragged steps of 32 flat
    tokens (3 slots and a chunk of 8, rounded up to the kernel's query block): the paged engine's tokens
    (`_same`), steps that fed a prompt chunk beside other slots' decode tokens (the 70-token prompt takes 3
    steps at least), and every page back in the pool after. The scheduler refuses another kind."""
    plans = []
    plan = ChunkedScheduler._plan

    def spy(self, active):  # the real plan, recorded
        out = plan(self, active)
        plans.append(out[0])
        return out

    mesh = make_mesh({}, jax.devices()[:1])
    try:
        ChunkedScheduler._plan = spy
        chunked, engine, sched = _serve(RaggedPaged(CFG, 3, 96), mesh, _requests(), scheduler=make_scheduler,
                                        prefill_chunk=8)
    finally:
        ChunkedScheduler._plan = plan
    assert isinstance(sched, ChunkedScheduler) and sched.steps.tokens == 32
    _same(chunked, paged)
    assert engine.pages.in_use == 0
    mixed = [runs for runs in plans if any(n == 1 for _, _, n in runs) and any(n > 1 for _, _, n in runs)]
    assert len(mixed) >= 3 and max(n for runs in plans for _, _, n in runs) <= 32
    with pytest.raises(ValueError, match="chunked prefill runs over a RaggedPaged cache, not Paged"):
        ChunkedScheduler(Engine(CFG, mesh, 3, 96, kv=Paged(CFG, 3, 96)), _params(), "tiny")


def test_the_ragged_step_compiles_for_a_tpu_slice_with_the_kernel():
    """The engine's step over the pool `jaxrl.kv.pick` gives a TPU (heads of 128: the ragged kind), 64 slots x
    2,048, as `jaxrl compile` compiles it (`programs.compile_decode`: the chunked-prefill step of the 64 slots
    and 512 more tokens), for v5p-8 (4 chips, heads split 4 ways) from this CPU host with the Pallas kernel:
    its temporaries under 10% of its KV cache (no copy of the pool), the pool's pairs split by whole heads."""
    from jaxrl.compile import programs, slices

    model = dataclasses.replace(CFG, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=128)
    mesh = make_mesh({"tensor": 4}, slices.topology_devices(slices.parse_slice("v5p-8")))
    shapes = programs.Shapes(model, jnp.bfloat16, 4, ("q_proj", "v_proj"), 2.0, False, 8, 2048, 1, 64)
    engine, _ = programs.abstract_engine(shapes, mesh)
    assert isinstance(engine.kv, RaggedPaged)
    state = programs.abstract_decode_state(engine)
    assert state.cache["kv"].sharding.shard_shape(state.cache["kv"].shape)[3] == 2  # one key-value pair a chip
    decode = programs.compile_decode(shapes, mesh)
    cache = decode.declared["kv_cache"]
    pool_pages = 64 * 2048 // 16 + 1  # the slots' positions in pages of 16, and the scratch page
    assert cache == 2 * pool_pages * 16 * (2 * 4 // 4) * 128 * 2 + 64 * 128 * 4  # [L, P, page, 2K / 4, H] bf16, table
    # measured 2.7% (3.6 MB; the one-token decode step's 1.56 MB, as much as the paged kernel's at these
    # shapes): a copy of one layer's pages would be 50%
    assert decode.temp < 0.1 * cache, (decode.temp, cache)


def test_jaxrl_compile_compiles_what_the_ragged_engine_runs():
    """An engine over TPU's ragged pool feeds prompts through its ragged step (`ChunkedScheduler`) and decodes
    with a loop of those steps: `jaxrl compile` compiles that loop as its decode program (the step alone at
    `decode_steps_per_dispatch = 1`) and no prefill bucket beside it; a paged pool read by the gather (heads
    of 64) runs the bucketed scheduler: its prefill bucket and `Engine.generate_steps`. Lowered only."""
    from jaxrl.compile import programs, slices

    model = dataclasses.replace(CFG, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=128)
    mesh = make_mesh({"tensor": 4}, slices.topology_devices(slices.parse_slice("v5p-8")))
    chunked = programs.Shapes(model, jnp.bfloat16, 4, ("q_proj", "v_proj"), 2.0, False, 8, 2048, 1, 64)
    one = dataclasses.replace(chunked, decode_steps_per_dispatch=1)
    gather = dataclasses.replace(chunked, model=dataclasses.replace(model, hidden_size=512, head_dim=64))
    assert (programs.runs_prefill(chunked, mesh), programs.decode_steps(chunked, mesh)) == (False, 8)
    assert programs.engine_programs(chunked, mesh) == (
        "the ragged step of chunked prefill (576 tokens a step: the 64 slots' and prompt chunks) and the decode "
        "program of 8 of those steps, no prefill bucket")
    assert (programs.runs_prefill(gather, mesh), programs.decode_steps(gather, mesh)) == (True, 8)
    assert programs.engine_programs(gather, mesh) == ("the largest prefill bucket (2047 tokens) and the decode "
                                                      "program of 8 steps")
    for shapes, name in ((chunked, "jit__steps_impl"), (one, "jit__step_impl"), (gather, "jit__generate_steps_impl")):
        engine, params = programs.abstract_engine(shapes, mesh)
        assert isinstance(engine.kv, RaggedPaged) == (shapes is not gather)
        lowered = programs.lower_decode(engine, params, programs.abstract_decode_state(engine))
        assert lowered.as_text().startswith(f"module @{name}"), lowered.as_text()[:80]
