"""Names and paths that become folders, and `jaxrl delete`, as a careless or hostile user meets them:
a run named `..` once wrote into the project folder and `jaxrl delete .. --yes` then removed it whole.
Each test sets up real folders with a user's file beside them and checks that the file survives."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jaxrl.cli import runs
from jaxrl.cli.main import app

BASE = """\
model = "o/m"
batch_size = 8
rollouts_per_example = 4

[[env]]
id = "o/env"
"""


def validate(tmp_path: Path, text: str, file: str = "rl.toml"):
    path = tmp_path / file
    path.write_text(text)
    return CliRunner().invoke(app, ["validate", str(path)]), path


@pytest.mark.parametrize(("line", "key", "reason"), [
    ('name = ".."', "name", "'..' cannot name a folder"),
    ('name = "."', "name", "'.' cannot name a folder"),
    ('name = ""', "name", "'' cannot name a folder"),
    ('name = "../elsewhere"', "name", "holds a path separator"),
    ('name = "a/b"', "name", "holds a path separator"),
    ('name = "a\\\\b"', "name", "holds a path separator"),
    ('name = "run\\u0000"', "name", "holds control characters ('\\x00')"),
    ('name = "run\\n2"', "name", "holds control characters ('\\n')"),
])
def test_run_names_that_are_not_one_folder_are_refused(tmp_path, line, key, reason):
    result, path = validate(tmp_path, line + "\n" + BASE)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{path}: {key}: " in result.stderr and reason in result.stderr, result.stderr


@pytest.mark.parametrize(("table", "key"), [("[[env]]", "env.1.name"), ("[[eval.env]]", "eval.env.0.name")])
@pytest.mark.parametrize("name", ["..", ".", "x/y", "tab\\t"])
def test_env_names_that_are_not_one_folder_are_refused(tmp_path, table, key, name):
    result, path = validate(tmp_path, BASE + f'{table}\nid = "o/other"\nname = "{name}"\n')
    assert result.exit_code == 2 and f"{path}: {key}: " in result.stderr, result.stderr


@pytest.mark.parametrize(("table", "line", "key"), [
    ("[jax]", 'output_dir = ""', "jax.output_dir"),
    ("[jax]", 'checkpoint_dir = "ck\\u0007"', "jax.checkpoint_dir"),
    ("[jax]", 'model_path = ""', "jax.model_path"),
    ("[jax]", 'tokenizer_path = "\\r"', "jax.tokenizer_path"),
    ("", 'checkpoint_id = ""', "checkpoint_id"),
])
def test_empty_paths_and_control_characters_in_paths_are_refused(tmp_path, table, line, key):
    text = f"{line}\n{BASE}" if not table else f"{BASE}{table}\n{line}\n"
    result, path = validate(tmp_path, text)
    assert result.exit_code == 2 and f"{path}: {key}: " in result.stderr, result.stderr


def test_a_file_whose_stem_is_dotdot_needs_a_name(tmp_path):
    result, path = validate(tmp_path, BASE, file="...toml")
    assert result.exit_code == 2 and f"{path}: name: not set, and the file's name '..' cannot" in result.stderr
    result, _ = validate(tmp_path, 'name = "ok"\n' + BASE, file="...toml")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("name", "key"), [
    ("r" * 300, "name"),  # past the filesystem's 255 bytes: once `OSError: [Errno 36] File name too long`
    ("r" * 10_000_000, "name"),
    ("é" * 129, "name"),  # past the 128-character cap (258 bytes)
    ("€" * 100, "name"),  # 100 characters, 300 bytes in UTF-8
], ids=["300 chars", "10 MB", "129 chars", "300 bytes"])
def test_names_longer_than_a_folder_name_may_be_are_refused(tmp_path, name, key):
    """Issue 35 item 4: a run name or an env name past `NAME_MAX_CHARS` characters or `NAME_MAX_BYTES`
    bytes is a `file: key: reason` error of `jaxrl validate` (and so of `jaxrl run`), the name shortened."""
    result, path = validate(tmp_path, f'name = "{name}"\n' + BASE)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{path}: {key}: " in result.stderr and "a name is at most 128 characters and 255 bytes" in result.stderr
    assert len(result.stderr) < 1000
    env, path = validate(tmp_path, BASE + f'[[env]]\nid = "o/other"\nname = "{name[:300]}"\n')
    assert env.exit_code == 2 and f"{path}: env.1.name: " in env.stderr, env.stderr
    ok, _ = validate(tmp_path, f'name = "{"r" * 128}"\n' + BASE)
    assert ok.exit_code == 0, ok.output


def test_ordinary_names_still_pass(tmp_path):
    result, _ = validate(tmp_path, 'name = "my-run_2.1 (é)"\n' + BASE + '[jax]\noutput_dir = "../runs"\n')
    assert result.exit_code == 0, result.output


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder with a user's file, a runs folder holding one finished run `good`, and the files
    that a run named `..` (or `.`) wrote with the old code: run.json in the project folder itself."""
    proj = tmp_path / "proj"
    runs_dir = proj / "runs"
    (runs_dir / "good").mkdir(parents=True)
    runs.write_record(runs_dir / "good", pid=1, host=runs.HOST, status="completed")
    (proj / "notes.txt").write_text("mine")
    runs.write_record(proj, pid=1, host=runs.HOST, status="completed")
    monkeypatch.chdir(tmp_path)
    return proj, runs_dir


