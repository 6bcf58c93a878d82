"""`jaxrl compile`: the run's programs compiled for TPU slices by libtpu's compiler (no TPU attached)."""

import dataclasses
import json
import tomllib

import pytest

from jaxrl.compile import slices
from jaxrl.model.assets import VOCAB_ROWS


def test_slice_names():
    assert slices.parse_slice("v5p-64").topology == "v5p:2x4x4"
    assert slices.parse_slice("v4-32").topology == "v4:2x2x4"
    assert slices.parse_slice("v5litepod-16").topology == "v5e:4x4"
    assert slices.parse_slice("v6e-64").topology == "v6e:8x8"
    assert slices.parse_slice("v5p:4x4x4").name == "v5p-128"
    for bad in ("v5p-7", "v7-8", "v6e:4x4x4", "v5litepod-12"):
        with pytest.raises(ValueError, match="expected"):
            slices.parse_slice(bad)
    # (chips, hosts) as the slices have them: v4 megacore (a device per chip), 8-chip v5e / v6e one host
    for name, layout in (("v5p-64", (32, 8)), ("v4-16", (8, 2)), ("v6e-8", (8, 1)), ("v5litepod-8", (8, 1)),
                         ("v6e-16", (16, 4))):
        devices = slices.topology_devices(slices.parse_slice(name))
        assert (len(devices), len({d.process_index for d in devices})) == layout, name
        assert devices[0].platform == "tpu"


