"""`jaxrl compile`: the run's programs compiled for TPU slices by libtpu's compiler (no TPU attached).

Each case compiles the train step, the largest prefill bucket and the decode step of a Hosted Training
model at two reduced depths (2 and 3 layers) and extrapolates to full depth (`jaxrl.compile.report`);
one test shows that per-chip memory is exactly affine in depth by compiling a third depth. Compiled
results are shared by the session.
"""

import dataclasses
import json
import math

import pytest

from jaxrl.compile import programs, report, slices
from jaxrl.config.schema import RunConfig
from jaxrl.model import catalog
from jaxrl.model.qwen3 import ModelConfig, param_specs
from jaxrl.parallel.sharding import bytes_per_device, make_mesh

DEPTHS = (2, 3)
# (model, slice, mesh, decode_slots, engine hosts) with a Hosted batch: 256 rollouts x 4096 tokens, LoRA r16
CASES = {
    "4b-v6e": ("Qwen/Qwen3-4B-Instruct-2507", "v6e-8", {"fsdp": 2, "tensor": 4}, 128),
    "30b-v5p-1host": ("Qwen/Qwen3-30B-A3B-Instruct-2507", "v5p-8", {"expert": 4}, 256),
    "30b-v5p-2hosts": ("Qwen/Qwen3-30B-A3B-Instruct-2507", "v5p-16", {"fsdp": 2, "expert": 4}, 256),
    "235b-v5p-8hosts": ("Qwen/Qwen3-235B-A22B-Instruct-2507", "v5p-64", {"fsdp": 2, "tensor": 2, "expert": 8}, 128),
}


def run_config(model: str, mesh: dict, slots: int) -> RunConfig:
    return RunConfig.model_validate({
        "model": model, "batch_size": 256, "rollouts_per_example": 8, "lora_alpha": 32, "env": [{"id": "a/b"}],
        "sampling": {"max_tokens": 2048},
        "jax": {"mesh": mesh, "dtype": "bfloat16", "seq_len": 4096, "lora_rank": 16, "decode_slots": slots,
                "remat": True}})


@pytest.fixture(scope="session")
def compiled():
    """case -> Report, compiled once per session on first use."""
    cache = {}

    def get(case):
        if case not in cache:
            model, slice_name, mesh, slots = CASES[case]
            cache[case] = report.compile_run(run_config(model, mesh, slots), slice_name, DEPTHS)
        return cache[case]

    return get


def _check(r: report.Report, model: str):
    """Fits, and the weights the compiler was given per chip are the declared shapes' arithmetic: the
    declared bytes are `bytes_per_device`'s (device-free) count, and the compiler's argument bytes grow
    by exactly the declared bytes per layer and differ from the declared total by under 1 MiB (the few
    per-request scalars, padded to the chip's tiles)."""
    print(r.text())  # the report, for `pytest -s`
    assert r.fits, r.text()
    mcfg = ModelConfig.from_hf(catalog.HOSTED_MODELS[model])
    assert r.terms["weights"] == bytes_per_device(param_specs(mcfg), mcfg.dims(), r.mesh, 2)
    for name in ("train", "prefill", "decode"):
        per_depth = [r.programs[name + "@" + str(d)] for d in DEPTHS]
        declared = [sum(p["declared"].values()) for p in per_depth]
        argument = [p["argument"] for p in per_depth]
        assert argument[1] - argument[0] == declared[1] - declared[0], name
        assert all(0 <= a - d < 2**20 for a, d in zip(argument, declared, strict=True)), (name, argument, declared)
    json.dumps(r.to_json())


def test_qwen3_4b_fits_a_v6e_8(compiled):
    r = compiled("4b-v6e")
    _check(r, CASES["4b-v6e"][0])
    assert (r.hosts, r.engine_hosts, r.terms["engine_weights"]) == (1, 1, 0)  # one host: weights shared


def test_memory_is_affine_in_depth(compiled):
    """Every per-chip byte count of the three programs at depth 4 is exactly where the line through
    depths 2 and 3 puts it: what lets `--depths` extrapolate to 36-94 layers."""
    r = compiled("4b-v6e")
    model, _, mesh_shape, slots = CASES["4b-v6e"]
    cfg = run_config(model, mesh_shape, slots)
    mesh = make_mesh(mesh_shape, slices.topology_devices(r.slice))
    at4 = r.shapes.at_depth(4)
    for name, fn in (("train", programs.compile_train), ("prefill", programs.compile_prefill),
                     ("decode", programs.compile_decode)):
        p2, p3, p4 = r.programs[f"{name}@2"], r.programs[f"{name}@3"], dataclasses.asdict(fn(at4, mesh))
        for field in ("argument", "output", "alias", "temp"):
            assert p4[field] - p3[field] == p3[field] - p2[field], (name, field, p2[field], p3[field], p4[field])
    assert cfg.jax.seq_len == r.shapes.seq_len


