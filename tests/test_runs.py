"""Run management as a user meets it (`jaxrl run --detach`, `list`, `logs`, `stop`, `delete`,
`checkpoints`, `plot`), through the real CLI in subprocesses, over one real tiny detached run that is
then resumed and stopped. A JAX compilation cache keeps the second start short."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import jaxrl, write_run_config
from matplotlib import image

from jaxrl.cli import runs
from jaxrl.run import resources

NAME = "bg"


def _config(tmp_path: Path, model: Path, max_steps: int) -> Path:
    return write_run_config(tmp_path / f"rl-{max_steps}.toml", model, name=NAME, max_steps=max_steps,
                            learning_rate=None, synchronous=False, tables='[infrastructure]\ncompute_size = "S"')


def wait_until(predicate, what: str, folder: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        log = (folder / runs.LOG).read_text() if (folder / runs.LOG).exists() else ""
        assert time.monotonic() < deadline, f"no {what} after {timeout}s; log:\n{log}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir):
    """A 2-step detached run, followed with `jaxrl logs --follow` until it ended."""
    tmp = tmp_path_factory.mktemp("runs-e2e")
    cfg = _config(tmp, tiny_model_dir, 2)
    started = jaxrl("run", cfg, "--detach", timeout=60)
    assert started.returncode == 0, started.stdout + started.stderr
    followed = jaxrl("logs", NAME, "--follow", "--runs-dir", tmp / "runs", timeout=300)
    return tmp, cfg, started, followed


def test_detached_run_completes_and_is_followed_listed_and_logged(finished):
    tmp, cfg, started, followed = finished
    folder = tmp / "runs" / NAME
    assert f"started run {NAME} in the background" in started.stdout
    assert f"jaxrl logs {NAME} --runs-dir {tmp / 'runs'} --follow" in started.stdout
    pid = int(re.search(r"\(pid (\d+)\)", started.stdout).group(1))
    record = json.loads((folder / "run.json").read_text())
    assert record["pid"] == pid and record["status"] == "completed" and record["exit_code"] == 0
    # --follow printed the log as it grew and returned when the run ended
    assert followed.returncode == 0, followed.stderr
    assert "step    2" in followed.stdout and "done: 2 steps" in followed.stdout
    assert followed.stdout.rstrip().endswith(f"[run {NAME}: completed]")
    log = (folder / "console.log").read_text()
    assert "(detached)" in log.splitlines()[0] and "Traceback" not in log
    # [infrastructure] compute_size = "S" reached the run (on this machine's cores)
    assert resources.env_resources("S").describe("S") in log
    listed = jaxrl("list", "--runs-dir", tmp / "runs")
    row = next(line for line in listed.stdout.splitlines() if f" {NAME} " in line)
    assert "completed" in row and "2/2" in row
    tail = jaxrl("logs", NAME, "--tail", "1", "--runs-dir", tmp / "runs")
    assert tail.stdout.startswith("done: 2 steps") and tail.stdout.count("\n") == 1


def test_checkpoints_and_plot_of_the_run(finished):
    tmp, *_ = finished
    folder = tmp / "runs" / NAME
    out = jaxrl("checkpoints", str(folder))  # a run folder's path works as well as its name
    assert out.returncode == 0, out.stderr
    rows = {line.split()[1]: line for line in out.stdout.splitlines() if re.match(r"^\W+\d+ ", line)}
    assert sorted(rows) == ["1", "2"]
    assert "yes" in rows["1"] and "yes" in rows["2"] and "step_2" in rows["2"] and "step_" not in rows["1"]
    assert f"PEFT adapters in {folder / 'adapters'}" in out.stdout
    assert f"jaxrl export {folder} --step 2" in out.stdout
    png = tmp / "curve.png"
    out = jaxrl("plot", NAME, "--out", png, "--runs-dir", tmp / "runs")
    assert out.returncode == 0 and f"wrote {png}" in out.stdout
    # reward, entropy, KL (policy/kl only: no [jax.loss] kl_coef), learning rate; no eval metrics in this run
    assert image.imread(png).shape[:2] == (4 * 350, 800)


def test_stop_a_running_run_checkpoints_and_shows_stopped(finished, tiny_model_dir):
    """The finished run, resumed detached to 50 steps, then stopped after a step: it checkpoints the
    step it reached and reads as stopped; while it runs, a second start and delete are refused."""
    tmp, *_ = finished
    folder, runs_dir = tmp / "runs" / NAME, tmp / "runs"
    cfg = _config(tmp, tiny_model_dir, 50)
    assert jaxrl("run", cfg, "--detach", timeout=60).returncode == 0
    wait_until(lambda: "step    3" in (folder / runs.LOG).read_text(), "step 3", folder)
    again = jaxrl("run", cfg)
    assert again.returncode == 2 and f"run {NAME} is already running" in again.stderr
    refused = jaxrl("delete", NAME, "--yes", "--runs-dir", runs_dir)
    assert refused.returncode == 2 and "is running" in refused.stderr and folder.exists()
    assert "running" in jaxrl("list", "--runs-dir", runs_dir).stdout

    stopped = jaxrl("stop", NAME, "--runs-dir", runs_dir, timeout=200)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"run {NAME}: stopped" in stopped.stdout and "SIGTERM: stopped after step" in stopped.stdout
    step = int(re.search(r"stopped after step (\d+)", stopped.stdout).group(1))
    record = json.loads((folder / "run.json").read_text())
    assert record["status"] == "stopped" and record["exit_code"] == 143
    assert step >= 3 and (folder / "checkpoints" / str(step)).is_dir()
    assert "stopped" in jaxrl("list", "--runs-dir", runs_dir).stdout
    assert "is not running (stopped)" in jaxrl("stop", NAME, "--runs-dir", runs_dir).stderr

    kept = jaxrl("delete", NAME, "--runs-dir", runs_dir, stdin="n\n")
    assert kept.returncode == 2 and "nothing deleted" in kept.stderr and folder.exists()
    gone = jaxrl("delete", NAME, "--yes", "--runs-dir", runs_dir)
    assert gone.returncode == 0 and not folder.exists()
    missing = jaxrl("logs", NAME, "--runs-dir", runs_dir)
    assert missing.returncode == 2 and f"no run {NAME!r} in {runs_dir}; it holds no run" in missing.stderr


def test_a_dead_process_reads_as_died(tmp_path):
    folder = tmp_path / "runs" / "crashed"
    folder.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    runs.write_record(folder, pid=int(dead.stdout), status="running", started=time.time())
    (tmp_path / "runs" / "other").mkdir()
    (tmp_path / "runs" / "other" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.25}\n')
    listed = jaxrl("list", "--runs-dir", tmp_path / "runs")
    assert re.search(r"crashed\s+\W+died", listed.stdout) and re.search(r"other\s+\W+unknown\s+\W+1\s+\W+0\.250",
                                                                        listed.stdout), listed.stdout
    out = jaxrl("stop", "crashed", "--runs-dir", tmp_path / "runs")
    assert out.returncode == 2 and "is not running (died)" in out.stderr
    out = jaxrl("logs", "nope", "--runs-dir", tmp_path / "runs")
    assert out.returncode == 2 and "no run 'nope'" in out.stderr and "runs there: crashed, other" in out.stderr
    # A run recorded by another host (process 0 of a multi-host run, on a shared folder) cannot be checked
    # from here: it reads as running, is neither stopped nor deleted from here, and does not block a start.
    runs.write_record(folder, host="elsewhere")
    assert runs.status(folder) == "running" and runs.running_pid(folder) is None
    out = jaxrl("stop", "crashed", "--runs-dir", tmp_path / "runs")
    assert out.returncode == 2 and "runs on host elsewhere; stop it there" in out.stderr
    out = jaxrl("delete", "crashed", "--yes", "--runs-dir", tmp_path / "runs")
    assert out.returncode == 2 and "is running (pid " in out.stderr and " on elsewhere)" in out.stderr
    assert folder.exists()


def test_run_config_is_read_under_its_old_name_too(tmp_path):
    """Runs from before `run_config.json` wrote `config.json`; both are read, the new name first."""
    old, new = {"config": {"max_steps": 3}, "resolved": {}}, {"config": {"max_steps": 5}, "resolved": {}}
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert runs.run_config(tmp_path) == old and runs.info(tmp_path).max_steps == 3
    (tmp_path / "run_config.json").write_text(json.dumps(new))
    assert runs.run_config(tmp_path) == new


def test_delete_removes_a_separate_local_checkpoint_folder_and_names_gcs(tmp_path):
    runs_dir = tmp_path / "runs"
    for name, ckpt in [("local", str(tmp_path / "ckpts" / "local")), ("cloud", "gs://bucket/ckpts/cloud")]:
        (runs_dir / name).mkdir(parents=True)
        record = json.dumps({"config": {}, "resolved": {"checkpoint_dir": ckpt}})
        (runs_dir / name / "run_config.json").write_text(record)
        runs.write_record(runs_dir / name, pid=1, host=runs.HOST, status="failed")
    (tmp_path / "ckpts" / "local" / "1").mkdir(parents=True)
    out = jaxrl("delete", "local", "--yes", "--runs-dir", runs_dir)
    assert out.returncode == 0 and not (runs_dir / "local").exists() and not (tmp_path / "ckpts" / "local").exists()
    assert (tmp_path / "ckpts").exists()
    out = jaxrl("delete", "cloud", "--yes", "--runs-dir", runs_dir)
    assert out.returncode == 0 and not (runs_dir / "cloud").exists()
    assert "not deleted: its checkpoints and adapters on GCS, gs://bucket/ckpts/cloud" in out.stdout


def test_plot_draws_eval_curves_from_metrics(tmp_path):
    folder = tmp_path / "runs" / "evald"
    folder.mkdir(parents=True)
    rows = [{"step": 0, "eval/lowercase/reward/mean": 0.1, "eval/lowercase/pass@4": 0.3}]
    rows += [{"step": s, "reward/mean": s / 10, "reward/std": 0.05, "val/reward/mean": s / 12 if s % 2 == 0 else None}
             for s in range(1, 7)]
    rows += [{"step": 6, "eval/lowercase/reward/mean": 0.5, "eval/lowercase/pass@4": 0.7}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "rew')
    out = jaxrl("plot", "evald", "--runs-dir", tmp_path / "runs")
    assert out.returncode == 0, out.stderr
    png = image.imread(folder / "plot.png")
    assert png.shape[:2] == (700, 800)  # two panels: reward, then eval/val
    assert png[..., :3].std() > 0.05  # something is drawn
    from jaxrl.cli.plot import eval_keys

    assert eval_keys(rows) == ["eval/lowercase/pass@4", "eval/lowercase/reward/mean", "val/reward/mean"]
    from jaxrl.cli.plot import panels

    rows[1] |= {"policy/entropy": 2.0, "policy/ref_kl": 0.01, "teacher/kl": 0.3, "optim/lr": 1e-4}
    assert panels(rows) == [("reward", ["reward/mean"]), ("entropy", ["policy/entropy"]),
                            ("KL", ["policy/ref_kl"]), ("teacher KL", ["teacher/kl"]), ("learning rate", ["optim/lr"]),
                            ("eval / val", eval_keys(rows))]
    sft_rows = [{"step": 1, "loss": 3.0, "sft/epoch": 0.5, "optim/lr": 1e-4},
                {"step": 2, "loss": 2.0, "sft/epoch": 1.0}]
    assert panels(sft_rows) == [("SFT loss", ["loss"]), ("learning rate", ["optim/lr"])]
    (folder / "metrics.jsonl").write_text("")
    empty = jaxrl("plot", "evald", "--runs-dir", tmp_path / "runs")
    assert empty.returncode == 2 and "no reward/mean or eval/val metrics to plot yet" in empty.stderr