def delete(ref: str, runs_dir: Path):
    return CliRunner().invoke(app, ["delete", ref, "--yes", "--runs-dir", str(runs_dir)])


@pytest.mark.parametrize("ref", ["..", ".", "../runs", "good/..", "/"])
def test_delete_refuses_the_runs_folder_and_its_parent(project, ref):
    proj, runs_dir = project
    runs.write_record(runs_dir, pid=1, host=runs.HOST, status="completed")  # as a run named "." left it
    result = delete(ref, runs_dir)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "nothing deleted" in result.stderr or "no run" in result.stderr, result.stderr
    assert (proj / "notes.txt").read_text() == "mine" and (runs_dir / "good" / runs.RECORD).exists()


def test_delete_refuses_a_folder_that_is_not_a_run(project):
    proj, runs_dir = project
    (runs_dir / "half").mkdir()
    (runs_dir / "half" / "metrics.jsonl").write_text('{"step": 1}\n')
    (runs_dir / "half" / "data.csv").write_text("user data")
    result = delete("half", runs_dir)
    assert result.exit_code == 2 and f"refused to delete {runs_dir / 'half'}: it has no run.json" in result.stderr
    assert (runs_dir / "half" / "data.csv").exists()
    outside = delete(str(proj), runs_dir)  # a path to a run folder outside --runs-dir
    assert outside.exit_code == 2 and "not a run folder inside the runs folder" in outside.stderr
    assert (proj / "notes.txt").exists()


def test_delete_leaves_a_recorded_checkpoint_folder_that_is_not_the_runs_own(project):
    """A run's config.json names its separate checkpoint folder; one that is the project folder (or any
    folder not named after the run) is left in place, and said so."""
    proj, runs_dir = project
    (runs_dir / "good" / "config.json").write_text(json.dumps({"resolved": {"checkpoint_dir": str(proj)}}))
    result = delete("good", runs_dir)
    assert result.exit_code == 0, result.output
    assert not (runs_dir / "good").exists() and (proj / "notes.txt").read_text() == "mine"
    assert f"not deleted: its checkpoint folder {proj} (its name is not the run's, 'good')" in result.stdout


def test_delete_removes_a_real_run(project):
    proj, runs_dir = project
    result = delete("good", runs_dir)
    assert result.exit_code == 0 and not (runs_dir / "good").exists()
    assert runs_dir.is_dir() and (proj / "notes.txt").exists()