def test_qwen3_30b_a3b_fits_one_v5p_host(compiled):
    r = compiled("30b-v5p-1host")
    _check(r, CASES["30b-v5p-1host"][0])
    assert r.hosts == 1 and r.terms["engine_weights"] == 0


def test_qwen3_30b_a3b_fits_two_v5p_hosts(compiled):
    """Two hosts: the trainer's mesh spans both, each host's engine holds a copy of the weights on its
    own 4 chips (counted as engine_weights)."""
    r = compiled("30b-v5p-2hosts")
    _check(r, CASES["30b-v5p-2hosts"][0])
    assert (r.hosts, r.engine_hosts) == (2, 1) and r.terms["engine_weights"] > r.terms["weights"]


def test_qwen3_235b_a22b_fits_v5p_64_with_an_engine_over_hosts(compiled):
    """Qwen3-235B-A22B fits no v5p host (438 GiB of bf16 weights, 4 x 95 GiB): the engine's programs
    are compiled on a mesh over a group of hosts."""
    r = compiled("235b-v5p-8hosts")
    _check(r, CASES["235b-v5p-8hosts"][0])
    assert r.hosts == 8 and 1 < r.engine_hosts < 8
    assert math.prod(r.engine_mesh.values()) == 4 * r.engine_hosts


def test_slice_names():
    assert slices.parse_slice("v5p-64").topology == "v5p:2x4x4"
    assert slices.parse_slice("v4-32").topology == "v4:2x2x4"
    assert slices.parse_slice("v5litepod-16").topology == "v5e:4x4"
    assert slices.parse_slice("v6e-64").topology == "v6e:8x8"
    assert slices.parse_slice("v5p:4x4x4").name == "v5p-128"
    for bad in ("v5p-7", "v7-8", "v6e:4x4x4", "v5litepod-12"):
        with pytest.raises(ValueError, match="expected"):
            slices.parse_slice(bad)
    devices = slices.topology_devices(slices.parse_slice("v5p-64"))
    assert len(devices) == 32 and len({d.process_index for d in devices}) == 8 and devices[0].platform == "tpu"


def test_cli_compiles_a_checkpoint_config_for_a_slice(tmp_path, tiny_model_dir):
    """`jaxrl compile` on a config whose architecture comes from its checkpoint's config.json (the tiny
    Qwen3, full depth): the report on stdout, the JSON file, exit 0 when it fits; a slice name gcloud
    does not know, or a mesh of another size, is an error naming it (exit 2)."""
    from typer.testing import CliRunner

    from jaxrl.cli.main import app

    config = tmp_path / "rl.toml"
    config.write_text(f'model = "tiny"\nbatch_size = 16\nrollouts_per_example = 4\n[[env]]\nid = "a/b"\n'
                      f'[jax]\nmodel_path = "{tiny_model_dir}"\nseq_len = 128\ndecode_slots = 8\n'
                      f'dtype = "bfloat16"\nmesh = {{ fsdp = 4 }}\n')
    runner = CliRunner()
    result = runner.invoke(app, ["compile", str(config), "--topology", "v5litepod-4",
                                 "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "v5litepod-4 (v5e:2x2): 4 chips on 1 hosts" in result.output and "fits" in result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["fits"] and data["chips"] == 4 and data["bytes_per_chip"]["total"] < data["bytes_per_chip"]["hbm"]
    assert data["compiled_depths"] == [data["model_layers"]]
    bad = runner.invoke(app, ["compile", str(config), "--topology", "v5p-7"])
    assert bad.exit_code == 2 and "--topology: slice 'v5p-7'" in bad.output
    wrong = runner.invoke(app, ["compile", str(config), "--topology", "v6e-8"])
    assert wrong.exit_code == 2 and "jax.mesh" in wrong.output and "v6e-8 has 8 chips" in wrong.output
    assert "v5litepod-16" in runner.invoke(app, ["compile", "--help"]).output
