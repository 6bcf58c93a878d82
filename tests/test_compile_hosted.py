"""`jaxrl compile` on the Hosted Training models, at a Hosted batch, compiled for TPU slices by libtpu.

Each case compiles the train step and the engine's programs (on TPU's ragged pool the ragged step of chunked
prefill, no prefill bucket; until 2026-11-28 the largest prefill bucket beside it) at two reduced depths
(2 and 3 layers) and extrapolates every per-chip byte count to the model's depth (`jaxrl.compile.report`);
`test_memory_is_affine_in_depth` compiles a third depth and bounds the extrapolation's error. Compiled
reports are shared by the module's tests.

In the default suite since 2026-11-24 (late), the slowest file in it: on this project's 2-core machine it took
1,677 s beside the rest of the suite in CI's run of 2026-11-26 (the 30B cases 458 and 326 s, Qwen3-4B at
32,768 tokens 353 s, the depth-4 check 266 s). Qwen3-30B-A3B on two v5p hosts (fsdp 2, expert 4: each host's
engine holding its own copy of the weights) was a case until then; it left the suite to keep it within its
30 minutes (its figures: docs/tpu.md section 7; the engine-copy rule is compiled for the tiny model in
`tests/test_compile.py::test_the_runs_engine_group_is_chosen_beside_its_compiled_train_step`).
Since 2026-11-26 (midday) Qwen3-30B-A3B's whole report is compiled at 32,768 tokens on v5p-16 instead of at
4,096 on v5p-8 (182 s wall on the idle 2-core box, the case it replaced 340 s in CI; its one-host figures:
docs/tpu.md 7.3).
`JAXRL_HOSTED_COMPILE=0` skips it, for a quicker local run. `tests/test_compile.py` compiles the same
programs for the tiny model.
"""

import dataclasses
import json
import math
import os

import pytest

from jaxrl.compile import pool, programs, report, slices
from jaxrl.config.schema import RunConfig
from jaxrl.kv.ragged import RaggedPaged
from jaxrl.model import catalog, decoder
from jaxrl.model.config import ModelConfig
from jaxrl.model.modules import param_specs
from jaxrl.parallel.sharding import bytes_per_device, make_mesh

pytestmark = pytest.mark.skipif(os.environ.get("JAXRL_HOSTED_COMPILE") == "0",
                                reason="JAXRL_HOSTED_COMPILE=0: not compiling the Hosted models (about 16 CPU-minutes)")

DEPTHS = (2, 3)  # from 1 to 2 layers memory is not affine (a 1-step scan compiles differently)
QWEN3_4B, QWEN3_30B, QWEN3_235B = ("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-30B-A3B-Instruct-2507",
                                   "Qwen/Qwen3-235B-A22B-Instruct-2507")
# case: (model, slice, mesh, decode_slots, [jax] engine_hosts, seq_len); every case trains a Hosted batch, 256
# rollouts of up to seq_len tokens (half of them sampled), LoRA r16, bfloat16 weights, remat
CASES = {
    # the longest context `jaxrl models` gives Qwen3-4B (catalog.COMPILED_CONTEXT)
    "4b-v5p-8-32k": (QWEN3_4B, "v5p-8", {"tensor": 4}, 16, 0, 32768),
    # its paged decode (the whole report: docs/tpu.md 7.3)
    "30b-v5p-8": (QWEN3_30B, "v5p-8", {"expert": 4}, 256, 0, 4096),
    # the longest context `jaxrl models` gives Qwen3-30B-A3B: two hosts, the engine over both
    "30b-v5p-16-32k": (QWEN3_30B, "v5p-16", {"fsdp": 2, "expert": 4}, 32, 0, 32768),
    # engine_hosts 0: `jaxrl compile` picks the fewest engine hosts that fit beside the compiled train step
    "235b-v5p-64": (QWEN3_235B, "v5p-64", {"fsdp": 2, "tensor": 2, "expert": 8}, 128, 0, 4096),
}


