"""Long context on TPU slices, proven by the compiler (libtpu, no TPU): splash attention's scratch stays
far below the einsum's T x T scores, Qwen3-4B and Qwen3-30B-A3B train 32,768-token rows, and the run's
micro-batch is the largest whose compiled train step fits (`jaxrl.compile.report.compiled_micro_batch`),
where the old token rule (`default_micro_batch`, tuned to a T x T score matrix) chose one that did not.

Skipped with `JAXRL_HOSTED_COMPILE=0`, as tests/test_compile_hosted.py is.
"""

import math
import os

import jax
import jax.numpy as jnp
import pytest

from jaxrl.compile import report, slices
from jaxrl.config.schema import RunConfig
from jaxrl.model import attention
from jaxrl.parallel.sharding import array_sharding, make_mesh

pytestmark = pytest.mark.skipif(os.environ.get("JAXRL_HOSTED_COMPILE") == "0",
                                reason="JAXRL_HOSTED_COMPILE=0: not compiling for TPU slices")

GIB = 2**30


def _attention_scratch(mesh, t: int, impl: str) -> int:
    """Temporaries a chip of one causal T-token sequence's attention, forward and backward, at Qwen3-4B's
    heads (32 query, 8 kv, of 128; bf16), compiled for `mesh`."""
    shapes = {"q": (1, t, 32, 128), "k": (1, t, 8, 128), "v": (1, t, 8, 128)}
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=array_sharding(
        ("batch", None, "heads" if n == "q" else "kv_heads", None), s, mesh)) for n, s in shapes.items()]
    positions = jnp.arange(t, dtype=jnp.int32)[None]

    def loss(q, k, v):
        out = attention.attention(q, k, v, positions_BT=positions, mesh=mesh, impl=impl)
        return jnp.sum(out.astype(jnp.float32))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_splash_scratch_grows_far_less_than_t_squared():
    """v5p:2x2x1, heads over 4 chips: splash's forward + backward scratch at 8k, 16k and 32k tokens stays
    far below the einsum's and grows far less than T²: 0.05, 0.08 and 0.32 GiB (2026-11-26), under 0.5
    GiB at 32k and at most 8x from 8k to 32k (T² would be 16x), where the einsum's at 8k alone is over
    4 GiB."""
    mesh = make_mesh({"tensor": 4}, slices.topology_devices(slices.parse_slice("v5p-8")))
    splash = {t: _attention_scratch(mesh, t, "splash") for t in (8192, 16384, 32768)}
    print({t: round(b / GIB, 3) for t, b in splash.items()})  # for `pytest -s`
    assert splash[32768] < GIB / 2 and splash[32768] <= 8 * splash[8192]
    einsum = _attention_scratch(mesh, 8192, "einsum")
    assert einsum > 4 * GIB > 20 * splash[8192]


def _v4_32_run(seq_len: int = 2048, **jax_fields) -> RunConfig:
    """Qwen3-30B-A3B on a v4-32 (16 chips, 4 hosts), fsdp 16, LoRA r16, remat, a Hosted batch of 256."""
    return RunConfig.model_validate({
        "model": "Qwen/Qwen3-30B-A3B-Instruct-2507", "batch_size": 256, "rollouts_per_example": 8,
        "lora_alpha": 32, "env": [{"id": "a/b"}],
        "jax": {"mesh": {"fsdp": 16}, "dtype": "bfloat16", "seq_len": seq_len, "lora_rank": 16, "decode_slots": 64,
                "remat": True, **jax_fields}})


DEPTHS = (2, 3)


def _long_run(model: str, mesh: dict, slots: int) -> RunConfig:
    """A Hosted batch (256 rollouts, LoRA r16, bf16, remat) at `[jax] seq_len` 32,768, one sequence per batch
    shard in a micro-batch (set: one compile per depth)."""
    shards = math.prod(n for a, n in mesh.items() if a != "tensor")
    return RunConfig.model_validate({
        "model": model, "batch_size": 256, "rollouts_per_example": 8, "lora_alpha": 32, "env": [{"id": "a/b"}],
        "sampling": {"max_tokens": 16384},
        "jax": {"mesh": mesh, "dtype": "bfloat16", "seq_len": 32768, "lora_rank": 16, "decode_slots": slots,
                "remat": True, "micro_batch_size": shards}})


def test_qwen3_4b_trains_32k_tokens_on_a_v5p_8():
    """Qwen3-4B, v5p-8 (4 chips, tensor 4), 256 x 32,768 tokens a step, 16 decode slots of 32,768: the
    train step, the prefill of 32,767 tokens and the decode step fit (compiled at 2 and 3 layers,
    extrapolated to 36)."""
    r = report.compile_run(_long_run("Qwen/Qwen3-4B-Instruct-2507", {"tensor": 4}, 16), "v5p-8", DEPTHS)
    print(r.text())
    assert r.fits, r.text()


def test_qwen3_30b_a3b_trains_32k_tokens_on_two_v5p_hosts():
    """Qwen3-30B-A3B, v5p-16 (8 chips on 2 hosts, fsdp 2 x expert 4), 256 x 32,768 tokens a step, 32
    decode slots: fits (compiled at 2 and 3 layers, extrapolated to 48)."""
    r = report.compile_run(_long_run("Qwen/Qwen3-30B-A3B-Instruct-2507", {"fsdp": 2, "expert": 4}, 32), "v5p-16",
                           DEPTHS)
    print(r.text())
    assert r.fits and r.hosts == 2, r.text()
