"""Model catalogue: where a model name is found (folder, gs://, local HF cache, else the Hub) and `jaxrl models`."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from jaxrl.cli.main import app
from jaxrl.config import hub, model_path


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def _snapshot(cache, repo_id, rev, *, main=True):
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"")
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    return snap


def test_resolves_folder_gs_and_hf_cache(tmp_path, hf_cache):
    (tmp_path / "local").mkdir()
    assert hub.resolve_model("local", tmp_path) == str((tmp_path / "local").resolve())
    assert hub.resolve_model("gs://b/m", tmp_path) == "gs://b/m"
    _snapshot(hf_cache, "Qwen/Qwen3-4B-Instruct-2507", "aaa", main=False)
    main = _snapshot(hf_cache, "Qwen/Qwen3-4B-Instruct-2507", "bbb")
    assert hub.resolve_model("Qwen/Qwen3-4B-Instruct-2507", tmp_path) == str(main)


def test_missing_model_is_a_hub_download_or_names_the_folder(tmp_path, hf_cache, monkeypatch):
    assert model_path.locate_model("Qwen/Qwen3-30B-A3B-Instruct-2507@v2", tmp_path) == model_path.HubModel(
        "Qwen/Qwen3-30B-A3B-Instruct-2507", "v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(model_path.ModelNotFoundError) as info:
        hub.resolve_model("Qwen/Qwen3-30B-A3B-Instruct-2507", tmp_path)
    assert str(info.value) == (f"model Qwen/Qwen3-30B-A3B-Instruct-2507@main is not in the Hugging Face cache "
                               f"{hf_cache} and HF_HUB_OFFLINE is set, so it is not downloaded (and there is no "
                               f"folder {tmp_path / 'Qwen/Qwen3-30B-A3B-Instruct-2507'})")
    with pytest.raises(model_path.ModelNotFoundError, match="no folder .*/nested/path/x, and it is not a Hugging"):
        hub.resolve_model("nested/path/x", tmp_path)


def test_a_cache_entry_without_weights_is_not_a_checkpoint(tmp_path, hf_cache):
    snap = _snapshot(hf_cache, "o/m", "c" * 40)
    (snap / "model.safetensors").unlink()
    assert model_path.locate_model("o/m", tmp_path) == model_path.HubModel("o/m", "main")
    assert model_path.find_in_hf_cache("o/m", need="config") == snap
    (snap / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-1.safetensors"}}')
    (snap / "model-2.safetensors").write_bytes(b"")
    assert model_path.find_in_hf_cache("o/m") is None
    (snap / "model-1.safetensors").write_bytes(b"")
    assert model_path.locate_model("o/m", tmp_path) == str(snap)
    assert model_path.locate_model("o/m", tmp_path, revision="c" * 40) == str(snap)
    assert model_path.locate_model("o/m@v1", tmp_path) == model_path.HubModel("o/m", "v1")


def test_models_command_sizes_shards_for_the_mesh():
    result = CliRunner().invoke(app, ["models", "--mesh", "fsdp=8,expert=4"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "Qwen3MoeForCausalLM" in text and "(32 devices)" in text
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in text.splitlines() if line.startswith(("│ Qwen/", "│ PrimeIntellect/"))}
    assert rows["Qwen/Qwen3-235B-A22B-Instruct-2507"][:2] == ["235.09 B", "22.19 B"]
    assert rows["Qwen/Qwen3-30B-A3B-Thinking-2507"][:2] == ["30.53 B", "3.35 B"]
    assert rows["Qwen/Qwen3-4B-Instruct-2507"][:3] == ["4.02 B", "4.02 B", "0.94 GiB"]  # 8.04 GB bf16 / 8
    # full fine-tuning: float32 weights and two moments (6x the bf16 weights) plus the engine's bf16 copy
    assert rows["Qwen/Qwen3-4B-Instruct-2507"][4] == "6.56 GiB"
    # a paged KV pool's token: 2 x 36 layers x 8 kv heads x 128 x 2 bytes, its heads over expert 4 (fsdp 8
    # would not divide them)
    assert rows["Qwen/Qwen3-4B-Instruct-2507"][5] == "36.0 KiB"
    # the model's longest context / the longest compiled to train at a Hosted batch (catalog.COMPILED_CONTEXT,
    # compiled by tests/test_compile_hosted.py); the Thinking variant shares the Instruct one's architecture
    assert rows["Qwen/Qwen3-4B-Thinking-2507"][6] == "262,144 / 32,768 on v5p-8 (tensor 4, 16 slots)"
    # (a long cell wraps: its first line)
    assert rows["Qwen/Qwen3-30B-A3B-Thinking-2507"][6].startswith("262,144 / 32,768 on v5p-16 (fsdp 2, expert 4")
    assert rows["Qwen/Qwen3-235B-A22B-Instruct-2507"][6] == "262,144 / -"
    # INTELLECT-3's one `jaxrl compile` report (docs/tpu.md 7.3): 4096-token rows on v5p-16 with 64 slots
    assert rows["PrimeIntellect/INTELLECT-3"][6].startswith("131,072 / 4,096 on v5p-16 (fsdp 2, expert 4, 64")


def test_models_command_rejects_a_bad_mesh():
    result = CliRunner().invoke(app, ["models", "--mesh", "pipeline=2"])
    assert result.exit_code == 2 and "--mesh: 'pipeline=2' is not AXIS=SIZE" in result.output
