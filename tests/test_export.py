"""Export to Hugging Face, checked against the real consumers: a merged checkpoint loaded by transformers'
Qwen3ForCausalLM / Qwen3MoeForCausalLM / Glm4MoeForCausalLM and a PEFT adapter loaded by `peft.PeftModel` onto the
transformers base must give jaxrl's logits with the LoRA on, at 1e-4 in fp32; the adapter reads back
into the same LoRA; `jaxrl export` on a run folder and on a checkpoint folder; `[adapters]` exports (a real
run's adapters against `jaxrl export --adapter`: tests/test_run.py, in the resume run).

The LoRA is random in both factors (std 0.1, scale 2), not a fresh one (`b` = 0), so a transposed or
misplaced factor moves the logits far beyond the tolerance (each test also checks that it moves them).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
from helpers import finish, read_metrics, start, subprocess_env, write_run_config
from typer.testing import CliRunner

from jaxrl.cli.main import app
from jaxrl.config.schema import load_config
from jaxrl.model import blocks, decoder, hf, hf_lora, modules
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.spec import is_spec
from jaxrl.rl.train import TrainState, make_optimizer
from jaxrl.run import layout
from jaxrl.run.adapters import RunAdapters
from jaxrl.run.checkpoint import Checkpointer
from jaxrl.run.identity import model_identity

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ATOL = 1e-4
VOCAB = 256
TOKENS_BT = np.random.default_rng(2).integers(0, VOCAB, size=(2, 10)).astype(np.int32)
RANK, ALPHA = 4, 8  # lora_scale 2
ALL = tuple(blocks.LORA_TARGETS)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_forward = jax.jit(decoder.forward, static_argnums=0, static_argnames=("scan_layers",))


def _randomize(m, router_std: float = 1.0):
    """Weights of std 0.1, norms near 1, MoE routers of std 1 (decisive top-k, as tests/test_moe.py)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, router_std if name.endswith("mlp.gate.weight") else 0.1)
    return m.eval()


def _dense():
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _randomize(transformers.Qwen3ForCausalLM(cfg))


def _moe(mlp_only_layers=()):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=list(mlp_only_layers), tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=128)
    return _randomize(transformers.Qwen3MoeForCausalLM(cfg))


def _glm():
    """A GLM-4.5 MoE (INTELLECT-3's architecture): q/k/v biases, half-RoPE, a dense first layer, then 4
    sigmoid-routed experts (top 2, routed scaling 2.5) and a shared expert."""
    cfg = transformers.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True,
        tie_word_embeddings=False, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    return _randomize(transformers.Glm4MoeForCausalLM(cfg))


BASES = {"dense": _dense, "moe": _moe, "moe-mixed": lambda: _moe(mlp_only_layers=[1]), "glm": _glm}


@pytest.fixture(scope="module", params=list(BASES))
def base(request, tmp_path_factory) -> Path:
    """A transformers-written base checkpoint folder."""
    folder = tmp_path_factory.mktemp(request.param)
    BASES[request.param]().save_pretrained(folder)
    return folder


def _random_lora(cfg: ModelConfig, targets=ALL, seed: int = 1) -> blocks.Params:
    specs = modules.lora_specs(cfg, RANK, targets)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    rng = np.random.default_rng(seed)
    dims = {**cfg.dims(), "R": RANK}
    return jax.tree.unflatten(treedef, [jnp.asarray(0.1 * rng.standard_normal(s.shape(dims)), jnp.float32)
                                        for s in leaves])


def _jax_logits(cfg, params, lora=None) -> np.ndarray:
    positions_BT = np.broadcast_to(np.arange(TOKENS_BT.shape[1], dtype=np.int32), TOKENS_BT.shape)
    hidden_BTD, _ = _forward(cfg, params, jnp.asarray(TOKENS_BT), jnp.asarray(positions_BT), lora=lora,
                             lora_scale=ALPHA / RANK, scan_layers=not cfg.is_moe)
    return np.asarray(decoder.logits(params, hidden_BTD))


def _torch_logits(m) -> np.ndarray:
    with torch.no_grad():
        return m(torch.from_numpy(TOKENS_BT.astype(np.int64))).logits.float().numpy()


