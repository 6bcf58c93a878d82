"""`run.json` under contention and config errors (issue 35 item 7): two `jaxrl run --detach` of one run at once,
and a config error that only the run finds (a `model_path` that is a file), which must leave the record it found."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from helpers import run_toml, subprocess_env

from jaxrl.cli import runs


def test_two_detached_starts_of_one_run_and_a_config_error_keep_the_runs_record(tmp_path, tiny_model_dir):
    """Two `jaxrl run --detach` of one run at once: one starts it, the other says "already running" on its own
    stderr and exits 2 (before: both printed "started" and exited 0; the loser's refusal went to console.log only).
    The run that started then meets a config error (`model_path` a file): the run's earlier record, a completed run,
    is put back as it was (before: overwritten with `failed`)."""
    (tmp_path / "weights.bin").write_bytes(b"not a folder")
    cfg = tmp_path / "rl.toml"
    cfg.write_text(run_toml(tmp_path / "weights.bin", tmp_path / "runs", name="twice"))
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


def test_a_config_error_of_a_new_run_leaves_no_record(tmp_path):
    """The same for a run with no earlier record: `restore_record` removes the one `start` wrote."""
    folder = tmp_path / "new"
    previous = runs.start(folder, Path("rl.toml"))
    assert previous == {} and runs.read_record(folder)["status"] == "running"
    runs.restore_record(folder, previous)
    assert not (folder / "run.json").exists()
