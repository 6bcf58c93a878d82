"""Step metrics by hand, and `[wandb]` through the real `wandb` package in offline mode: the run's records
are read back from its `.wandb` file (W&B's LevelDB-style log of protobuf records)."""

import json
import math
import struct
import time
from pathlib import Path

import pytest
from helpers import jaxrl, read_metrics, subprocess_env, write_run_config
from rich.console import Console

from jaxrl.config.envs import BufferConfig
from jaxrl.config.schema import RunConfig
from jaxrl.envs.loader import Rollout
from jaxrl.rl import rollouts
from jaxrl.rl.buffer import Buffer
from jaxrl.run import wandb_log
from jaxrl.run.metrics import MetricsLogger
from jaxrl.run.redaction import secret_values

SECRET = "sk-live-0123456789abcdef"


def rollout(reward: float, n: int = 4, ok: bool = True, truncated: bool = False, env: str = "a") -> Rollout:
    if not ok:
        return Rollout([], [], [], 0.0, False, False, "boom", env, 0)
    return Rollout(list(range(n)), [False] + [True] * (n - 1), [0.0] * n, reward, truncated, True, None, env, 0)


def test_step_metrics_per_env_by_hand():
    groups = [[rollout(1.0, 4), rollout(0.0, 6, truncated=True)], [rollout(0.5, 10), rollout(0.0, ok=False)],
              [rollout(0.25, 2), rollout(0.75, 2)]]
    m = rollouts.step_metrics(groups, ["x", "y", "x"], multi_env=True)
    assert m["reward/mean"] == pytest.approx(2.5 / 5) and m["rollouts/failed"] == 1.0
    assert m["seq_len"] == pytest.approx(24 / 5) and m["is_truncated"] == pytest.approx(1 / 5)
    # env x: rewards 1, 0, .25, .75: variance (.25 + .25 + .0625 + .0625) / 4
    assert m["reward/x/mean"] == pytest.approx(0.5) and m["reward/x/std"] == pytest.approx(0.15625 ** 0.5)
    assert m["seq_len/x"] == pytest.approx(14 / 4) and m["is_truncated/x"] == pytest.approx(0.25)
    assert m["reward/y/mean"] == 0.5 and m["reward/y/std"] == 0.0 and m["rollouts/y/failed"] == 1.0
    assert m["rollouts/x/failed"] == 0.0
    assert not any(k.startswith("reward/x") for k in rollouts.step_metrics(groups, ["x", "y", "x"], False))


def wandb_records(run_dir: Path) -> list:
    """Every record of the single offline W&B run under `run_dir`, in order. Format: a 7-byte header
    (":W&B", magic, version), then 32 KiB blocks of chunks (crc32 u32, length u16, type u8: 1 full,
    2 first, 3 middle, 4 last), each record a serialized `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf = data[pos + 7:pos + 7 + length] if kind in (1, 2) else buf + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def finished_records(run_dir: Path, timeout_s: float = 60) -> list:
    """`wandb_records` once the run's exit record is there: wandb-core writes the file from its own
    process, and may still be writing when `finish()` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, "no exit record: W&B never finished writing the run"
        time.sleep(0.1)


def test_wandb_offline_run_records_history_and_redacted_config(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = RunConfig.model_validate({
        "name": "wb", "model": "m", "batch_size": 4, "rollouts_per_example": 2,
        "env": [{"id": "o/n", "args": {"api_key": SECRET, "split": "train"}}],
        "wandb": {"project": "proj", "entity": "team", "name": "nice-name"}})
    out = tmp_path / "console.txt"
    console = Console(file=out.open("w"), soft_wrap=True)
    secrets = secret_values({"OPENAI_API_KEY": SECRET}, environ={})
    run = wandb_log.start(cfg, tmp_path, secrets, console)
    logger = MetricsLogger(tmp_path, 2, 0, console, run)
    logger.log(1, {"reward/mean": 0.25, "policy/kl": 0.001, "reward/o/n/mean": 0.25})
    logger.log(2, {"reward/mean": 0.75, "policy/kl": float("nan"), "reward/o/n/mean": 0.75})
    logger.close()
    console.file.close()
    folder = next(tmp_path.glob("wandb/offline-run-*"))
    assert f"W&B: offline run in {folder}; upload it with `wandb sync {folder}`" in out.read_text()

    records = finished_records(tmp_path)
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run_record.project, run_record.entity, run_record.display_name) == ("proj", "team", "nice-name")
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["env"][0]["args"] == {"api_key": "***", "split": "train"}
    assert config["batch_size"] == 4 and config["wandb"]["project"] == "proj"
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["step"], h["reward/mean"], h["reward/o/n/mean"]) for h in history] == [(1, 0.25, 0.25),
                                                                                      (2, 0.75, 0.75)]
    assert history[0]["policy/kl"] == 0.001 and math.isnan(history[1]["policy/kl"])
    assert (tmp_path / "wandb_id").read_text() == run_record.run_id
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


