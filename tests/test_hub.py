"""Model download from a Hugging Face Hub (`jaxrl.config.hub`) through `huggingface_hub`, against the
stand-in hub of `stand_in_hub.py` on 127.0.0.1: a public repo downloaded once and then read from the cache
with no request, a private repo with and without its token, a revision, a missing repo and revision, a
listing larger than the disk, offline mode, no network, several processes on one host, `jaxrl validate`
and `jaxrl compile`'s config-only download."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stand_in_hub import Hub, Repo
from typer.testing import CliRunner

from jaxrl.cli.main import app
from jaxrl.config import model_path
from jaxrl.config.hub import download_config, resolve_model
from jaxrl.config.model_path import HubModel, ModelNotFoundError
from jaxrl.config.schema import load_config, resolve_model_path

SMALL = {"config.json": b'{"architectures": ["Qwen3ForCausalLM"]}', "model.safetensors": b"weights",
         "tokenizer.json": b"{}", "README.md": b"not fetched", "pytorch_model.bin": b"not fetched"}


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """A fresh HF cache under `tmp_path`, no token, online; returns the cache folder."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return tmp_path / "hf"


def _serve(monkeypatch, repos):
    hub = Hub(repos)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    return hub


def test_downloads_once_then_reads_the_cache_without_a_request(tiny_model_dir, hub_env, monkeypatch):
    with _serve(monkeypatch, {"Qwen/Tiny": Repo.from_folder(tiny_model_dir)}) as hub:
        folder = Path(resolve_model("Qwen/Tiny"))
        assert folder == hub_env / "models--Qwen--Tiny" / "snapshots" / ("a" * 40)
        names = sorted(p.name for p in tiny_model_dir.iterdir())
        assert sorted(p.name for p in folder.iterdir()) == names
        assert all((folder / n).read_bytes() == (tiny_model_dir / n).read_bytes() for n in names)
        gets = sorted(p.rsplit("/", 1)[1] for m, p in hub.file_requests() if m == "GET")
        assert gets == names  # each file's bytes once (the dry run and the download HEAD each file too)
        hub.requests.clear()
        assert resolve_model("Qwen/Tiny") == str(folder)
        assert hub.requests == []


def test_private_repo_needs_its_token(hub_env, monkeypatch):
    with _serve(monkeypatch, {"me/private": Repo({"main": ("b" * 40, SMALL)}, token="hf_good")}) as hub:
        with pytest.raises(ModelNotFoundError) as info:
            resolve_model("me/private")
        assert str(info.value) == (f"model me/private@main: cannot download it: no repository me/private on "
                                   f"{hub.url}, or it is private and no token is set (set HF_TOKEN or run "
                                   f"`hf auth login`) (HTTP 401) (and there is no folder {Path('me/private')})")
        monkeypatch.setenv("HF_TOKEN", "hf_bad")
        with pytest.raises(ModelNotFoundError, match=r"cannot download it: the token \(HF_TOKEN or `hf auth "
                                                     r"login`\) is not valid on http://127.0.0.1:\d+ \(HTTP 401\) "
                                                     r"\(and there is no folder me/private\)$"):
            resolve_model("me/private")
        assert hub.file_requests() == []
        monkeypatch.setenv("HF_TOKEN", "hf_good")
        folder = Path(resolve_model("me/private"))
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_revision_from_the_name_or_the_config(tmp_path, hub_env, monkeypatch):
    v1 = {**SMALL, "config.json": b'{"v": 1}'}
    repo = Repo({"main": ("c" * 40, SMALL), "v1": ("d" * 40, v1)})
    with _serve(monkeypatch, {"o/m": repo}):
        assert Path(resolve_model("o/m@v1"), "config.json").read_bytes() == b'{"v": 1}'
        assert Path(resolve_model("o/m"), "config.json").read_bytes() == SMALL["config.json"]
        (tmp_path / "rl.toml").write_text('model = "o/m"\n[[env]]\nid = "a/b"\n[jax]\nmodel_revision = "v1"\n')
        cfg = load_config(tmp_path / "rl.toml")
        assert resolve_model_path(cfg).endswith("d" * 40)
        with pytest.raises(ModelNotFoundError, match=r"^model o/m@v2: cannot download it: o/m has no revision "
                                                     r"'v2' on http://127\.0\.0\.1:\d+ \(and there is"):
            resolve_model("o/m", revision="v2")
        with pytest.raises(ModelNotFoundError, match=r"no repository o/missing on .*no token is set .*\(HTTP 404\)"):
            resolve_model("o/missing")