def test_cli_compiles_a_checkpoint_config_for_a_slice(tmp_path, tiny_model_dir):
    """`jaxrl compile` on a config whose architecture comes from its checkpoint's config.json (the tiny
    Qwen3, full depth): the report on stdout, the JSON file, exit 0 when it fits; a slice name gcloud
    does not know, or a mesh of another size, is an error naming it (exit 2)."""
    from typer.testing import CliRunner

    from jaxrl.cli.main import app

    config = tmp_path / "rl.toml"
    config.write_text(f'model = "tiny"\nbatch_size = 16\nrollouts_per_example = 4\n[[env]]\nid = "a/b"\n'
                      f'[jax]\nmodel_path = "{tiny_model_dir}"\nseq_len = 128\ndecode_slots = 8\n'
                      f'dtype = "bfloat16"\nmesh = {{ fsdp = 4 }}\ndecode_steps_per_dispatch = 1\n')
    runner = CliRunner()
    # --no-context: the context search is tested on its own (test_context_is_the_longest_length_that_fits)
    result = runner.invoke(app, ["compile", str(config), "--topology", "v5litepod-4", "--no-context",
                                 "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "v5litepod-4 (v5e:2x2): 4 chips on 1 hosts" in result.output and "fits" in result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["fits"] and data["chips"] == 4 and data["bytes_per_chip"]["total"] < data["bytes_per_chip"]["hbm"]
    assert data["compiled_depths"] == [data["model_layers"]] and data["context"] is None
    # no [jax] micro_batch_size: the largest that fits, by compiling (the whole batch, for the tiny model)
    assert (data["micro_batch_size"], data["micro_batch_from"]) == (16, "the largest that fits (compiled)")
    # the compiler's cost of a layer against the ideal (4 FLOPs per weight and token with LoRA, and attention)
    cost = data["cost"]
    assert cost["layer_flops"] > cost["ideal_layer_flops"] > 0 and "compiler cost" in result.output
    # and of a prefill layer (the 127-token bucket) and a decode layer (8 slots over 128 positions of the
    # engine's paged pool: the tiny model's 16-wide heads take the gather, not the Pallas kernel), each
    # unrolled at 2 and 3 layers: the einsum attention is visible, so the compiler counts at least the ideal
    # (2 FLOPs per active weight and token + attention); the prefill's bytes at least the weights (+ KV); the
    # decode's bytes are its own line's (below)
    prefill, decode = cost["engine"]
    assert (prefill["program"], decode["program"]) == ("prefill 127 tokens", "decode 8 slots x 128")
    assert prefill["bytes"] >= prefill["ideal_bytes"] > 0 and not decode["bytes_counted"]
    for layer in (prefill, decode):
        assert layer["flops"] >= layer["ideal_flops"] > 0 and layer["kernel_flops"] == 0, layer
        assert f"compiler cost ({layer['program']}, one layer" in result.output
    assert "ratio" in result.output.split("compiler cost (decode")[1].split("(bytes: the decode step bytes line)")[0]
    # no [jax] kv_cache_tokens on TPU: the paged pool that fits, capped at the 8 slots x 128 it can ever hold;
    # its room beside the run, rollouts of 64 tokens (seq_len / 2)
    assert (data["kv_pool_tokens"], data["kv_pool_paged"], data["kv_pool_auto"], data["engines"]) == \
        (8 * 128, True, True, 1)
    assert data["kv_pool_tokens_fit"] > data["kv_pool_tokens"] and "KV cache: 1,024 tokens per engine, paged pool " \
        "sized to fit ([jax] kv_cache_tokens unset" in result.output
    assert data["concurrent_rollouts"] == {"mean_tokens": 64, "per_engine": 8, "per_slice": 8, "per_slice_fit": 8}
    _check_decode_bytes(data, result.output)
    bad = runner.invoke(app, ["compile", str(config), "--topology", "v5p-7"])
    assert bad.exit_code == 2 and "--topology: slice 'v5p-7'" in bad.output
    wrong = runner.invoke(app, ["compile", str(config), "--topology", "v6e-8"])
    assert wrong.exit_code == 2 and "jax.mesh" in wrong.output and "v6e-8 has 8 chips" in wrong.output
    assert "v5litepod-16" in runner.invoke(app, ["compile", "--help"]).output
    # full fine-tuning: float32 master weights (twice the bfloat16 ones), AdamW moments (2 x the weights; the
    # state is donated, so the step's new weights and moments are written over the old ones, not beside them:
    # 5 x before), and the engine's bfloat16 copy; and a pool
    # set by [jax] kv_cache_tokens is that pool (whole pages), not the one that fits
    config.write_text(config.read_text() + 'finetune = "full"\nkv_cache_tokens = 200\n')
    full = runner.invoke(app, ["compile", str(config), "--topology", "v5litepod-4", "--no-cost", "--no-context",
                               "--json", str(tmp_path / "f.json")])
    assert full.exit_code == 0, full.output
    pool = json.loads((tmp_path / "f.json").read_text())
    assert (pool["kv_pool_tokens"], pool["kv_pool_paged"], pool["kv_pool_auto"]) == (208, True, False)
    assert "paged pool ([jax] kv_cache_tokens)" in full.output
    lora, full = data["bytes_per_chip"], pool["bytes_per_chip"]
    assert full["weights"] == 2 * lora["weights"] and full["engine_weights"] == lora["weights"] > 0
    assert lora["engine_weights"] == 0 and 2 * full["weights"] <= full["lora_optimizer"] < 3 * full["weights"]
    # every leaf of the donated state is written in place: what the step outputs beyond its aliased bytes is
    # its metrics alone (a leaf XLA could not alias would stand beside its input, a buffer of its own). The
    # step's scratch then counts whole as temporaries: undonated, part of it (the gradients, the bfloat16
    # casts) lay in the empty output buffers, counted as output (docs/benchmarks-log.md, 2026-11-28)
    step = pool["programs"][f"train@{pool['model_layers']}"]
    assert step["alias"] >= step["declared"]["weights"] + step["declared"]["optimizer"]
    assert 0 < step["output"] - step["alias"] <= 2**13, step  # a dozen scalars, 512 bytes each as TPU tiles them
    _check_kl_reference(runner, app, config, tmp_path, data, json.loads((tmp_path / "f.json").read_text()))


def _check_decode_bytes(data: dict, output: str):
    """The decode step's bytes a chip from its compiled buffers (`jaxrl.compile.decode_bytes`): its weights
    and LoRA as declared, its cache read as the gather reads it (every slot's first chunk, 128 positions, for
    slots at position 64), this step's key and value, and its ideal the weights once + 8 x 64 positions;
    its temporaries under 10% of its KV cache (no copy of the pool) beside the sampler's: TPU's `lax.top_k`
    search (`jaxrl.model.kernels.sampler_search`) keeps the [8, V] float32 probabilities it reads twice
    (5.1 MB here, 19x this tiny cache; one such buffer is 0.15 GiB at 256 slots). One step a program (the
    config's: a loop of steps over this tiny model's 16-wide heads, the gather's pool, carries the pool in a
    layout of its own, copied in before the loop: docs/benchmarks-log.md, 2026-11-27)."""
    step, decode = data["decode_bytes"], data["programs"][f"decode@{data['model_layers']}"]
    per_token = data["kv_bytes_per_token"]
    assert step["weights"] == decode["declared"]["weights"] + decode["declared"]["lora"] > 0
    assert (step["reads"], step["position"], step["slots"]) == ("gather", 64, 8)
    assert (step["kv_read"], step["kv_written"], step["kv_in_use"]) == \
        (int(8 * 128 * per_token), int(8 * per_token), int(8 * 64 * per_token))
    assert step["ideal"] == step["weights"] + step["kv_in_use"] and step["moved"] >= step["ideal"]
    sampler = 2 * 8 * VOCAB_ROWS * 4  # at most two [B, V] float32 buffers
    assert step["cache"] == data["bytes_per_chip"]["kv_cache"] and step["temp"] < 0.1 * step["cache"] + sampler, step
    assert f"ratio {step['moved'] / step['ideal']:.2f}" in output.split("decode step bytes (8 slots at position 64")[1]
    assert step["steps"] == 1 and "per step of a program of 1," in output
    assert "decode temporaries: " in output and "of the KV cache" in output


def _check_kl_reference(runner, app, config, tmp_path, lora: dict, full: dict):
    """Full fine-tuning with `kl_coef > 0` holds a frozen copy of the starting weights (in `[jax] dtype`)
    for the KL reference: the train step's compiled arguments grow by that copy (plus the chip's tile
    padding, under 1 MiB), which the report counts as `kl_reference`, so its total changes by exactly
    the copy, the reference forward's scratch and the KL metric. With LoRA the reference is the base with the LoRA off:
    the train step takes no argument more."""
    from jaxrl.compile import programs, report, slices
    from jaxrl.config.schema import RunConfig
    from jaxrl.parallel.sharding import make_mesh

    lora_text = config.read_text().replace('finetune = "full"\n', "")
    config.write_text(config.read_text() + "[jax.loss]\nkl_coef = 0.1\n")
    kl = runner.invoke(app, ["compile", str(config), "--topology", "v5litepod-4", "--no-cost", "--no-context",
                             "--json", str(tmp_path / "k.json")])
    assert kl.exit_code == 0, kl.output
    kl = json.loads((tmp_path / "k.json").read_text())
    train = f"train@{full['model_layers']}"
    on, off = kl["bytes_per_chip"], full["bytes_per_chip"]
    copy = off["weights"] // 2  # the float32 master weights' bfloat16 copy
    assert off["kl_reference"] == 0 and on["kl_reference"] == copy == kl["programs"][train]["declared"]["reference"]
    assert 0 <= kl["programs"][train]["argument"] - full["programs"][train]["argument"] - copy < 2**20
    # and the step's outputs by the KL metric (one scalar, `policy/ref_kl`), counted with its state
    metric = kl["programs"][train]["output"] - full["programs"][train]["output"]
    assert 0 < metric <= 2**10 and on["lora_optimizer"] - off["lora_optimizer"] == metric
    same = [t for t in report.TERMS if t not in ("kl_reference", "temporaries", "lora_optimizer")]
    assert {t: on[t] for t in same} == {t: off[t] for t in same}
    assert on["total"] - off["total"] == copy + metric + on["temporaries"] - off["temporaries"]
    # LoRA: the train step with the KL loss on takes the same arguments (the base it already has)
    lora_kl = RunConfig.model_validate({**tomllib.loads(lora_text), "jax": {
        **tomllib.loads(lora_text)["jax"], "loss": {"kl_coef": 0.1}}})
    mesh = make_mesh({"fsdp": 4}, slices.topology_devices(slices.parse_slice("v5litepod-4")))
    shapes = dataclasses.replace(report.shapes_of(lora_kl, report.model_of(lora_kl)),
                                 micro_batch_size=lora["micro_batch_size"])
    program = programs.compile_train(shapes, mesh)
    assert program.declared["reference"] == 0 and program.argument == lora["programs"][train]["argument"]


def test_the_kv_pool_that_fits_is_whole_pages_beside_its_table_capped_at_what_the_slots_hold():
    """`[jax] kv_cache_tokens` unset on an accelerator: the pool that fits its room (`pool.fit_pool_tokens`:
    less the page table and the scratch page, whole pages) capped at decode_slots x seq_len and at least one
    sequence (`pool.auto_pool_tokens`); hand-computed numbers."""
    from jaxrl.compile import pool

    # 1 GiB, a 64 KiB table, 24 KiB a token (Qwen3-30B-A3B on expert 4): (2^30 - 2^16) // 24576 = 43,688,
    # less the scratch page 43,672, whole pages of 16: 43,664
    assert pool.fit_pool_tokens(2**30, 24 * 2**10, 2**16, 16) == 43_664
    assert pool.fit_pool_tokens(2**16, 24 * 2**10, 2**16, 16) == pool.fit_pool_tokens(-5.0, 1.0, 0, 16) == 0
    assert pool.fit_pool_tokens(16 * 100 + 0.5, 1.0, 0, 16) == 16 * 99  # 1,600 positions, less scratch
    # 256 slots of 8,192: the fit under the cap (2,097,152); the cap over it; one sequence at least
    assert pool.auto_pool_tokens(1_343_168, 256, 8192, 16) == 1_343_168
    assert pool.auto_pool_tokens(3_000_000, 256, 8192, 16) == 256 * 8192
    assert pool.auto_pool_tokens(0, 256, 8192, 16) == 8192
    # seq_len 100 in pages of 16: 112 positions a slot, 4 slots 448
    assert pool.auto_pool_tokens(10**6, 4, 100, 16) == 448 and pool.auto_pool_tokens(5, 4, 100, 16) == 112


def test_decode_bytes_are_the_step_buffers_against_weights_once_and_the_kv_in_use():
    """`decode_bytes.of` on hand-made byte counts: 4 slots at position 300 of 1,024 with 1 KiB a cached
    position; weights 100 MiB + LoRA 1 MiB; the compiled arguments 200 MiB (the cache 64 MiB + the slot
    state), outputs 65 MiB of which 64 MiB in place, temporaries 3 MiB; as one step, and as a program of 8."""
    from jaxrl.compile import decode_bytes

    mib = 2**20
    decode = {"declared_weights": 100 * mib, "declared_lora": mib, "declared_kv_cache": 64 * mib,
              "argument": 200 * mib, "output": 65 * mib, "alias": 64 * mib, "temp": 3 * mib}
    step = decode_bytes.of(decode, 64 * mib, 1024.0, "kernel", 4, 300, 1024)
    # the kernel reads 3 blocks of 128 positions a slot (384), writes one position a slot
    assert (step.kv_read, step.kv_written, step.kv_in_use) == (4 * 384 * 1024, 4 * 1024, 4 * 300 * 1024)
    assert (step.weights, step.state, step.outputs) == (101 * mib, 35 * mib, mib)
    assert step.moved == 101 * mib + 4 * 384 * 1024 + 4 * 1024 + 35 * mib + mib + 6 * mib
    assert step.ideal == 101 * mib + 4 * 300 * 1024
    lines = decode_bytes.of(decode, 64 * mib, 1024.0, "dense", 4, 300, 1024).lines()
    assert "KV read 4.00 MiB (the whole dense cache, masked)" in lines[0] and "4.7% of the KV cache" in lines[1]
    assert decode_bytes.positions_read("gather", 300, 1024) == 512  # chunks 256, 256, 512 (jaxrl.kv.chunks.chunk_sizes)
    # a program of 8 decode steps (`[jax] decode_steps_per_dispatch`): per step, the slot state read and the
    # outputs written once a program count an eighth; the weights, KV and temporaries are each step's
    eighth = decode_bytes.of(decode, 64 * mib, 1024.0, "kernel", 4, 300, 1024, steps=8)
    assert (eighth.weights, eighth.kv_read, eighth.temp) == (step.weights, step.kv_read, step.temp)
    assert (eighth.state, eighth.outputs) == (35 * mib // 8, mib // 8) and "of a program of 8" in eighth.lines()[0]


def test_a_run_on_an_accelerator_sizes_its_kv_pool_to_what_fits(tiny_model_dir, monkeypatch):
    """The run's side (`run_pool.startup_kv_cache_tokens`): no memory reported (CPU), the dense cache (None);
    `[jax] kv_cache_tokens` set, that (nothing compiled); else, with a chip's memory and what is in use (a
    v5p's 95 GiB and 1 GiB stood in for here: this machine has no accelerator), the train step, prefill and
    decode compiled and the pool that fits, here every slot's 128 positions (8 x 128); with no room left, one
    sequence. The tiny Qwen3 on v5p-16 (fsdp 8): 512 B a position a chip (2 x 2 layers x 2 kv heads x 16 x
    float32, the heads not split: 8 chips do not divide 2), a table of 8 x 8 int32."""
    from jaxrl.compile import pool, report, run_pool
    from jaxrl.parallel import distributed

    cfg, mcfg, mesh = _tiny_on_v5p_16(tiny_model_dir)
    said = []
    monkeypatch.setattr(distributed, "chip_memory", lambda: None)
    assert run_pool.startup_kv_cache_tokens(cfg, mcfg, mesh, mesh, 16, said.append) is None and not said
    monkeypatch.setattr(distributed, "chip_memory", lambda: 95 * 2**30)
    monkeypatch.setattr(distributed, "memory_in_use", lambda: 2**30)
    keyed = cfg.model_copy(deep=True)
    keyed.jax.kv_cache_tokens = 300
    assert run_pool.startup_kv_cache_tokens(keyed, mcfg, mesh, mesh, 16, said.append) == 300 and not said
    assert run_pool.startup_kv_cache_tokens(cfg, mcfg, mesh, mesh, 16, said.append) == 8 * 128
    assert "kv_cache_tokens unset: compiling the train step, prefill and decode" in said[0]
    assert said[1].startswith("KV pool: 1,024 tokens per engine")
    shapes = report.shapes_of(cfg, mcfg)
    assert pool.token_bytes(mcfg, {"fsdp": 8}, 4) == 512
    # room for the table (256 B), the scratch page and 500 positions: 496 in whole pages; none: one sequence
    assert pool.sized(shapes, mesh, 256 + (16 + 500) * 512).kv_cache_tokens == 496
    assert pool.sized(shapes, mesh, -1).kv_cache_tokens == 128


def test_overflow_advice_leaves_out_what_the_run_already_does():
    """Over HBM: the advice names `remat = true` (for temporaries) only when remat is off, and a smaller
    micro-batch, first and whatever the term, only while the run sets one ([jax] micro_batch_size) of more
    than one sequence per batch shard (data x fsdp x expert chips): the 2026-11-24 compile of
    Qwen3-235B-A22B on v5p-64 (remat on, 16-sequence micro-batches over 16 shards) had been told to try
    both. A micro-batch chosen by compiling is never named: the search judged the whole program set, so no
    smaller one fits when it does not (issue 43: Qwen3-30B-A3B at 32,768 on v5p-16 had been told "fewer
    decode_slots, or a larger slice" beside a micro-batch the search had sized without the engine's
    programs). No compiling."""
    from jaxrl.compile import report
    from jaxrl.config.schema import RunConfig

    cfg = RunConfig.model_validate({"model": "Qwen/Qwen3-4B-Instruct-2507", "batch_size": 64,
                                    "rollouts_per_example": 8, "env": [{"id": "a/b"}],
                                    "jax": {"remat": True, "micro_batch_size": 16}})
    on = report.shapes_of(cfg, report.model_of(cfg))
    off = dataclasses.replace(on, remat=False)
    smaller = report.SMALLER_MICRO_BATCH
    assert smaller.startswith("a smaller [jax] micro_batch_size")
    assert report.advice("temporaries", off, {"fsdp": 4}) == \
        f"[jax] remat = true, {smaller}, fewer decode_slots, or a larger slice"
    assert report.advice("temporaries", on, {"fsdp": 4}) == f"{smaller}, fewer decode_slots, or a larger slice"
    assert report.advice("temporaries", on, {"fsdp": 2, "expert": 8}) == "fewer decode_slots, or a larger slice"
    assert report.advice("kv_cache", on, {"fsdp": 4}) == f"{smaller}; {report.ADVICE['kv_cache']}"
    assert report.advice("kv_cache", on, {"fsdp": 16}) == report.ADVICE["kv_cache"]
    # chosen by compiling: not named, whatever the term
    assert report.advice("temporaries", on, {"fsdp": 4}, micro_batch_set=False) == \
        "fewer decode_slots, or a larger slice"
    assert report.advice("kv_cache", on, {"fsdp": 4}, micro_batch_set=False) == report.ADVICE["kv_cache"]


def test_cost_lines_under_splash_give_attention_apart_and_no_negative_waste():
    """Under splash attention `cost_analysis()` counts nothing inside the Pallas kernel, so the train step's
    FLOPs fall below the ideal: the report says what the compiler cannot see and compares the rest with
    the ideal without it, instead of "-91%" waste. Qwen3-4B's train step at 32,768 tokens on v5p-8
    (docs/tpu.md 7.2, compiled 2026-11-26): 4.697 TFLOP a layer against 9.904 ideal, 6.60 of it attention,
    remat's forward again (the matmuls only: the kernel's output is kept) 1.65. No compiling."""
    from jaxrl.compile import slices
    from jaxrl.compile.cost import Cost, LayerCost

    chip = slices.parse_slice("v5p-8").chip
    splash = Cost(4.697e12, 50 * 2**30, 0.0, 0.0, 9.904e12, 1.652e12, 36, 1, attention_flops=6.60e12, kernel=True,
                  engine=(LayerCost("prefill 32767 tokens", 1.0e12, 2**30, 1.2e12, 2**29, kernel_flops=0.5e12),))
    text = "\n".join(splash.lines(chip))
    assert "ratio 0.47" in text and "attention not in them" in text
    assert ("attention inside the splash kernel: 6.600 TFLOP (67% of the ideal), not counted by the compiler; "
            "outside it the compiler counts 0.95 of the ideal + remat (4.956 TFLOP)") in text
    assert "nothing beyond ideal + remat outside the kernel: the compiler counts fewer FLOPs than it" in text
    assert "-" not in "".join(t for t in text.split() if t.endswith("%")), text  # no negative share
    assert ("compiler cost (prefill 32767 tokens, one layer, per chip): 1.000 TFLOP, 1.00 GiB accessed; ideal "
            "1.200 TFLOP, 500.000 GFLOP of it attention inside the splash kernel, not counted by the compiler "
            "(outside it: ratio 1.43), 512.00 MiB (weights once + KV): ratio 0.83 FLOPs, 2.00 bytes") in text
    einsum = dataclasses.replace(splash, layer_flops=12.0e12, kernel=False, engine=())
    assert einsum.lines(chip)[-1] == ("  the rest beyond ideal + remat (masked attention blocks, LoRA's products, "
                                      "norms, relayouts): +4% of the ideal")


def test_depths_too_shallow_for_the_stacks_scans_are_refused_before_compiling(tmp_path):
    """`jaxrl compile --depths a,b` extrapolates from two depths, which must leave every scan of layers
    but the last whole and the last at 2 trips or more (a scan of one trip is inlined, so memory is not
    affine from it). INTELLECT-3 (1 dense layer, then 45 MoE layers): `--depths 2,3` is refused (exit 2)
    naming the model, the depths and the smallest valid pair, 3,4; a Qwen3's is 2,3. The cost's unrolled
    depths are picked to differ by one layer of the last run. No compiling."""
    from typer.testing import CliRunner

    from jaxrl.cli.main import app
    from jaxrl.compile import depths
    from jaxrl.model import catalog
    from jaxrl.model.config import ModelConfig

    config = tmp_path / "rl.toml"
    config.write_text('model = "PrimeIntellect/INTELLECT-3"\nbatch_size = 256\nrollouts_per_example = 8\n'
                      '[[env]]\nid = "a/b"\n[jax]\nmesh = { fsdp = 2, expert = 4 }\nmicro_batch_size = 8\n')
    bad = CliRunner().invoke(app, ["compile", str(config), "--topology", "v5p-16", "--depths", "2,3"])
    assert bad.exit_code == 2, bad.output
    said = " ".join(bad.output.split())
    assert "--depths 2,3: PrimeIntellect/INTELLECT-3 runs its 46 layers as 2 scan(s) (1 dense layer, then 45 " \
           "MoE layers); at 2 layers its last scan has 1 trip(s)" in said and "smallest valid pair is 3,4" in said
    glm45_air = ModelConfig.from_hf(catalog.HOSTED_MODELS["PrimeIntellect/INTELLECT-3"])
    glm45 = dataclasses.replace(glm45_air, first_k_dense_replace=3)  # GLM-4.5's three dense layers
    qwen3 = ModelConfig.from_hf(catalog.HOSTED_MODELS["Qwen/Qwen3-30B-A3B-Instruct-2507"])
    assert [depths.smallest(m) for m in (glm45_air, glm45, qwen3)] == [3, 5, 2]
    assert [depths.cost_depths(m) for m in (glm45_air, glm45, qwen3)] == [(2, 3), (4, 5), (2, 3)]
    depths.check(glm45_air, (3, 4), "INTELLECT-3")  # the pair docs/tpu.md's INTELLECT-3 row compiles
    with pytest.raises(ValueError, match=r"--depths 3,4: x .* at 3 layers it has 1 of its 2 runs.* pair is 5,6"):
        depths.check(glm45, (3, 4), "x")
    with pytest.raises(ValueError, match=r"--depths 1,2: .* 1 trip\(s\).* pair is 2,3"):
        depths.check(qwen3, (1, 2), "Qwen3-30B-A3B")


def test_context_is_the_longest_length_that_fits(tiny_model_dir):
    """`jaxrl compile`'s context line (`jaxrl.compile.context.compiled_context`): the longest power of two
    (or the model's longest) whose train step at one sequence per batch shard, compiled, fits beside the
    engine's KV cache at that length. The tiny Qwen3 with its longest context lowered to 4096 (candidates
    1024, 2048, 4096), on v5litepod-4, fsdp 4: on an ample chip, 4096, the model's longest; on a chip that
    leaves a byte too few for 4096's bytes, 2048, and 4096 named with the same bytes; the bytes grow from
    2048 to 4096 by at least the KV cache's growth. Four compiles of the tiny train step."""
    import math

    from jaxrl.compile import context, fit, programs, report
    from jaxrl.config.schema import RunConfig
    from jaxrl.model import hf
    from jaxrl.parallel.sharding import make_mesh

    cfg = RunConfig.model_validate({"model": "tiny", "batch_size": 16, "rollouts_per_example": 4,
                                    "env": [{"id": "a/b"}], "jax": {"model_path": str(tiny_model_dir), "seq_len": 128,
                                                                    "decode_slots": 8, "mesh": {"fsdp": 4}}})
    mcfg = dataclasses.replace(hf.load_config(str(tiny_model_dir)), max_position_embeddings=4096)
    shapes = report.shapes_of(cfg, mcfg)
    mesh = make_mesh({"fsdp": 4}, slices.topology_devices(slices.parse_slice("v5litepod-4")))
    assert context.candidates(4096) == [1024, 2048, 4096] and context.candidates(40960)[-2:] == [32768, 40960]
    ample = context.compiled_context(shapes, mesh, 2**40)
    assert (ample.tokens, ample.longer, ample.compiled) == (4096, None, (2048, 4096)), ample
    assert "up to 4,096 tokens" in ample.line(2**40) and "the model's longest" in ample.line(2**40)
    tight = context.compiled_context(shapes, mesh, math.ceil(ample.bytes / fit.FIT_SHARE) - 1)
    assert (tight.tokens, tight.longer, tight.longer_bytes) == (2048, 4096, ample.bytes), tight
    assert "4,096 does not fit" in tight.line(2**40)
    cache = [programs.engine_declared_bytes(dataclasses.replace(shapes, seq_len=t), mesh, False) for t in (2048, 4096)]
    assert ample.bytes - tight.bytes >= cache[1] - cache[0] > 0


def _tiny_on_v5p_16(tiny_model_dir):
    """(run config, ModelConfig, trainer mesh) of the tiny Qwen3 on v5p-16's 8 chips over 2 hosts, fsdp 8."""
    from jaxrl.config.schema import RunConfig
    from jaxrl.model import hf
    from jaxrl.parallel.sharding import make_mesh

    cfg = RunConfig.model_validate({"model": "tiny", "batch_size": 16, "rollouts_per_example": 4,
                                    "env": [{"id": "a/b"}], "jax": {"model_path": str(tiny_model_dir), "seq_len": 128,
                                                                    "decode_slots": 8, "mesh": {"fsdp": 8}}})
    mesh = make_mesh({"fsdp": 8}, slices.topology_devices(slices.parse_slice("v5p-16")))
    return cfg, hf.load_config(str(tiny_model_dir)), mesh


def test_the_runs_engine_group_is_chosen_beside_its_compiled_train_step(tiny_model_dir):
    """A run with `[jax] engine_hosts = 0` over several processes with accelerators
    (`distributed.engine_hosts`) compiles its train step for its own mesh and takes the fewest hosts whose
    engine fits beside it (`report.run_engine_hosts`), as `jaxrl compile` does. The tiny Qwen3 on v5p-16
    (2 hosts, fsdp 8): with a chip just large enough for the compiled train step (scratch included) plus an
    engine on one host (its own copy of the weights), one host; a byte less, both hosts (the engine reads
    the trainer's weights in place). The run's micro-batch is the whole batch, as chosen at its startup
    (`report.startup_micro_batch`, passed on by `placement.engine_group`): on a chip this tight the search
    (`jaxrl.compile.micro_batch`) takes a smaller one, since the engine's own programs do not fit beside it
    either. One process, or no accelerator memory (CPU): one host, nothing compiled."""
    import math

    from jaxrl.compile import programs, report
    from jaxrl.compile.fit import FIT_SHARE
    from jaxrl.parallel import distributed

    cfg, mcfg, mesh = _tiny_on_v5p_16(tiny_model_dir)
    shapes = dataclasses.replace(report.shapes_of(cfg, mcfg), micro_batch_size=16)  # the whole batch: what fits
    train = programs.compile_train(shapes, mesh)
    assert train.temp > 0
    trainer = sum(train.declared.values()) + train.output - train.alias + train.temp  # the donated state once
    one = trainer + programs.engine_declared_bytes(shapes, programs.engine_mesh(mesh, 1), True)
    both = trainer + programs.engine_declared_bytes(shapes, mesh, False)
    assert both < one
    hbm = math.ceil(one / FIT_SHARE)

    def fit(chip_bytes: int) -> int:
        return report.run_engine_hosts(cfg, mcfg, mesh, chip_bytes, micro_batch_size=16)

    assert distributed.engine_hosts(0, 2, hbm, fit) == 1
    assert distributed.engine_hosts(0, 2, hbm - 1, fit) == 2
    assert distributed.engine_hosts(0, 2, None, fit) == distributed.engine_hosts(0, 1, hbm - 1, fit) == 1
    assert distributed.engine_hosts(2, 2, None, fit) == 2
    with pytest.raises(ValueError, match="engine_hosts = 3 does not divide the 2 processes"):
        distributed.engine_hosts(3, 2, None, fit)


def test_the_micro_batch_search_judges_the_whole_program_set(tiny_model_dir):
    """With no [jax] micro_batch_size, `jaxrl compile` (and a run on accelerators) takes the largest
    micro-batch whose whole program set fits (`jaxrl.compile.micro_batch`): the train step beside the engine's
    compiled prefill and decode step (their scratch, the prefill's outputs, the decode's slot state) and its
    KV cache, the report's total. Until 2026-11-27 the train step was set beside the KV cache alone (issue 43:
    Qwen3-30B-A3B at 32,768 on v5p-16 was then over). The tiny Qwen3 on v5litepod-4 (fsdp 4), 16 rows of 128
    tokens, 256 decode slots (the decode step's [slots, vocabulary] logits and masks: 97 MB a chip of scratch
    and slot state before the TPU sampler's top_k of 75c0662, more since), on a chip whose usable HBM is
    exactly the whole program set at one sequence a chip (4): the old rule, beside the KV cache alone, takes
    the whole batch (16 in one pass), whose report (its micro-batch set) is over and names the micro-batch
    as the cure; the search takes 4 (8 is over too), whose report fits. Twelve compiles of the tiny programs."""
    import math

    from jaxrl.compile import fit, micro_batch, programs, report
    from jaxrl.config.schema import RunConfig
    from jaxrl.model import hf
    from jaxrl.parallel.sharding import make_mesh

    cfg = RunConfig.model_validate({"model": "tiny", "batch_size": 16, "rollouts_per_example": 4,
                                    "env": [{"id": "a/b"}], "jax": {"model_path": str(tiny_model_dir), "seq_len": 128,
                                                                    "decode_slots": 256, "dtype": "bfloat16",
                                                                    "mesh": {"fsdp": 4}}})
    mcfg = hf.load_config(str(tiny_model_dir))
    shapes, layers = report.shapes_of(cfg, mcfg), mcfg.num_layers
    v5e = slices.parse_slice("v5litepod-4")
    mesh = make_mesh({"fsdp": 4}, slices.topology_devices(v5e))
    train = {m: fit.at_depth({layers: programs.compile_train(dataclasses.replace(shapes, micro_batch_size=m), mesh)},
                             (layers,), layers) for m in (4, 16)}
    usable = micro_batch.engine_side(shapes, mesh, (layers,)).total(train[4])
    # the old rule: the train step, scratch included, beside the engine's KV cache on every host (the dense
    # cache's bytes, what it set aside for the pool), the whole batch tried first: it takes 16
    assert fit.trainer_bytes(train[16]) + programs.engine_declared_bytes(shapes, mesh, own_weights=False) <= usable
    tight = dataclasses.replace(v5e, chip=dataclasses.replace(v5e.chip, hbm_bytes=math.ceil(usable / fit.FIT_SHARE)))

    old = report.compile_report(mcfg, {"fsdp": 4}, tight, dataclasses.replace(shapes, micro_batch_size=16))
    print(old.text(), "\n")  # the reports, for `pytest -s`
    verdict = next(line for line in old.text().splitlines() if line.lstrip().startswith("total"))
    assert not old.fits and old.total > usable, old.text()
    assert "does NOT fit" in verdict and report.SMALLER_MICRO_BATCH in verdict  # set above one a chip: the cure
    new = report.compile_report(mcfg, {"fsdp": 4}, tight, shapes)
    print(new.text())
    assert (new.shapes.micro_batch_size, new.micro_batch_from) == (4, "the largest that fits (compiled)")
    assert new.fits and new.total <= fit.FIT_SHARE * tight.chip.hbm_bytes, new.text()


def test_compile_picks_the_fewest_engine_hosts_that_fit_beside_the_compiled_train_step():
    """Without --engine-hosts, `jaxrl compile` sets the compiled train step's bytes a chip (scratch included)
    beside the engine's declared shards on each candidate engine mesh (replication included): Qwen3-235B-A22B
    on v5p-128 with a trainer of 51.1 GiB a chip (its compiled train step: 8.48 weights, 3.32 LoRA + Adam,
    39.3 temporaries) needs the engine on 8 hosts (20.76 GiB a chip: 17.82 weights, 2.94 cache, as the
    compiled decode step declared them), where arithmetic on the weights and cache alone said 2 (it compiled to
    127.79 GiB a chip); 4 hosts would do beside a 40 GiB trainer; all 16 when nothing fits. On v5p-64 an engine on all
    8 hosts reads the trainer's weights: only its cache is added. No compiling."""
    from jaxrl.compile import programs, report
    from jaxrl.config.schema import RunConfig
    from jaxrl.parallel.sharding import make_mesh

    gib = 2**30

    def setup(slice_name: str, mesh: dict):
        cfg = RunConfig.model_validate({"model": "Qwen/Qwen3-235B-A22B-Instruct-2507", "batch_size": 256,
                                        "rollouts_per_example": 8, "env": [{"id": "a/b"}],
                                        "jax": {"mesh": mesh, "dtype": "bfloat16", "decode_slots": 128}})
        s = slices.parse_slice(slice_name)
        return report.shapes_of(cfg, report.model_of(cfg)), make_mesh(mesh, slices.topology_devices(s)), s.chip

    shapes, mesh, chip = setup("v5p-128", {"fsdp": 4, "tensor": 2, "expert": 8})
    assert programs.engine_declared_bytes(shapes, programs.engine_mesh(mesh, 8), True) / gib == \
        pytest.approx(17.82 + 2.94, abs=0.01)
    assert report.compiled_engine_hosts(shapes, mesh, chip.hbm_bytes, int(51.1 * gib)) == 8
    assert report.compiled_engine_hosts(shapes, mesh, chip.hbm_bytes, 40 * gib) == 4
    assert report.compiled_engine_hosts(shapes, mesh, chip.hbm_bytes, 90 * gib) == 16
    shapes, mesh, chip = setup("v5p-64", {"fsdp": 2, "tensor": 2, "expert": 8})
    assert programs.engine_declared_bytes(shapes, mesh, False) / gib == pytest.approx(2.94, abs=0.01)
    assert report.compiled_engine_hosts(shapes, mesh, chip.hbm_bytes, 63 * gib) == 8


def test_cpu_only_choices_follow_the_mesh_not_the_host():
    """The mesh's devices decide what is done on CPU only, not the host compiling for them (a CPU here): the
    train head visits the vocabulary in cache-sized blocks (and chunks as many tokens as the hidden size) on
    CPU only, and a TPU mesh (where the vocabulary axis may be sharded over `tensor`, and slicing it in a loop
    would gather it) gets one block, one matmul; the engine's weight copies and blocked sampler (measured on
    CPU) are off on a TPU mesh, and its sampler searches with `lax.top_k`."""
    import jax

    from jaxrl.inference.cpu import CpuWeights
    from jaxrl.inference.engine import Engine
    from jaxrl.inference.engine_params import PlainWeights
    from jaxrl.kv.chunked import Chunked
    from jaxrl.kv.paged import Paged
    from jaxrl.model import head
    from jaxrl.model.config import ModelConfig
    from jaxrl.model.kernels import Search
    from jaxrl.parallel.sharding import make_mesh, mesh_platform
    from jaxrl.rl import cpu

    tpu = make_mesh({"fsdp": 4}, slices.topology_devices(slices.parse_slice("v5litepod-4")))
    on_cpu = make_mesh({}, jax.devices()[:1])
    assert (mesh_platform(on_cpu), mesh_platform(tpu), jax.default_backend()) == ("cpu", "tpu", "cpu")
    qwen = ModelConfig(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128)
    assert cpu.tuning(on_cpu, qwen).head_block == cpu.HEAD_BLOCK < 151_936
    assert cpu.tuning(tpu, qwen) == cpu.Tuning.plain(qwen) == cpu.Tuning(True, head.TOKENS_PER_CHUNK, 151_936)
    # and in chunks of at least as many tokens as the hidden size and 256 a MiB of L2 (256 to 1024) on CPU,
    # of the default elsewhere (a chunk's logits there span the whole vocabulary)
    mib, d64 = 2**20, dataclasses.replace(qwen, hidden_size=64)
    assert cpu.cpu_tuning(qwen, mib).head_chunk == 1024 and cpu.cpu_tuning(d64, mib).head_chunk == 256
    assert [cpu.cpu_tuning(dataclasses.replace(qwen, hidden_size=256), n * mib).head_chunk
            for n in (2, 4, 32)] == [512, 1024, 1024]
    assert cpu.cpu_tuning(d64, 0).head_chunk == head.TOKENS_PER_CHUNK == 256
    assert cpu.l2_bytes() is None or cpu.l2_bytes() >= 256 * 2**10  # this machine's, from sysfs
    # a shallow stack unrolled on CPU only
    four = dataclasses.replace(qwen, num_layers=4)
    assert (cpu.cpu_tuning(qwen).scan_layers, cpu.cpu_tuning(four).scan_layers) == (True, False)
    assert cpu.tuning(tpu, four).scan_layers
    small = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16)
    on_cpu, on_tpu = Engine(small, on_cpu, 16, 64), Engine(small, tpu, 16, 64)
    assert isinstance(on_cpu.kv, Chunked) and isinstance(on_cpu.weights, CpuWeights) and on_cpu.weights.blocked_sampling
    # and on an accelerator no [jax] kv_cache_tokens is the paged pool (`jaxrl.compile.pool.sized` sizes a
    # run's), at most every slot's 64 positions in pages of 16, and the scratch page
    assert isinstance(on_tpu.kv, Paged) and isinstance(on_tpu.weights, PlainWeights)
    assert on_tpu.weights.reads_training_weights and on_tpu.pages.num_pages == 16 * 64 // 16 + 1
    # the sampler's threshold search too: the TPU program `jaxrl compile` traces here runs `lax.top_k`
    assert (on_cpu.search, on_tpu.search) == (Search.BISECT, Search.TOP_K)


def test_a_run_on_accelerator_hosts_compiles_to_choose_its_engine_group(tiny_model_dir, monkeypatch):
    """The runner's side of the rule (`placement.engine_group`): with `engine_hosts = 0`, two processes and a
    chip memory figure (a TPU slice's, stood in for here: this machine has one process and no accelerator)
    it says it compiles, and the group is the compiled rule's (`report.run_engine_hosts`); a train step
    the compiler refuses is a config error naming `jax.mesh`."""
    import io

    import jax
    from rich.console import Console

    from jaxrl.compile import programs, report
    from jaxrl.config.schema import ConfigError
    from jaxrl.parallel import distributed
    from jaxrl.run import placement

    cfg, mcfg, mesh = _tiny_on_v5p_16(tiny_model_dir)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "chip_memory", lambda: 1 << 20)  # 1 MiB a chip: nothing fits one host
    rule, answers = report.run_engine_hosts, []
    monkeypatch.setattr(report, "run_engine_hosts", lambda *args: answers.append(rule(*args)) or answers[-1])
    out = io.StringIO()
    assert placement.engine_group(cfg, mcfg, mesh, Console(file=out)) == range(0, 2)
    assert "engine_hosts = 0: compiling the train step" in out.getvalue()
    assert answers == [2]  # the compiled rule's own answer, asked once (its compiles are not repeated here)

    def refused(*args):
        raise programs.ProgramTooLarge("train step: 9 GiB of 1 MiB")

    monkeypatch.setattr(report, "run_engine_hosts", refused)
    with pytest.raises(ConfigError, match="jax.mesh.*the train step does not fit: train step: 9 GiB"):
        placement.engine_group(cfg, mcfg, mesh, Console(file=io.StringIO()))


def test_an_in_process_teacher_is_a_term_of_its_own(tmp_path, tiny_model_dir):
    """`[jax.teacher] model` (issue 42): the train step takes the teacher's weights, in `[jax] dtype` at the
    teacher's own depth and sharded by the student's rules, beside its own; `jaxrl compile` reports them as
    the `teacher` term, the compiled arguments grow by them (plus tile padding under 1 MiB), and every other
    term but the step's scratch and outputs is as without a teacher."""
    from typer.testing import CliRunner

    from jaxrl.cli.main import app
    from jaxrl.compile import programs, report
    from jaxrl.config.schema import load_config
    from jaxrl.model import assets, hf
    from jaxrl.parallel.sharding import make_mesh

    teacher = assets.build_tiny_model(tmp_path / "teacher", seed=1, layers=3, hidden=96, mlp=256)
    text = (f'model = "tiny"\nbatch_size = 16\nrollouts_per_example = 4\n[[env]]\nid = "a/b"\n'
            f'[jax]\nmodel_path = "{tiny_model_dir}"\nseq_len = 128\ndecode_slots = 8\nmicro_batch_size = 16\n'
            f'dtype = "bfloat16"\nmesh = {{ fsdp = 4 }}\n')
    (tmp_path / "plain.toml").write_text(text)
    (tmp_path / "taught.toml").write_text(text + f'[jax.loss]\nteacher_tau = 1.0\n[jax.teacher]\nmodel = "{teacher}"\n')
    runner, out, printed = CliRunner(), {}, {}
    for name in ("plain", "taught"):
        done = runner.invoke(app, ["compile", str(tmp_path / f"{name}.toml"), "--topology", "v5litepod-4", "--no-cost",
                                   "--no-context", "--json", str(tmp_path / f"{name}.json")])
        assert done.exit_code == 0, done.output
        out[name], printed[name] = json.loads((tmp_path / f"{name}.json").read_text()), done.output
    tcfg = hf.load_config(str(teacher))
    mesh = make_mesh({"fsdp": 4}, slices.topology_devices(slices.parse_slice("v5litepod-4")))
    import jax.numpy as jnp

    from jaxrl.model.modules import param_specs

    expected = programs.shard_bytes(programs.abstract_params(param_specs(tcfg), tcfg.dims(), mesh, jnp.bfloat16))
    on, off = out["taught"]["bytes_per_chip"], out["plain"]["bytes_per_chip"]
    train = f"train@{out['plain']['model_layers']}"
    assert off["teacher"] == 0 and on["teacher"] == expected == out["taught"]["programs"][train]["declared"]["teacher"]
    grew = out["taught"]["programs"][train]["argument"] - out["plain"]["programs"][train]["argument"]
    assert 0 <= grew - expected < 2**20 and "  teacher" in printed["taught"]
    same = [t for t in report.TERMS if t not in ("teacher", "temporaries", "lora_optimizer")]
    assert {t: on[t] for t in same} == {t: off[t] for t in same}
    assert report.teacher_model_of(load_config(tmp_path / "taught.toml")) == tcfg