def _hf_class(cfg: ModelConfig):
    """The transformers class of `cfg`'s family (the architecture its config.json names)."""
    return getattr(transformers, cfg.to_hf()["architectures"][0])


@pytest.fixture(scope="module")
def trained(base):
    """(cfg, params, lora, jaxrl logits with the LoRA). Each group of the LoRA (attention, dense MLPs,
    experts) on its own moves the logits well past ATOL, so an export that drops one cannot pass."""
    cfg, params = hf.load_hf(base)
    lora = _random_lora(cfg)
    want = _jax_logits(cfg, params, lora)
    assert set(lora) == {"layers"} | ({"moe"} if cfg.moe_layers else set()) | ({"mlp"} if cfg.mlp_layers else set())
    for group in lora:
        without = {g: v for g, v in lora.items() if g != group}
        assert np.max(np.abs(want - _jax_logits(cfg, params, without))) > 100 * ATOL, group
    return cfg, params, lora, want


@pytest.mark.numerics
def test_merged_loads_in_transformers_with_the_lora_logits(base, trained, tmp_path):
    cfg, params, lora, want = trained
    np.testing.assert_allclose(_jax_logits(cfg, hf_lora.merge_lora(cfg, params, lora, ALPHA / RANK)), want,
                               atol=ATOL, rtol=0)
    hf_lora.save_merged(tmp_path, cfg, params, lora, ALPHA / RANK)
    m, info = _hf_class(cfg).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    np.testing.assert_allclose(_torch_logits(m.eval()), want, atol=ATOL, rtol=0)


@pytest.mark.numerics
def test_adapter_loads_in_peft_with_the_lora_logits_and_reads_back(base, trained, tmp_path):
    cfg, params, lora, want = trained
    targets = ALL
    if cfg.is_moe and cfg.mlp_layers:  # peft cannot load MLP LoRA beside experts (see the test below)
        targets, lora = ATTENTION, {"layers": lora["layers"]}
        want = _jax_logits(cfg, params, lora)
    hf_lora.save_adapter(tmp_path, cfg, lora, rank=RANK, alpha=ALPHA, targets=targets,
                        base_model_name_or_path=str(base))
    conf = json.loads((tmp_path / hf_lora.ADAPTER_CONFIG).read_text())
    assert (conf["r"], conf["lora_alpha"], sorted(conf["target_modules"])) == (RANK, ALPHA, sorted(targets))
    m = peft.PeftModel.from_pretrained(_hf_class(cfg).from_pretrained(base), tmp_path).eval()
    np.testing.assert_allclose(_torch_logits(m), want, atol=ATOL, rtol=0)

    back = hf_lora.load_adapter(tmp_path, cfg)
    assert (back.rank, back.lora_scale, back.targets, back.base_model_name_or_path) == (
        RANK, ALPHA / RANK, tuple(sorted(targets)), str(base))
    assert jax.tree.structure(back.lora) == jax.tree.structure(lora)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back.lora, lora)


@pytest.mark.numerics
def test_adapter_of_some_targets_matches_peft(tmp_path):
    """An attention-only LoRA (q, v) on the dense model: no MLP modules in the adapter, peft agrees."""
    folder = tmp_path / "base"
    _dense().save_pretrained(folder)
    cfg, params = hf.load_hf(folder)
    targets = ("q_proj", "v_proj")
    lora = _random_lora(cfg, targets)
    hf_lora.save_adapter(tmp_path / "a", cfg, lora, rank=RANK, alpha=ALPHA, targets=targets,
                        base_model_name_or_path="x")
    m = peft.PeftModel.from_pretrained(transformers.Qwen3ForCausalLM.from_pretrained(folder), tmp_path / "a")
    np.testing.assert_allclose(_torch_logits(m.eval()), _jax_logits(cfg, params, lora), atol=ATOL, rtol=0)
    assert list(hf_lora.load_adapter(tmp_path / "a", cfg).lora["layers"]) == ["wq", "wv"]