def test_too_little_disk_stops_before_any_file(hub_env, monkeypatch):
    repo = Repo({"main": ("e" * 40, SMALL)}, claimed_sizes={"model.safetensors": 10**18})
    with _serve(monkeypatch, {"o/huge": repo}) as hub:
        with pytest.raises(ModelNotFoundError, match=r"^model o/huge@main needs 1000000000\.00 GB \(3 files\) but "
                                                     r".* GB free; free some space or set HF_HUB_CACHE"):
            resolve_model("o/huge")
        assert [m for m, _ in hub.file_requests()] == ["HEAD"] * 3  # the dry run's; no file is fetched


def test_offline_and_unreachable(hub_env, monkeypatch):
    with _serve(monkeypatch, {"o/m": Repo({"main": ("f" * 40, SMALL)})}) as hub:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache .* HF_HUB_OFFLINE is set"):
            resolve_model("o/m")
        assert hub.requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")  # the hub has stopped: nothing listens on its port
    with pytest.raises(ModelNotFoundError, match=r"^model o/m@main: cannot download it: cannot reach "
                                                 r"http://127\.0\.0\.1:\d+ \(\w+\); check the network"):
        resolve_model("o/m")


def test_compile_fetches_only_the_config_and_validate_names_the_source(tmp_path, hub_env, monkeypatch):
    with _serve(monkeypatch, {"o/m": Repo({"main": ("1" * 40, SMALL)})}) as hub:
        config = download_config(HubModel("o/m"))
        assert config.read_bytes() == SMALL["config.json"]
        assert [p for _, p in hub.file_requests()] == ["/o/m/resolve/main/config.json"] * 2  # HEAD, GET
        # a cache holding only config.json is not a checkpoint: `jaxrl run` still downloads the weights
        assert model_path.locate_model("o/m") == HubModel("o/m", "main")
        (tmp_path / "rl.toml").write_text('model = "o/m@main"\n[[env]]\nid = "a/b"\n')
        result = CliRunner().invoke(app, ["validate", str(tmp_path / "rl.toml")])
        assert result.exit_code == 0, result.output
        assert (f"model weights: o/m at revision main, downloaded by `jaxrl run` from the Hugging Face Hub "
                f"({hub.url}) into {hub_env}") in result.output
        assert len(hub.file_requests()) == 2


def test_processes_on_one_host_download_once(hub_env, monkeypatch):
    """Three processes resolve the same id at once: one downloads, the others wait on its lock."""
    with _serve(monkeypatch, {"o/m": Repo({"main": ("2" * 40, SMALL)})}) as hub:
        code = "from jaxrl.config.hub import resolve_model; print(resolve_model('o/m'))"
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
                 for _ in range(3)]
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0]
        assert len(set(outs)) == 1 and outs[0].endswith("2" * 40)
        gets = sorted(p for m, p in hub.file_requests() if m == "GET")
        assert gets == [f"/o/m/resolve/{'2' * 40}/{n}" for n in ("config.json", "model.safetensors", "tokenizer.json")]
        assert json.loads(Path(outs[0], "config.json").read_text()) == {"architectures": ["Qwen3ForCausalLM"]}


def test_compile_reads_the_catalogue_or_only_the_hubs_config(tmp_path, hub_env, monkeypatch, tiny_model_dir):
    from jaxrl.compile.report import model_of
    from jaxrl.model import hf

    config = (tiny_model_dir / "config.json").read_bytes()
    with _serve(monkeypatch, {"o/tiny": Repo({"main": ("3" * 40, {**SMALL, "config.json": config})})}) as hub:
        (tmp_path / "rl.toml").write_text('model = "Qwen/Qwen3-4B-Instruct-2507"\n[[env]]\nid = "a/b"\n'
                                          '[jax]\nmodel_path = "../elsewhere/qwen3-4b"\n')
        assert model_of(load_config(tmp_path / "rl.toml")).hidden_size == 2560  # the catalogue's; no request
        assert hub.requests == []
        (tmp_path / "rl.toml").write_text('model = "o/tiny"\n[[env]]\nid = "a/b"\n')
        assert model_of(load_config(tmp_path / "rl.toml")) == hf.load_config(tiny_model_dir)
        assert [p for m, p in hub.file_requests() if m == "GET"] == ["/o/tiny/resolve/main/config.json"]
