"""The decode attention kernels over the paged KV cache, TPU's (JAX's Pallas paged-attention kernel,
`jaxrl.kv.pallas.PagedPallas`) and the GPU's (its Pallas Triton kernel, `jaxrl.kv.triton.PagedTriton`),
against the gather-based reference (`Paged`), in Pallas interpret mode on CPU: a decode step of a tiny GQA
model over slots at different lengths, float32 and bfloat16 pools, on one device and inside `shard_map` (kv
heads over `tensor`, three a chip, slots over `fsdp`); the GPU's through the engine too, and lowered for
CUDA from this CPU host."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kv.paged import Paged, pool_shape
from jaxrl.kv.pallas import PagedPallas
from jaxrl.kv.pick import kind_for
from jaxrl.kv.ragged import RaggedPaged
from jaxrl.kv.triton import PagedTriton
from jaxrl.model import modules
from jaxrl.model.config import ModelConfig
from jaxrl.model.decode import decode_step
from jaxrl.parallel.sharding import make_mesh

# 12 query heads over 6 kv heads (G = 2) of 128, as every Qwen3's head_dim (the kernel's lanes)
CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=12, num_kv_heads=6,
                  head_dim=128)
PAGE, SEQ = 16, 80  # 5 table entries a slot


@functools.cache
def _params():
    """Random weights drawn by numpy (`modules.init_params` compiles an initialiser: seconds, here)."""
    rng = np.random.default_rng(1)
    shapes = jax.eval_shape(lambda: modules.init_params(CFG, jax.random.key(0)))
    return jax.tree.map(lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype), shapes)


# measured (hidden states up to 0.35; the caches up to 4.7): TPU's kernel reads pages in bfloat16 (7.6e-4 off
# in float32, 2e-7 in bfloat16; its caches 9.3e-4 and 0); the GPU's multiplies in the pool's dtype (float32:
# 1.2e-7 off, its caches 2.2e-7; bfloat16: 1.3e-3, its probabilities rounded to bfloat16 before p @ v, its
# caches 3.9e-3, one bfloat16 step of the second layer's keys)
TOLERANCE = {(PagedPallas, jnp.float32): 4e-3, (PagedPallas, jnp.bfloat16): 1e-4,
             (PagedTriton, jnp.float32): 1e-5, (PagedTriton, jnp.bfloat16): 1e-2}


@pytest.mark.parametrize("kind", [PagedPallas, PagedTriton])
@pytest.mark.parametrize(("dtype", "mesh_shape"), [(jnp.float32, {}), (jnp.bfloat16, {"fsdp": 2, "tensor": 2})])
def test_kernel_matches_the_gather_reference(kind, dtype, mesh_shape):
    """4 slots at positions 0, 9, 37 and 79 (one page to all five, a partial last page or a full one) over
    pages scattered in a pool of random keys and values (the scratch page and the unused pages too, so a
    page read unmasked shows): the kernel's hidden states match the reference's, and the two caches hold
    the same keys and values (the kernel writes them layer by layer, the reference after the last layer).
    TPU's kernel reads pages in bfloat16 (it casts what it loads): float32 agrees to bfloat16's precision."""
    # on the mesh, 3 of the 6 kv heads a chip (fsdp does not divide 3: it splits the slots), several a chip
    # as Qwen3-4B's 8 over 4 chips (each layer's write of the step's keys spans the chip's heads). Interpret
    # mode on 8 CPU devices deadlocked here (its cross-device barrier, 2 cores): 4 devices.
    mesh = make_mesh(mesh_shape, jax.devices()[:math.prod(mesh_shape.values())])
    rng = np.random.default_rng(0)
    positions = jnp.array([0, 9, 37, 79], jnp.int32)
    pages = rng.permutation(np.arange(1, 24))  # page 0 is scratch
    held = [1, 1, 3, 5]  # pages for positions 0 .. position
    table = np.zeros((4, SEQ // PAGE), np.int32)
    for b, n in enumerate(held):
        table[b, :n], pages = pages[:n], pages[n:]
    shape = pool_shape(CFG.num_kv_heads, CFG.num_layers, 24, PAGE, CFG.head_dim)
    cache = {n: jnp.asarray(rng.standard_normal(shape), dtype) for n in ("k", "v")}
    cache["pages"] = jnp.asarray(table)
    params = _params()
    tokens = jnp.array([3, 5, 7, 11], jnp.int32)

    def step(layout):
        return jax.jit(lambda c: decode_step(CFG, params, tokens, positions, c, mesh=mesh, layout=layout))(cache)

    ref_hidden, ref_cache = step(Paged(CFG, 4, SEQ, page=PAGE))
    hidden, out_cache = step(kind(CFG, 4, SEQ, page=PAGE, mesh=mesh))
    np.testing.assert_allclose(np.asarray(hidden, np.float32), np.asarray(ref_hidden, np.float32), rtol=0,
                               atol=TOLERANCE[kind, dtype])
    for n in ("k", "v"):  # every layer's keys and values at each slot's page (an off page or layer: O(1))
        np.testing.assert_allclose(np.asarray(out_cache[n], np.float32), np.asarray(ref_cache[n], np.float32),
                                   atol=2e-2, rtol=0)
    assert not np.array_equal(np.asarray(ref_cache["k"], np.float32), np.asarray(cache["k"], np.float32))


def test_the_kernel_is_the_decode_attention_on_tpu_and_behind_a_setting_on_gpu():
    """`jaxrl.kv.pick` gives a paged pool a kernel on TPU with heads of 128 lanes (the ragged one,
    `jaxrl.kv.ragged`), the gather elsewhere; on
    GPU the Triton kernel only where `kernels.PAGED_KERNEL_ON_GPU` says (off until a GPU measures it)."""
    import dataclasses

    from jaxrl.model import kernels

    def kind(platform, head_dim):
        return type(kind_for(platform, dataclasses.replace(CFG, head_dim=head_dim), 4, SEQ, 4 * SEQ))

    assert kind("tpu", 128) is RaggedPaged
    assert kind("tpu", 64) is kind("cpu", 128) is kind("gpu", 128) is Paged and not kernels.PAGED_KERNEL_ON_GPU
    on_gpu = [kernels.cache_kind(p, 128, True, paged_kernel_on_gpu=True) for p in ("gpu", "cuda", "rocm")]
    assert on_gpu == [kernels.Cache.PAGED_GPU] * 3
    assert kernels.cache_kind("cpu", 128, True, paged_kernel_on_gpu=True) is kernels.Cache.PAGED


def _serve(kv, requests):
    """Each request's completion from an engine over `kv` (3 slots of `SEQ` positions) under the scheduler."""
    import asyncio

    from jaxrl.inference.engine import Engine
    from jaxrl.inference.scheduler import Scheduler

    engine = Engine(CFG, make_mesh({}, jax.devices()[:1]), 3, SEQ, kv=kv)
    sched = Scheduler(engine, {"base": _params(), "lora": None}, "tiny")

    async def go():
        return await asyncio.gather(*[sched.generate(p, s) for p, s in requests])

    try:
        return asyncio.run(go())
    finally:
        sched.stop()