def test_adapter_refuses_what_peft_cannot_load(tmp_path):
    mixed = tmp_path / "mixed"
    _moe(mlp_only_layers=[1]).save_pretrained(mixed)
    cfg = hf.load_config(mixed)
    with pytest.raises(ValueError, match="dense-MLP layers"):
        hf_lora.save_adapter(tmp_path / "a", cfg, _random_lora(cfg), rank=RANK, alpha=ALPHA, targets=ALL,
                            base_model_name_or_path="x")
    half = ("q_proj", "gate_proj")
    with pytest.raises(ValueError, match="only one of gate_proj and up_proj"):
        hf_lora.save_adapter(tmp_path / "b", cfg, _random_lora(cfg, half), rank=RANK, alpha=ALPHA, targets=half,
                            base_model_name_or_path="x")
    with pytest.raises(ValueError, match="targets"):
        hf_lora.save_adapter(tmp_path / "c", cfg, _random_lora(cfg, ("q_proj",)), rank=RANK, alpha=ALPHA,
                            targets=("k_proj",), base_model_name_or_path="x")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize(("change", "message"), [
    ({"use_dora": True}, "use_dora = True"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"target_modules": "all-linear"}, "target_modules = 'all-linear'"),
    ({"target_modules": ["q_proj", "lm_head"]}, "are not projections jaxrl adapts"),
])
def test_load_adapter_refuses_what_jaxrl_cannot_run(tmp_path, change, message):
    folder = tmp_path / "base"
    _dense().save_pretrained(folder)
    cfg = hf.load_config(folder)
    hf_lora.save_adapter(tmp_path / "a", cfg, _random_lora(cfg, ("q_proj",)), rank=RANK, alpha=ALPHA,
                        targets=("q_proj",), base_model_name_or_path="x")
    conf_path = tmp_path / "a" / hf_lora.ADAPTER_CONFIG
    conf_path.write_text(json.dumps(json.loads(conf_path.read_text()) | change))
    with pytest.raises(ValueError, match=message):
        hf_lora.load_adapter(tmp_path / "a", cfg)


# --- `jaxrl export` on a run's checkpoint -------------------------------------------------------------

RUN_TOML = """
name = "exp"
model = "jaxrl/qwen3-test"
max_steps = 2
batch_size = 8
rollouts_per_example = 4
lora_alpha = {alpha}

[sampling]
max_tokens = 8

[[env]]
id = "jaxrl/lowercase"

[jax]
model_path = "{model}"
output_dir = "{runs}"
lora_rank = {rank}
"""


@pytest.fixture(scope="module")
def run_with_checkpoint(tmp_path_factory):
    """A run folder as `jaxrl run` leaves it (run_config.json, checkpoints/2) holding a random LoRA; the base
    folder has a generation config, the tokenizer folder beside it a tokenizer file."""
    tmp = tmp_path_factory.mktemp("run")
    m = _dense()
    m.save_pretrained(tmp / "base")
    (tmp / "base" / "generation_config.json").write_text('{"temperature": 0.25}')
    (tmp / "tok").mkdir()
    (tmp / "tok" / "tokenizer.json").write_text("{}")
    toml = tmp / "rl.toml"
    toml.write_text(RUN_TOML.format(model=tmp / "base", runs=tmp / "runs", alpha=ALPHA, rank=RANK)
                    + f'tokenizer_path = "{tmp / "tok"}"\n')
    cfg = load_config(toml)
    run_dir = tmp / "runs" / "exp"
    run_dir.mkdir(parents=True)
    layout.write_run_config(run_dir, cfg)
    mcfg, params = hf.load_hf(tmp / "base")
    lora = _random_lora(mcfg)
    _save_checkpoint(str(run_dir / "checkpoints"), 2, mcfg, params, lora)
    return run_dir, toml, _jax_logits(mcfg, params, lora), mcfg, lora


def _save_checkpoint(directory: str, step: int, mcfg, params, lora) -> None:
    """Checkpoint `step` in `directory` as `jaxrl run` writes it (state, meta with the identity)."""
    opt_state = make_optimizer(1e-3).init({"base": params, "lora": lora})
    identity = model_identity("jaxrl/qwen3-test", dataclasses.asdict(mcfg), RANK, ALL)
    ckpt = Checkpointer(directory)
    ckpt.save(step, TrainState(lora, opt_state, jnp.asarray(step, jnp.int32)), {"step": step, "identity": identity})
    ckpt.wait()
    ckpt.close()


