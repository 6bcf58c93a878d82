"""The `jaxrl validate`, `init` and `run` commands as a user meets them: exit codes and messages."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from jaxrl.cli.main import app
from jaxrl.config.model_path import hf_cache_dir
from jaxrl.config.schema import ConfigError, RunConfig, load_config
from jaxrl.config.starter import STARTER_TOML

ROOT = Path(__file__).parent.parent
EXAMPLES = sorted((ROOT / "configs" / "examples").glob("*.toml"))
MINIMAL = """\
model = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"
max_steps = 100
batch_size = 128
rollouts_per_example = 8

[sampling]
max_tokens = 2048

[[env]]
id = "primeintellect/reverse-text"
"""
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def jaxrl(*args: str) -> subprocess.CompletedProcess:
    """The command in a fresh interpreter, as a shell runs it (so a traceback would show)."""
    code = "from jaxrl.cli.main import app; app(prog_name='jaxrl')"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_validate_every_seed_example(path):
    result = invoke("validate", path)
    assert result.exit_code == 0, result.output
    resolved = json.loads(result.stdout)
    assert resolved == load_config(path).model_dump(mode="json")
    assert resolved["jax"]["seq_len"] == 4096 and resolved["checkpoints"]["interval"] == 10


def test_validate_says_where_the_weights_are(tmp_path):
    result = invoke("validate", ROOT / "configs" / "examples" / "minimal.toml")
    assert ("model weights: PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT at revision main, downloaded by `jaxrl run` "
            "from the Hugging Face Hub (http://127.0.0.1:9) into ") in result.stderr  # conftest's closed endpoint
    (tmp_path / "qwen").mkdir()
    (tmp_path / "rl.toml").write_text(MINIMAL + '[jax]\nmodel_path = "qwen"\n')
    result = invoke("validate", tmp_path / "rl.toml")
    assert result.exit_code == 0
    assert f"model weights: {(tmp_path / 'qwen').resolve()}" in result.stderr


def test_validate_exits_2_where_run_would_stop_for_its_model(tmp_path):
    """Issue 41 item 7, as a shell runs it: with HF_HUB_OFFLINE=1 a model in no cache (before: exit 0 and a
    note), and a model that is neither a folder nor an owner/name id, are one `file: key: reason` line and exit
    2, as `jaxrl run` stops at them; the resolved config is still printed. Online, the same id is one to
    download (exit 0)."""
    path = tmp_path / "rl.toml"
    path.write_text(MINIMAL.replace("PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT", "nobody/not-cached"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "jaxrl", "validate", str(path)], capture_output=True, text=True,
                            cwd=ROOT, timeout=60, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"{path}: model: model nobody/not-cached@main is not in the Hugging Face cache {hf_cache_dir()} and "
        f"HF_HUB_OFFLINE is set, so it is not downloaded (and there is no folder {tmp_path / 'nobody/not-cached'})"]
    assert json.loads(result.stdout)["model"] == "nobody/not-cached"
    assert jaxrl("validate", path).returncode == 0
    path.write_text(MINIMAL.replace("PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT", "my-model"))
    result = jaxrl("validate", path)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"{path}: model: model 'my-model' not found: no folder {tmp_path / 'my-model'}, and it is not a Hugging "
        "Face id (owner/name)")


def test_validate_reports_every_error_and_exits_2(tmp_path):
    path = tmp_path / "rl.toml"
    text = MINIMAL.replace("primeintellect/reverse-text", "foo")
    path.write_text(text.replace("2048", "8\ntemprature = 1"))
    result = invoke("validate", path)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"{path}: sampling.temprature: unknown key (did you mean 'temperature'?)",
        f"{path}: env.0.id: 'foo' is not in owner/name[@version] form",
    ]


@pytest.mark.parametrize(("text", "message"), [
    (MINIMAL.replace("batch_size = 128", "batch_size = 100"),
     "batch_size: 100 is not divisible by rollouts_per_example (8)"),
    (MINIMAL.replace("max_steps = 100", "max_steps = "),
     "invalid TOML: Invalid value (at line 2, column 13)"),
    (MINIMAL + "[jax]\nmesh = { data = 0 }\n",
     "jax.mesh.data: Input should be greater than or equal to 1, got 0"),
    ('env_file = ["missing.env"]\n' + MINIMAL, "env_file.0: file not found: "),
])
def test_validate_errors_without_traceback(tmp_path, text, message):
    path = tmp_path / "rl.toml"
    path.write_text(text)
    result = jaxrl("validate", path)
    assert result.returncode == 2
    assert f"{path}: {message}" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_validate_missing_file(tmp_path):
    result = jaxrl("validate", tmp_path / "nope.toml")
    assert result.returncode == 2
    assert result.stderr.strip() == f"{tmp_path / 'nope.toml'}: file not found"


def test_validate_malformed_env_file(tmp_path):
    (tmp_path / "secrets.env").write_text("OK=1\nthis is not a pair\n")
    (tmp_path / "rl.toml").write_text('env_file = ["secrets.env"]\n' + MINIMAL)
    result = invoke("validate", tmp_path / "rl.toml")
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"{(tmp_path / 'rl.toml').resolve()}: env_file.0: "
                                     f"{(tmp_path / 'secrets.env').resolve()}: line 2: expected KEY=VALUE")


def test_validate_does_not_import_jax():
    code = ("import sys; from jaxrl.cli.main import app; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax', 'torch')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


def test_help_lists_each_command_in_whole_sentences():
    """The command list joins a docstring's lines (rich markup mode kept them, breaking sentences), and
    text like `[jax] checkpoint_dir` or `<output_dir>/<name>` is shown as written."""
    text = runner.invoke(app, ["--help"], env={"COLUMNS": "400"}).output
    assert "Train: load the config, then start the run (in the foreground, or in the background with --detach). " \
           "Its console output is also kept in <output_dir>/<name>/console.log." in text
    assert "([jax] checkpoint_dir)" in text


def test_init_writes_a_valid_starter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("init")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rl.toml").read_text() == STARTER_TOML
    assert invoke("validate", "rl.toml").exit_code == 0


def test_init_refuses_to_overwrite_without_force(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("# my own config\n")
    result = invoke("init", path)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"{path} already exists; pass --force to overwrite it"
    assert path.read_text() == "# my own config\n"
    assert invoke("init", path, "--force").exit_code == 0
    assert path.read_text() == STARTER_TOML


@pytest.fixture
def fake_runner(monkeypatch):
    """Stands in for `jaxrl.run.runner` (which imports JAX); records the configs it is asked to run and prints
    a line on the console it is given, as the runner does."""
    module = types.ModuleType("jaxrl.run.runner")
    module.calls = []

    def run(cfg, console=None):
        module.calls.append(cfg)
        (console or Console()).print("step    1  [bold]reward/mean 0.5[/]")

    module.run = run
    monkeypatch.setitem(sys.modules, "jaxrl.run.runner", module)
    return module


def test_run_bad_config_has_no_traceback(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text(MINIMAL.replace("2048", "-1"))
    result = jaxrl("run", path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"{path}: sampling.max_tokens: Input should be greater than or equal to 1, got -1")
    assert "Traceback" not in result.stdout


def test_run_hands_the_config_to_the_runner(tmp_path, fake_runner, monkeypatch):
    monkeypatch.chdir(tmp_path)  # output_dir "runs" is relative to the working directory
    (tmp_path / "secrets.env").write_text("JAXRL_TEST_SECRET=s3cret\n")
    path = tmp_path / "rl.toml"
    path.write_text('env_file = ["secrets.env"]\n' + MINIMAL)
    result = invoke("run", path)
    assert result.exit_code == 0, result.output
    (cfg,) = fake_runner.calls
    assert isinstance(cfg, RunConfig) and cfg.source == path.resolve()
    assert cfg.env_file == [str((tmp_path / "secrets.env").resolve())]
    # A foreground run keeps its terminal output and copies it, without markup, to the run's console.log,
    # and records how it ended in run.json.
    assert result.stdout == "step    1  reward/mean 0.5\n"
    run_dir = tmp_path / "runs" / "rl"
    assert (run_dir / "console.log").read_text().splitlines()[1:] == ["step    1  reward/mean 0.5"]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["exit_code"] == 0 and record["config"] == str(path.resolve())


def test_run_checks_env_files_before_starting(tmp_path, fake_runner):
    (tmp_path / "secrets.env").write_text('KEY="unterminated\n')
    path = tmp_path / "rl.toml"
    path.write_text('env_file = ["secrets.env"]\n' + MINIMAL)
    result = invoke("run", path)
    assert result.exit_code == 2
    assert "secrets.env: line 1: unterminated" in result.stderr
    assert fake_runner.calls == []


def test_run_reports_config_errors_from_the_runner(tmp_path, fake_runner):
    def run(cfg: RunConfig, console: Console | None = None) -> None:
        raise ConfigError(cfg.source, [("jax.mesh", "4 devices wanted, 1 found")])

    fake_runner.run = run
    path = tmp_path / "rl.toml"
    path.write_text(MINIMAL)
    result = invoke("run", path)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"{path.resolve()}: jax.mesh: 4 devices wanted, 1 found"