@pytest.mark.numerics
def test_triton_kernel_samples_the_gather_references_tokens_through_the_engine():
    """Five greedy requests through 3 slots (more requests than slots, prompts of part of a page to several
    pages, 12 to 30 tokens each), a float32 pool: the engine over the Triton kernel (interpret mode) returns
    the gather reference's tokens and their logprobs to 1e-4 (measured: 4.8e-7 apart)."""
    from jaxrl.inference.protocol import SamplingParams

    rng = np.random.default_rng(3)
    requests = [(rng.integers(1, 64, size=n).tolist(), SamplingParams(temperature=0.0, max_tokens=m))
                for n, m in ((3, 30), (16, 12), (33, 20), (7, 25), (20, 16))]
    want = _serve(Paged(CFG, 3, SEQ, kv_cache_tokens=3 * SEQ), requests)
    got = _serve(PagedTriton(CFG, 3, SEQ, kv_cache_tokens=3 * SEQ), requests)
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-4)
    assert sum(len(w.token_ids) for w in want) == 30 + 12 + 20 + 25 + 16


def test_triton_kernel_lowers_for_cuda_without_a_gpu():
    """The decode step over `PagedTriton` (not in interpret mode) lowers for CUDA on this CPU host: the Pallas
    Triton kernel is one custom call in the scanned layers' body, and no gather reads the pool, where the
    gather reference (`Paged`, lowered the same way) gathers k and v pages into [K, B, N, page, H] copies."""
    params = _params()
    shape = pool_shape(CFG.num_kv_heads, CFG.num_layers, 24, PAGE, CFG.head_dim)
    cache = {n: jax.ShapeDtypeStruct(shape, jnp.bfloat16) for n in ("k", "v")}
    cache["pages"] = jax.ShapeDtypeStruct((4, SEQ // PAGE), jnp.int32)
    tokens, positions = (jax.ShapeDtypeStruct((4,), jnp.int32),) * 2
    pool = f"tensor<{'x'.join(map(str, shape))}xbf16>"

    def lowered(layout):
        step = jax.jit(lambda t, p, c: decode_step(CFG, params, t, p, c, layout=layout))
        text = step.trace(tokens, positions, cache).lower(lowering_platforms=("cuda",)).as_text()
        return text, [line for line in text.splitlines() if "stablehlo.gather" in line and f": ({pool}" in line]

    text, pool_gathers = lowered(PagedTriton(CFG, 4, SEQ, page=PAGE, interpret=False))
    assert text.count("__gpu$xla.gpu.triton") == 1 and not pool_gathers, pool_gathers[:1]
    assert len(lowered(Paged(CFG, 4, SEQ, page=PAGE))[1]) == 2