def test_no_wandb_table_no_run(tmp_path):
    cfg = RunConfig.model_validate({"model": "m", "env": [{"id": "o/n"}]})
    assert wandb_log.start(cfg, tmp_path, [], Console(file=None)) is None
    assert not (tmp_path / "wandb").exists()


def test_redacted_walks_nested_values():
    assert wandb_log.redacted({"a": ["x-SECRET1-y", 3, {"b": "SECRET1"}], "c": None}, ["SECRET1"]) == {
        "a": ["x-***-y", 3, {"b": "***"}], "c": None}


def test_two_copies_of_one_env_with_ratios_filtering_and_wandb(tmp_path, tiny_model_dir, monkeypatch):
    """The real CLI in a subprocess: one environment id twice (names and args differ), env_ratios 1:3,
    online difficulty filtering, W&B offline and a secret in an env_file. Each copy gets its own metrics,
    the groups split 1:3, the buffer state is in the checkpoint, and the secret is nowhere in the run."""
    (tmp_path / "secrets.env").write_text(f"JAXRL_TEST_TOKEN={SECRET}\n")
    two_copies = 'id = "jaxrl/lowercase"\nname = "lc-small"\nargs = { num_train_examples = 3, seed = 1 }\n\n' \
                 '[[env]]\nid = "jaxrl/lowercase"\nname = "lc"'
    # synchronous: each step trains the groups drawn for it
    cfg = write_run_config(tmp_path / "rl.toml", tiny_model_dir, name="multi", max_steps=2, rollouts_per_example=2,
                           learning_rate=None, checkpoint_interval=None, extra='env_file = ["secrets.env"]',
                           env=two_copies,
                           tables='[buffer]\nonline_difficulty_filtering = true\nenv_ratios = [1.0, 3.0]\n\n'
                                  '[wandb]\nproject = "jaxrl-test"')
    env = {k: v for k, v in subprocess_env().items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    proc = jaxrl("run", cfg, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "multi"
    assert f"W&B: offline run in {run_dir / 'wandb'}" in proc.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 <= r["reward/lc-small/mean"] <= 1 and 0 <= r["reward/lc/mean"] <= 1
        assert r["seq_len/lc-small"] > 0 and r["rollouts/lc/failed"] == 0
        assert 0 <= r["buffer/filtered_groups"] <= 4
        assert ("loss" in r) == (r["buffer/filtered_groups"] < 4)  # all four filtered: no optimizer step
        assert r["train/samples"] == 2 * (4 - r["buffer/filtered_groups"])
    meta = json.loads(next((run_dir / "checkpoints" / "2").rglob("meta/metadata")).read_text())
    assert meta["buffer"]["chosen"] == [2, 6]  # 8 groups, split 1:3
    first_two = Buffer((3, 400), BufferConfig()).order(0, 0)[:2]  # lc-small's 2 groups: its first 2 examples
    assert sorted(int(k) for k in meta["buffer"]["mean_reward"][0]) == sorted(first_two.tolist())
    history = [r for r in finished_records(run_dir) if r.WhichOneof("record_type") == "history"]
    logged = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
              for r in history]
    assert [h["step"] for h in logged] == [1, 2]
    for h, row in zip(logged, rows, strict=True):
        assert h["reward/lc/mean"] == pytest.approx(row["reward/lc/mean"])
        assert h["buffer/filtered_groups"] == row["buffer/filtered_groups"]
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.name != "secrets.env":
            assert SECRET.encode() not in path.read_bytes(), path


def test_console_gets_each_step_line_once_and_no_bar_off_a_terminal(tmp_path):
    """A log file or a pipe gets `step <n>  <headline>` once per step: no final render of the progress bar
    repeating the last step's figures, no stray line at the end."""
    out = tmp_path / "console.txt"
    console = Console(file=out.open("w"), soft_wrap=True)
    logger = MetricsLogger(tmp_path, 2, 0, console)
    logger.log(1, {"reward/mean": 0.25, "time/step": 1.5})
    logger.log(2, {"reward/mean": 0.75, "time/step": 1.25})
    logger.close()
    console.file.close()
    assert out.read_text() == ("step    1  reward/mean 0.25  time/step 1.5\n"
                               "step    2  reward/mean 0.75  time/step 1.25\n")