def _export(*args):
    return CliRunner().invoke(app, ["export", *map(str, args)])


def test_cli_exports_a_run_folder_merged(run_with_checkpoint, tmp_path):
    run_dir, _, want, _, _ = run_with_checkpoint
    result = _export(run_dir, "--out", tmp_path / "merged", "--merged")
    assert result.exit_code == 0, result.output
    assert "merged model of checkpoint step 2" in result.stdout
    m = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(_torch_logits(m), want, atol=ATOL, rtol=0)
    assert (tmp_path / "merged" / "tokenizer.json").read_text() == "{}"
    assert (tmp_path / "merged" / "generation_config.json").read_text() == '{"temperature": 0.25}'


def test_cli_exports_a_checkpoint_step_as_an_adapter(run_with_checkpoint, tmp_path):
    run_dir, _, want, mcfg, lora = run_with_checkpoint
    result = _export(run_dir / "checkpoints" / "2", "--out", tmp_path / "adapter", "--adapter")
    assert result.exit_code == 0, result.output
    assert "PEFT adapter of checkpoint step 2" in result.stdout
    conf = json.loads((tmp_path / "adapter" / hf_lora.ADAPTER_CONFIG).read_text())
    assert conf["base_model_name_or_path"] == "jaxrl/qwen3-test"
    base = transformers.Qwen3ForCausalLM.from_pretrained(run_dir.parent.parent / "base")
    m = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(_torch_logits(m), want, atol=ATOL, rtol=0)
    back = hf_lora.load_adapter(tmp_path / "adapter", mcfg).lora
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, lora)


def test_cli_takes_the_toml_for_a_checkpoints_folder_without_run_config(run_with_checkpoint, tmp_path):
    run_dir, toml, _, mcfg, lora = run_with_checkpoint
    moved = tmp_path / "elsewhere"
    shutil.copytree(run_dir / "checkpoints", moved)
    result = _export(moved, "--out", tmp_path / "a", "--adapter")
    assert result.exit_code == 2 and "pass the run's TOML with --config" in result.stderr
    result = _export(moved, "--out", tmp_path / "a", "--adapter", "--config", toml, "--step", 2)
    assert result.exit_code == 0, result.output
    back = hf_lora.load_adapter(tmp_path / "a", mcfg).lora
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, lora)


def test_cli_exports_a_gcs_checkpoint_with_its_toml(run_with_checkpoint, tmp_path, gcs):
    run_dir, toml, want, mcfg, lora = run_with_checkpoint
    url = "gs://jaxrl-test/export-test/exp"
    _save_checkpoint(url, 3, mcfg, hf.load_hf(run_dir.parent.parent / "base")[1], lora)
    result = _export(f"{url}/3", "--out", tmp_path / "o")
    assert result.exit_code == 2 and "a gs:// checkpoint has no run config" in result.stderr, result.output
    result = _export(f"{url}/3", "--out", tmp_path / "o", "--config", toml)
    assert result.exit_code == 0, result.output
    assert f"merged model of checkpoint step 3 ({url})" in result.stdout
    m = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "o").eval()
    np.testing.assert_allclose(_torch_logits(m), want, atol=ATOL, rtol=0)