def run_config(case: str) -> RunConfig:
    model, _, mesh, slots, engine_hosts, seq_len = CASES[case]
    return RunConfig.model_validate({
        "model": model, "batch_size": 256, "rollouts_per_example": 8, "lora_alpha": 32, "env": [{"id": "a/b"}],
        "sampling": {"max_tokens": seq_len // 2},
        "jax": {"mesh": mesh, "dtype": "bfloat16", "seq_len": seq_len, "lora_rank": 16, "decode_slots": slots,
                "remat": True, "engine_hosts": engine_hosts,
                # one sequence per batch shard (one compile; the largest that fits: tests/test_compile.py)
                "micro_batch_size": math.prod(n for a, n in mesh.items() if a != "tensor")}})


@pytest.fixture(scope="module")
def compiled():
    """case -> Report, each compiled once for the module on first use."""
    cache = {}

    def get(case: str) -> report.Report:
        if case not in cache:
            cache[case] = report.compile_run(run_config(case), CASES[case][1], DEPTHS)
        return cache[case]

    return get


def check(r: report.Report, case: str) -> None:
    """Fits, and the weights the compiler was given per chip are the declared shapes' arithmetic: the
    report's weights are `bytes_per_device`'s (device-free) count, and each program's compiled argument
    bytes exceed its declared arguments by under 1 MiB at each compiled depth (the per-request vectors
    and scalars, and each layer's small weights, padded to the chip's tiles: measured 3-182 KB, growing
    by 5.6 KB a layer for Qwen3-4B and 8.7 KB for Qwen3-30B-A3B). Every case's engine runs chunked prefill
    (TPU's ragged pool): the report compiles its ragged step and no prefill bucket."""
    print(r.text())  # the report, for `pytest -s`
    assert r.fits, r.text()
    mcfg = ModelConfig.from_hf(catalog.HOSTED_MODELS[CASES[case][0]])
    assert r.terms["weights"] == bytes_per_device(param_specs(mcfg), mcfg.dims(), r.mesh, 2)
    assert r.engine_programs.startswith("the ragged step of chunked prefill") and not any(
        n.startswith("prefill") for n in r.programs), r.engine_programs
    for name in ("train", "decode"):
        for d in DEPTHS:
            p = r.programs[f"{name}@{d}"]
            assert 0 <= p["argument"] - sum(p["declared"].values()) < 2**20, (name, d, p)
    json.dumps(r.to_json())


def test_qwen3_4b_trains_32k_token_rows_on_a_v5p_8(compiled):
    """Qwen3-4B on v5p-8 (one host of 4 chips, tensor 4) trains a Hosted batch of 32,768-token rows beside
    16 decode slots of 32,768 tokens fed by chunked prefill (splash attention; 40.87 of 95 GiB a chip with
    no [jax] kv_cache_tokens, the paged pool that fits: every slot's 32,768 positions, 18.00 GiB, 2026-11-27;
    40.85 with the dense cache, 2026-11-26); the engine reads the trainer's weights in place. What
    `jaxrl models` says Qwen3-4B trains (catalog.COMPILED_CONTEXT). With a pool of twice that (set), 64 slots
    run over it, and it still fits (one more compile: that pool's decode). 1,165 s alone under load 17."""
    r = compiled("4b-v5p-8-32k")
    check(r, "4b-v5p-8-32k")
    assert (r.hosts, r.engine_hosts, r.terms["engine_weights"]) == (1, 1, 0)
    model, slice_, mesh, slots, _, seq_len = CASES["4b-v5p-8-32k"]
    assert catalog.COMPILED_CONTEXT[model] == (seq_len, slice_, "tensor 4", slots) and mesh == {"tensor": 4}
    # no [jax] kv_cache_tokens: the paged pool that fits, here all 16 slots' 32,768 positions (36 KiB a token
    # a chip: the dense cache's 18 GiB), the scratch page and the page table (int32 [16, 2048]) beside them
    dense = slots * seq_len * 36 * 2**10
    assert r.pool.auto and r.pool.tokens == slots * seq_len and r.pool.fit_tokens > r.pool.tokens
    assert r.terms["kv_cache"] == dense + 16 * 36 * 2**10 + slots * 2048 * 4, r.terms

    # The same run with a paged KV pool ([jax] kv_cache_tokens, JAX's Pallas kernel): 64 slots over 2**20
    # tokens, 36 GiB a chip, 64 rollouts of 16,384 tokens at once where the dense cache runs 16. Its decode
    # step compiled at 2 layers (one compile: its scratch is flat in depth, 0.039 GiB at 2 and 3; it was the
    # whole pool, 2 GiB here, until the step's keys were written a (head, slot) row at a time); the train
    # step is the first run's. `jaxrl compile` of this config: 58.87 GiB a chip, docs/tpu.md 7.2.
    cfg = run_config("4b-v5p-8-32k").model_copy(deep=True)
    cfg.jax.decode_slots, cfg.jax.kv_cache_tokens = 64, 2**20
    shapes = report.shapes_of(cfg, r.shapes.model)
    emesh = make_mesh(r.engine_mesh, slices.topology_devices(r.slice))
    decode = programs.compile_decode(shapes.at_depth(2), emesh)
    kv = pool.of(shapes, emesh, 1, 0, seq_len // 2)
    assert decode.temp < 2**28 and kv.paged and kv.rollouts(kv.tokens) == 64 > slots, (decode.temp, kv)
    full = {n: r.programs[f"{n}@{r.shapes.model.num_layers}"] for n in ("train", "decode")}
    paged = dataclasses.replace(r, terms={
        **r.terms, "kv_cache": programs.engine_declared_bytes(shapes, emesh, own_weights=False),
        "temporaries": full["train"]["temp"] + decode.temp,
        "other": r.terms["other"] - full["decode"]["declared_slots"] + decode.declared["slots"]})
    print(f"with the pool: {paged.total / 2**30:.2f} GiB a chip")  # 58.88 (2026-11-26; the whole report 58.87)
    # the pool: twice the dense cache's tokens and the scratch page, 36 KiB a token a chip; the page table
    # (int32 [64, 2048]) on every chip
    assert paged.fits and paged.terms["kv_cache"] == 2 * dense + 16 * 36 * 2**10 + 64 * 2048 * 4, paged.terms


def test_memory_is_affine_in_depth(compiled):
    """At depth 4 each program's outputs and aliased bytes are exactly where the line through depths 2
    and 3 puts them, its arguments within 64 KiB (the tile padding of each layer's small weights:
    measured 21 KiB off for Qwen3-4B at 32,768 tokens, 2026-11-26) and its temporaries within 1% or 1 MiB,
    whichever is more (the compiler's scheduling is not exactly affine: at 32,768 tokens measured 1.7 MB
    below the line for the train step's 4.25 GB, 0.43 MB below for decode's 1.07 GB, 0.29 MB above for
    prefill's 1.16 GB, 2026-11-26). What lets `--depths 2,3` extrapolate to 36-94 layers, temporaries to
    about that precision."""
    r = compiled("4b-v5p-8-32k")
    mesh = make_mesh(r.mesh, slices.topology_devices(r.slice))
    emesh = programs.engine_mesh(mesh, r.engine_hosts)
    at4 = r.shapes.at_depth(4)
    for name, p4 in (("train", programs.compile_train(at4, mesh)), ("decode", programs.compile_decode(at4, emesh))):
        p2, p3 = r.programs[f"{name}@2"], r.programs[f"{name}@3"]
        off = {f: getattr(p4, f) - (2 * p3[f] - p2[f]) for f in ("argument", "output", "alias", "temp")}
        assert off["output"] == off["alias"] == 0, (name, off)
        assert abs(off["argument"]) <= 2**16 and abs(off["temp"]) <= max(0.01 * p4.temp, 2**20), (name, off)


def test_qwen3_30b_a3b_trains_32k_token_rows_on_two_v5p_hosts(compiled):
    """Qwen3-30B-A3B on v5p-16 (two hosts of 4 chips, fsdp 2, expert 4) trains a Hosted batch of 32,768-token
    rows beside 32 decode slots of 32,768 tokens; the engine spans both hosts and reads the trainer's weights in
    place. Narrowly: 84.67 of the 85.5 usable GiB a chip (`jaxrl compile`, 2026-11-26), since the LoRA A factors
    are rank-major (29fe192; 90.78 before). What `jaxrl models` says it trains (catalog.COMPILED_CONTEXT).
    Until 2026-11-26 this module compiled Qwen3-30B-A3B's whole report on one host at 4,096 tokens instead (its
    figures: docs/tpu.md 7.3; its paged decode is still compiled below)."""
    r = compiled("30b-v5p-16-32k")
    check(r, "30b-v5p-16-32k")
    assert (r.hosts, r.engine_hosts, r.terms["engine_weights"]) == (2, 2, 0)
    model, slice_, _, slots, _, seq_len = CASES["30b-v5p-16-32k"]
    assert catalog.COMPILED_CONTEXT[model] == (seq_len, slice_, "fsdp 2, expert 4", slots)


def test_qwen3_235b_a22b_fits_v5p_64_with_an_engine_over_hosts(compiled):
    """Qwen3-235B-A22B fits no v5p host (438 GiB of bfloat16 weights, 4 x 95 GiB). Beside the compiled train
    step (27 GiB of temporaries a chip) an engine on 4 of the 8 hosts, with its own copy of the weights
    (41 GiB a chip), does not fit; one over all 8 hosts reads the trainer's weights in place and adds only
    its KV cache, and its programs are compiled on the mesh over all 32 chips (54.11 GiB a chip,
    2026-11-24)."""
    r = compiled("235b-v5p-64")
    check(r, "235b-v5p-64")
    assert (r.hosts, r.engine_hosts, math.prod(r.engine_mesh.values())) == (8, 8, 32)
    assert r.terms["engine_weights"] == 0


def test_paged_decode_compiles_the_pallas_kernel_for_qwen3_30b_a3b_at_8k():
    """Qwen3-30B-A3B on v5p-8 (expert 4), 256 decode slots of 8,192 positions over a paged pool of 256 x 2,048
    tokens: the decode program at 2 layers (since 2026-11-27 TPU's ragged step of chunked prefill, the 256
    slots and 512 more tokens) compiles with JAX's Pallas ragged paged-attention kernel (a Mosaic custom
    call), the pool split by kv heads over the 4 chips (24 KiB a token a chip: 12 GiB at 48 layers, where the
    dense cache of 256 x 8,192 would be 48 GiB) and not copied per step (the decode-only kernel's temporaries
    0.29 GiB, 2026-11-26, under the dense step's 1.08 GB at 4,096). One compile."""
    cfg = run_config("30b-v5p-8").model_copy(deep=True)
    cfg.jax.seq_len, cfg.jax.kv_cache_tokens = 8192, 256 * 2048
    model = report.model_of(cfg)
    shapes = report.shapes_of(cfg, model).at_depth(2)
    mesh = make_mesh(CASES["30b-v5p-8"][2], slices.topology_devices(slices.parse_slice("v5p-8")))
    engine, params = programs.abstract_engine(shapes, mesh)
    state = programs.abstract_decode_state(engine)
    assert isinstance(engine.kv, RaggedPaged) and engine.kv.chunks(100) is None
    lowered = programs.lower_decode(engine, params, state)
    assert "tpu_custom_call" in lowered.as_text()
    p = programs.measure("decode", lowered, {})
    kv = pool.of(dataclasses.replace(shapes, model=model), mesh, 1, 0, 2048)
    assert kv.tokens >= 256 * 2048 and kv.bytes_per_token == 24 * 2**10 and kv.rollouts(kv.tokens) == 256
    assert programs.shard_bytes(state.cache["kv"]) == 2 * (kv.tokens + 16) * 24 * 2**10 / 48
    assert p.temp < 2**30, p.temp / 2**30


def test_intellect_3_decode_reads_each_layers_cache_in_place():
    """INTELLECT-3 (GLM-4.5-Air: a dense first layer, then MoE layers) at a Hosted batch on v5p-16, its decode
    step alone at 3 layers (one compile): the mixed stack runs as two scans (`decoder.scan_runs`), reading
    each layer's KV cache in the donated buffer, so the step's scratch is the sampler's, not the cache's.
    Unrolled (before 2026-11-26) the compiler kept each layer's cache slices beside the cache: 5.62 GiB
    of temporaries a chip at 3 layers, growing 1.08 GB a layer (2x a layer's 0.54 GB of k and v); scanned,
    1.19 GiB at 3 layers and at 4. Since the paged pool became TPU's default (2026-11-27) the step reads the
    pool in place through JAX's Pallas kernel. The whole model's report is docs/tpu.md's INTELLECT-3 row.
    The program is the default decode program of chunked prefill, 8 ragged steps (the 256 slots and 512
    prompt tokens a step) in one loop, whose scratch is flat in depth (1.368 GB at 2 layers, 1.367 at 3,
    2026-11-28; the largest buffer the fsdp-gathered unembedding, 1.16 GiB), so under 10% of the whole model's
    pool, what `jaxrl compile`'s decode temporaries line checks at full depth. Until the loop tied its weights
    to its counter and pinned their layout (`jaxrl.inference.steps.run_steps`) it kept the gathered
    unembedding and relayouted copies of the stacked weights beside the loop, growing with depth (2.22 GB at
    3 layers for the bucketed scheduler's program; docs/benchmarks-log.md, 2026-11-28)."""
    cfg = RunConfig.model_validate({
        "model": "PrimeIntellect/INTELLECT-3", "batch_size": 256, "rollouts_per_example": 8, "lora_alpha": 32,
        "env": [{"id": "a/b"}], "sampling": {"max_tokens": 2048},
        "jax": {"mesh": {"fsdp": 2, "expert": 4}, "dtype": "bfloat16", "seq_len": 4096, "lora_rank": 16,
                "decode_slots": 256, "micro_batch_size": 8}})
    model = report.model_of(cfg)
    assert [(kind, stop - start) for kind, start, stop, _ in decoder.layer_runs(model)] == [("mlp", 1), ("moe", 45)]
    shapes = report.shapes_of(cfg, model).at_depth(3)
    mesh = make_mesh(cfg.jax.mesh.model_dump(), slices.topology_devices(slices.parse_slice("v5p-16")))
    p = programs.compile_decode(shapes, mesh)
    # the paged pool, TPU's default since 5e165b3 (capped at 256 slots x 4,096 positions): 3 layers' k and v in
    # bfloat16 over 8 chips, the scratch page of 16 positions beside them, and the page table (int32 [256, 256])
    # on every chip
    layer_kv = 2 * (256 * 4096 + 16) * 8 * 128 * 2 // 8
    assert p.declared["kv_cache"] == 3 * layer_kv + 256 * (4096 // 16) * 4
    assert p.temp < 2 * 2**30, p  # under 4 layers' cache slices; unrolled, 5.62 GiB
    assert p.temp < 0.1 * model.num_layers * layer_kv, (p.temp, model.num_layers * layer_kv)
