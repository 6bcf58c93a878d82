"""`run.json` under contention and config errors (issue 35 item 7): two `jaxrl run --detach` of one run at once,
and a config error that only the run finds (a `model_path` folder that holds no model), which must leave the record
it found, or record the run `failed` with the reason when it found none."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from helpers import jaxrl, run_toml, subprocess_env

from jaxrl.cli import runs
from jaxrl.config.model_path import hf_cache_dir


def test_two_detached_starts_of_one_run_and_a_config_error_keep_the_runs_record(tmp_path, tiny_model_dir):
    """Two `jaxrl run --detach` of one run at once: one starts it, the other says "already running" on its own
    stderr and exits 2 (before: both printed "started" and exited 0; the loser's refusal went to console.log only).
    The run that started then meets a config error (`model_path` a folder without a model, which only loading it
    finds): the run's earlier record, a completed run, is put back as it was (before: overwritten with `failed`)."""
    (tmp_path / "no-model").mkdir()
    cfg = tmp_path / "rl.toml"
    cfg.write_text(run_toml(tmp_path / "no-model", tmp_path / "runs", name="twice"))
    run_dir = tmp_path / "runs" / "twice"
    run_dir.mkdir(parents=True)
    earlier = {"pid": 1, "host": runs.HOST, "status": "completed", "config": str(cfg), "started": 1.0, "ended": 2.0,
               "exit_code": 0}
    (run_dir / "run.json").write_text(json.dumps(earlier))
    procs = [subprocess.Popen([sys.executable, "-m", "jaxrl", "run", "--detach", str(cfg)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=tmp_path) for _ in range(2)]
    outs = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    started = [o for o in outs if o[0] == 0]
    refused = [o for o in outs if o[0] != 0]
    assert len(started) == 1 and len(refused) == 1, outs
    assert "started run twice in the background" in started[0][1]
    assert refused[0][0] == 2 and "jaxrl run: run twice is already running (pid" in refused[0][2], refused
    pid = int(re.search(r"\(pid (\d+)\)", started[0][1])[1])
    deadline = time.monotonic() + 180
    while runs.pid_alive(pid):
        assert time.monotonic() < deadline, (run_dir / "console.log").read_text()
        time.sleep(0.2)
    log = (run_dir / "console.log").read_text()
    assert "jax.model_path" in log, log
    record = runs.read_record(run_dir)
    assert {k: record[k] for k in earlier} == earlier, record
    assert runs.status(run_dir) == "completed"


def test_a_config_error_of_a_new_run_records_it_failed_with_the_reason(tmp_path):
    """The same for a run with no earlier record: `restore_record` records the run `failed` (exit 2) with the line
    it stopped at, so that `jaxrl list` and `jaxrl delete` know its folder (before: the record was removed, and
    the folder, console.log and .lock in it, was listed as "unknown" and could not be deleted)."""
    folder = tmp_path / "new"
    previous = runs.start(folder, Path("rl.toml"))
    assert previous == {} and runs.read_record(folder)["status"] == "running"
    runs.restore_record(folder, previous, "rl.toml: model: cannot download it")
    record = runs.read_record(folder)
    reason = "rl.toml: model: cannot download it"
    assert (record["status"], record["exit_code"], record["error"]) == ("failed", 2, reason)
    assert runs.status(folder) == "failed"


def _unresolvable(tmp_path: Path) -> Path:
    """A run config whose model is a Hugging Face id in no cache (`[jax] model_path` unset)."""
    cfg = tmp_path / "rl.toml"
    text = run_toml(tmp_path / "unused", tmp_path / "runs", name="nomodel")
    cfg.write_text(text.replace(f'model_path = "{tmp_path / "unused"}"\n', "").replace(
        'model = "jaxrl/qwen3-tiny"', 'model = "nobody/no-such-model"'))
    assert "model_path" not in cfg.read_text()
    return cfg


def test_a_run_whose_model_cannot_resolve_leaves_no_folder_or_a_failed_run(tmp_path):
    """Issue 41 item 4, through the real CLI. With HF_HUB_OFFLINE=1 and the model in no cache, `jaxrl run` stops
    before it makes the run folder (one line, exit 2; before: `runs/NAME/` with console.log and .lock and no
    run.json, listed "unknown", refused by `delete`). A download that fails in the run (conftest's closed
    HF_ENDPOINT), in the foreground or detached, records the run `failed` with that line, which `jaxrl list` shows
    and `jaxrl delete` removes."""
    cfg, runs_dir = _unresolvable(tmp_path), tmp_path / "runs"
    offline = jaxrl("run", cfg, env=subprocess_env(HF_HUB_OFFLINE="1"), cwd=tmp_path)
    assert offline.returncode == 2 and offline.stderr.strip().splitlines() == [
        f"{cfg}: model: model nobody/no-such-model@main is not in the Hugging Face cache "
        f"{hf_cache_dir()} and HF_HUB_OFFLINE is set, so it is not downloaded (and there is no folder "
        f"{tmp_path / 'nobody/no-such-model'})"], offline.stderr
    assert not runs_dir.exists()

    for detach in ([], ["--detach"]):
        result = jaxrl("run", *detach, cfg, cwd=tmp_path)
        if detach:
            assert result.returncode == 0, result.stderr
            pid = int(re.search(r"\(pid (\d+)\)", result.stdout)[1])
            deadline = time.monotonic() + 180
            while runs.pid_alive(pid):
                assert time.monotonic() < deadline
                time.sleep(0.2)
        else:
            assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        record = runs.read_record(runs_dir / "nomodel")
        assert (record["status"], record["exit_code"]) == ("failed", 2), record
        assert record["error"].startswith(f"{cfg}: model: model nobody/no-such-model@main: cannot download it"), record
        listed = jaxrl("list", "--runs-dir", runs_dir)
        assert re.search(r"nomodel\s+│\s+failed", listed.stdout), listed.stdout
        deleted = jaxrl("delete", "nomodel", "--yes", "--runs-dir", runs_dir)
        assert deleted.returncode == 0 and not (runs_dir / "nomodel").exists(), deleted.stderr


def test_list_and_delete_take_a_folder_a_cut_off_start_left(tmp_path):
    """A run folder with console.log and .lock and no run.json (as a start killed before it recorded itself, or
    jaxrl before issue 41, left it) is listed and deleted; one that also holds a file `jaxrl run` never writes
    is refused, the file kept."""
    runs_dir = tmp_path / "runs"
    for name in ("cut", "mixed"):
        (runs_dir / name).mkdir(parents=True)
        (runs_dir / name / "console.log").write_text("--- jaxrl run rl.toml ---\n")
        (runs_dir / name / ".lock").write_text("")
    (runs_dir / "mixed" / "notes.txt").write_text("mine")
    listed = jaxrl("list", "--runs-dir", runs_dir)
    assert re.search(r"cut\s+│\s+unknown", listed.stdout) and "mixed" in listed.stdout, listed.stdout
    deleted = jaxrl("delete", "cut", "--yes", "--runs-dir", runs_dir)
    assert deleted.returncode == 0 and not (runs_dir / "cut").exists(), deleted.stderr
    refused = jaxrl("delete", "mixed", "--yes", "--runs-dir", runs_dir)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"jaxrl delete: refused to delete {runs_dir / 'mixed'}: it has no run.json and holds what `jaxrl run` does "
        "not write (notes.txt); nothing deleted")
    assert (runs_dir / "mixed" / "notes.txt").read_text() == "mine"