def test_cli_errors_without_traceback_in_a_fresh_process(tmp_path):
    """As a shell runs it (CliRunner would hide a traceback): exit 2 and one line on stderr."""
    code = "from jaxrl.cli.main import app; app(prog_name='jaxrl')"
    for args, message in [([tmp_path / "nowhere", "--out", tmp_path / "o"], "is not a folder"),
                          ([tmp_path, "--out", tmp_path / "o", "--merged", "--adapter"], "not both")]:
        out = subprocess.run([sys.executable, "-c", code, "export", *map(str, args)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr + out.stdout and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["{tmp}/nowhere", "--out", "{tmp}/o"], "nowhere is not a folder (expected a run folder"),
    (["{run}", "--out", "{tmp}/o", "--merged", "--adapter"], "pass --merged or --adapter, not both"),
    (["{run}", "--out", "{tmp}/o", "--step", "5"], "no checkpoint for step 5 in"),
    (["{run}/checkpoints/2", "--out", "{tmp}/o", "--step", "3"], "is step 2, but --step 3 was given"),
])
def test_cli_errors_are_one_clear_line(run_with_checkpoint, tmp_path, args, message):
    run_dir = run_with_checkpoint[0]
    result = _export(*[a.format(tmp=tmp_path, run=run_dir) for a in args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_cli_errors_for_an_unwritable_out_or_another_lora(run_with_checkpoint, tmp_path):
    run_dir, toml, _, _, _ = run_with_checkpoint
    (tmp_path / "file").write_text("")
    result = _export(run_dir, "--out", tmp_path / "file", "--adapter")
    assert result.exit_code == 2 and f"cannot write {tmp_path / 'file'}" in result.stderr, result.output
    other = tmp_path / "rank8.toml"
    other.write_text(toml.read_text().replace(f"lora_rank = {RANK}", "lora_rank = 8"))
    result = _export(run_dir / "checkpoints", "--out", tmp_path / "o", "--config", other)
    assert result.exit_code == 2, result.output
    assert "is not of this run's model or LoRA: lora_rank: checkpoint 4, this run 8" in result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()


# --- where `jaxrl export` writes: a new or empty folder, an earlier export with --force, never the base --------

def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line_refusal(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def test_cli_export_never_writes_over_files_it_did_not_write(run_with_checkpoint, tmp_path):
    """A user's own model folder (config.json, model.safetensors) is refused with and without --force, and left as
    it was; so is a folder holding any file; an empty folder is written."""
    run_dir = run_with_checkpoint[0]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    (mine / "model.safetensors").write_bytes(b"my weights")
    before = _snapshot(mine)
    for force in ([], ["--force"]):
        for kind in ("--merged", "--adapter"):
            _one_line_refusal(_export(run_dir, "--out", mine, kind, *force), f"{mine} is not empty and holds files "
                              "jaxrl export did not write (config.json, model.safetensors)", "choose another --out")
    assert _snapshot(mine) == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    (tmp_path / "empty").mkdir()
    assert _export(run_dir, "--out", tmp_path / "empty").exit_code == 0
    manifest = json.loads((tmp_path / "empty" / ".jaxrl-export.json").read_text())
    assert manifest["kind"] == "merged" and manifest["step"] == 2
    assert sorted(manifest["files"]) == sorted(p.name for p in (tmp_path / "empty").iterdir() if p.name[0] != ".")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(manifest["files"])


def test_cli_export_force_replaces_only_an_earlier_export_of_its_kind(run_with_checkpoint, tmp_path):
    run_dir = run_with_checkpoint[0]
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert _export(run_dir, "--out", merged).exit_code == 0
    assert _export(run_dir, "--out", adapter, "--adapter").exit_code == 0
    _one_line_refusal(_export(run_dir, "--out", merged), f"{merged} holds an earlier export (step 2 of "
                      f"{run_dir / 'checkpoints'}); pass --force to replace it")
    (merged / "model.safetensors").write_bytes(b"stale")  # as an older export's weights would be
    assert _export(run_dir, "--out", merged, "--force").exit_code == 0
    assert (merged / "model.safetensors").read_bytes() != b"stale"
    _one_line_refusal(_export(run_dir, "--out", merged, "--adapter", "--force"),
                      f"{merged} holds a merged model export and this one is a PEFT adapter", "mix two kinds")
    _one_line_refusal(_export(run_dir, "--out", adapter, "--merged", "--force"),
                      f"{adapter} holds a PEFT adapter export and this one is a merged model")
    (merged / "notes.txt").write_text("my notes")
    before = _snapshot(merged)
    _one_line_refusal(_export(run_dir, "--out", merged, "--force"),
                      f"{merged} holds files jaxrl export did not write (notes.txt); --force replaces only")
    assert _snapshot(merged) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "merged"]  # no temporary folder left


def test_cli_export_never_writes_the_runs_base_model_so_the_lora_is_applied_once(run_with_checkpoint, tmp_path):
    """`--out` at the run's base model folder (the issue's "LoRA applied twice": the next export read the merged
    weights as its base) or tokenizer folder is refused even with --force; exports before and after are the same
    bytes. A base model folder that is itself an export is refused as the base too."""
    run_dir, toml = run_with_checkpoint[:2]
    base, tok = run_dir.parent.parent / "base", run_dir.parent.parent / "tok"
    before = _snapshot(base), _snapshot(tok)
    assert _export(run_dir, "--out", tmp_path / "first").exit_code == 0
    for folder, what in ((base, "the run's base model folder"), (tok, "the run's tokenizer folder")):
        for force in ([], ["--force"]):
            _one_line_refusal(_export(run_dir, "--out", folder, *force), f"{folder} is {what}", "apply the LoRA twice")
    assert (_snapshot(base), _snapshot(tok)) == before
    assert _export(run_dir, "--out", tmp_path / "second").exit_code == 0
    assert _snapshot(tmp_path / "first") == _snapshot(tmp_path / "second")

    on_export = tmp_path / "rl.toml"  # a run trained on the first export
    on_export.write_text(toml.read_text().replace(f'model_path = "{base}"', f'model_path = "{tmp_path / "first"}"'))
    _one_line_refusal(_export(run_dir / "checkpoints", "--config", on_export, "--out", tmp_path / "first", "--force"),
                      f"{tmp_path / 'first'} is the run's base model folder")


def _limited_jaxrl(args: list, *, umask: int = 0o022, file_bytes: int = -1) -> subprocess.CompletedProcess:
    """`jaxrl ARGS` in a fresh process, as a shell runs it, under `umask` and with `file_bytes` the most bytes it
    may write to one file (RLIMIT_FSIZE, with SIGXFSZ ignored: a longer write fails with EFBIG as one on a full
    disk fails with ENOSPC; -1 for no limit), set in the process before jaxrl is imported. Without the session's
    compilation cache, whose writes the limit would refuse."""
    code = (f"import os, resource, signal; os.umask({umask}); signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({file_bytes}, {file_bytes})); "
            "from jaxrl.cli.main import app; app(prog_name='jaxrl')")
    env = {k: v for k, v in subprocess_env().items() if k != "JAX_COMPILATION_CACHE_DIR"}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def test_cli_export_on_a_full_disk_is_one_line_and_leaves_nothing(run_with_checkpoint, tmp_path):
    """A write that fails partway (RLIMIT_FSIZE of 16 KiB: config.json fits, model.safetensors does not) is one
    line, exit 2; neither the new folder nor its missing parents are left, an earlier export is kept whole."""
    run_dir = run_with_checkpoint[0]
    assert _export(run_dir, "--out", tmp_path / "earlier").exit_code == 0
    earlier = _snapshot(tmp_path / "earlier")
    for out, force in ((tmp_path / "new" / "deeper" / "out", []), (tmp_path / "earlier", ["--force"])):
        result = _limited_jaxrl(["export", run_dir, "--out", out, *force], file_bytes=16 * 1024)
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr[-3000:]
        assert f"jaxrl export: cannot write {out}: " in result.stderr and "File too large" in result.stderr
        assert "nothing was written" in result.stderr and "Traceback" not in result.stdout + result.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier"]
        assert _snapshot(tmp_path / "earlier") == earlier


def test_cli_export_file_modes_follow_the_umask(run_with_checkpoint, tmp_path):
    """Under umask 027 every file of a merged export (safetensors wrote its weights 0600 before) is 0640 and
    the folder 0750, as `open` and `mkdir` give; an adapter likewise."""
    run_dir = run_with_checkpoint[0]
    for kind in ("--merged", "--adapter"):
        out = tmp_path / kind.strip("-")
        result = _limited_jaxrl(["export", run_dir, "--out", out, kind], umask=0o027)
        assert result.returncode == 0, result.stderr[-3000:]
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
        assert modes and set(modes.values()) == {0o640}, modes
        assert stat.S_IMODE(out.stat().st_mode) == 0o750


# --- `[adapters]`: PEFT folders written during a run --------------------------------------------------

def _run_config(tmp_path: Path, model_dir: Path, adapters: str, checkpoint_dir: str | None = None):
    toml = tmp_path / "rl.toml"
    text = RUN_TOML.format(model=model_dir, runs=tmp_path / "runs", alpha=ALPHA, rank=RANK).replace(
        "max_steps = 2", "max_steps = 7")
    if checkpoint_dir:
        text += f'checkpoint_dir = "{checkpoint_dir}"\n'
    toml.write_text(text + adapters)
    return load_config(toml)


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_run_adapters_interval_and_keep_last(tmp_path, where, request):
    """interval 2, keep_last 2 over 7 steps: written after steps 2, 4, 6 and 7 (the last), 6 and 7 kept;
    each reads back as the LoRA of its step. On gs:// they live beside Orbax's step folders."""
    folder = tmp_path / "base"
    _dense().save_pretrained(folder)
    mcfg = hf.load_config(folder)
    ckpt_dir = None
    if where == "gcs":
        request.getfixturevalue("gcs")
        ckpt_dir = "gs://jaxrl-test/adapters-test"
    cfg = _run_config(tmp_path, folder, "[adapters]\ninterval = 2\nkeep_last = 2\n", ckpt_dir)
    directory = layout.adapters_dir_of(cfg)
    assert directory == (f"{ckpt_dir}/exp/adapters" if ckpt_dir else str(tmp_path / "runs" / "exp" / "adapters"))
    adapters = RunAdapters(cfg, mcfg, directory)
    ckpt = Checkpointer(ckpt_dir, keep=1) if ckpt_dir else None
    loras = {}
    for step in range(1, 8):
        loras[step] = _random_lora(mcfg, seed=step)
        written = adapters.after_step(step, loras[step])
        assert (written is not None) == (step in (2, 4, 6, 7))
        if ckpt:
            ckpt.save(step, TrainState(loras[step], {}, jnp.asarray(step, jnp.int32)), {"step": step})
    assert adapters.steps() == [6, 7]
    for step in (6, 7):
        back = hf_lora.load_adapter(f"{directory}/step_{step}", mcfg)
        assert back.base_model_name_or_path == "jaxrl/qwen3-test" and back.lora_scale == ALPHA / RANK
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back.lora,
                     loras[step])
    if ckpt:
        ckpt.wait()
        assert ckpt.all_steps() == [7]
        ckpt.close()
    assert sorted(p.name for p in epath.Path(directory).iterdir()) == ["step_6", "step_7"]


def test_run_adapters_default_is_the_last_step_only_and_keep_all(tmp_path):
    folder = tmp_path / "base"
    _dense().save_pretrained(folder)
    mcfg = hf.load_config(folder)
    default = RunAdapters(_run_config(tmp_path, folder, ""), mcfg, tmp_path / "a")
    assert [s for s in range(1, 8) if default.due(s)] == [7]
    keep_all = RunAdapters(_run_config(tmp_path, folder, "[adapters]\ninterval = 1\nkeep_last = -1\n"),
                                  mcfg, tmp_path / "b")
    for step in range(1, 8):
        keep_all.after_step(step, _random_lora(mcfg, targets=ALL, seed=step))
    assert keep_all.steps() == list(range(1, 8))
    (tmp_path / "b" / "step_3" / hf_lora.ADAPTER_CONFIG).unlink()  # as a crash in a gs:// rename leaves it
    assert keep_all.steps() == [1, 2, 4, 5, 6, 7]


def test_run_adapters_that_cannot_be_written_are_reported_and_the_run_goes_on(tmp_path):
    from rich.console import Console

    folder = tmp_path / "base"
    _dense().save_pretrained(folder)
    mcfg = hf.load_config(folder)
    (tmp_path / "blocked").write_text("a file where the adapters folder should be")
    console = Console(record=True, width=300)
    adapters = RunAdapters(_run_config(tmp_path, folder, "[adapters]\ninterval = 1\n"), mcfg,
                                  tmp_path / "blocked" / "adapters", console)
    assert adapters.after_step(1, _random_lora(mcfg)) is None
    assert f"step 1: PEFT adapter not written to {tmp_path / 'blocked' / 'adapters' / 'step_1'}" in (
        console.export_text())


def test_run_adapters_for_a_lora_peft_cannot_hold(tmp_path):
    """A mixed dense/MoE model with MLP LoRA: a config error when [adapters] is set, else no adapters and
    a message saying why."""
    from rich.console import Console

    from jaxrl.config.schema import ConfigError

    folder = tmp_path / "base"
    _moe(mlp_only_layers=[1]).save_pretrained(folder)
    mcfg = hf.load_config(folder)
    with pytest.raises(ConfigError, match="adapters: a PEFT adapter cannot hold MLP LoRA"):
        RunAdapters(_run_config(tmp_path, folder, "[adapters]\ninterval = 1\n"), mcfg, tmp_path / "a")
    console = Console(record=True, width=300)
    quiet = RunAdapters(_run_config(tmp_path, folder, ""), mcfg, tmp_path / "a", console)
    assert not quiet.enabled and quiet.after_step(7, _random_lora(mcfg)) is None
    assert "no PEFT adapters for this run" in console.export_text() and not (tmp_path / "a").exists()


def test_full_finetuning_run_resumes_and_exports_the_whole_model(tmp_path, tiny_model_dir):
    """A real `jaxrl run` with `[jax] finetune = "full"` and a KL penalty: 2 steps (the engine given the new
    weights after each), then resumed from its checkpoint to 3; the checkpoint holds every weight (moved from
    the model's), no adapter is written, `jaxrl export` writes a model that transformers loads with jaxrl's
    logits of those weights (and refuses an adapter), and `jaxrl serve` serves those weights."""
    from jaxrl.cli import serve
    from jaxrl.export import exporter

    def config(steps):
        path = write_run_config(tmp_path / "rl.toml", tiny_model_dir, name="full", max_steps=steps, learning_rate=1e-3,
                                tables="[buffer]\nskip_verification = true\n",
                                jax_extra='finetune = "full"\n[jax.loss]\nkl_coef = 0.01\n')
        path.write_text(path.read_text().replace("lora_rank = 4\n", ""))
        return path

    run_dir = tmp_path / "runs" / "full"
    for steps in (2, 3):
        code, log = finish(start(config(steps), tmp_path / "run.log"), tmp_path / "run.log")
        assert code == 0, log
    assert "resuming from checkpoint step 2" in log and "PEFT adapters" not in log
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["policy/ref_kl"] == 0 < rows[-1]["policy/ref_kl"]
    # the engine is given the full weights after each step: step 2's rollouts (synchronous) come from step 1's
    # weights, so the engine/trainer mismatch is far below the drift from the start a stale engine would show
    assert rows[1]["policy/kl"] < rows[1]["policy/ref_kl"] / 10, rows
    assert not (run_dir / "adapters").exists()

    source = exporter.find_source(str(run_dir))
    assert (source.step, source.finetune) == (3, "full")
    mcfg, start_weights = hf.load_hf(tiny_model_dir)
    weights = exporter.restore_trained(source, mcfg).base
    moved = jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), np.asarray(b)), start_weights, weights)
    assert all(jax.tree.leaves(moved))
    result = _export(run_dir, "--out", tmp_path / "model")
    assert result.exit_code == 0, result.output
    assert _export(run_dir, "--out", tmp_path / "a", "--adapter").exit_code == 2
    m = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "model").eval()
    np.testing.assert_allclose(_torch_logits(m), _jax_logits(mcfg, weights), atol=ATOL, rtol=0)
    assert (tmp_path / "model" / "tokenizer.json").is_file()
    loaded = serve.load(str(run_dir), decode_slots=2, seq_len=32)  # `jaxrl serve` of the checkpoint
    try:
        assert "full fine-tuning of" in loaded.description
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                     loaded.scheduler.params.base, weights)
    finally:
        loaded.scheduler.stop()
