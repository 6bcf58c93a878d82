"""`jaxrl run` multi-host, for real, on 2 processes x 4 emulated CPU devices joined on 127.0.0.1 through the
JAX_* variables: the tiny quickstart synchronously with one rollout engine spanning both processes, against
1 process x 8 devices, both checkpointing to the GCS emulator; and generation overlapping training
(`max_async_level = 2`, `oversampling_factor = 2`, an engine per process) killed, resumed and stopped."""

import signal

import jax
import numpy as np
import pytest
from gcs_fixtures import free_port
from helpers import finish, read_metrics, reproducible, start, wait_for, write_run_config

from jaxrl.export import exporter
from jaxrl.model import hf
from jaxrl.run.checkpoint import Checkpointer

STEPS = 2


def _pair(cfg, tmp_path, name):
    """`jaxrl run cfg` as processes 0 and 1 of a 2 x 4-device run; their logs are `<name>-<pid>.log`."""
    port = free_port()
    return [start(cfg, tmp_path / f"{name}-{pid}.log", devices=4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                  JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid)) for pid in range(2)]


@pytest.mark.numerics
def test_two_processes_train_like_one(tmp_path, tiny_model_dir, gcs):
    """Same metrics every step (rewards exactly; losses to float rounding, the train step's reductions
    being split over other devices), [val]'s included, and the same LoRA in the last checkpoint, with one
    rollout engine over both processes' devices (`engine_hosts = 2`, stepped in lockstep). Only process 0
    writes metrics and prints progress. The three processes run at once to save wall time."""
    url = "gs://jaxrl-test/distributed"
    runs = {}
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        runs[name] = write_run_config(tmp_path / name / "rl.toml", tiny_model_dir, name=name, max_steps=STEPS,
                                      tables="[buffer]\nskip_verification = true\n\n[val]\ninterval = 1\n"
                                             "num_examples = 3\nrollouts_per_example = 2",
                                      jax_extra=f'checkpoint_dir = "{url}"\nengine_hosts = {2 if name == "two" else 0}')
    procs = {"one": start(runs["one"], tmp_path / "one.log", devices=8)}
    procs |= {f"two-{pid}": proc for pid, proc in enumerate(_pair(runs["two"], tmp_path, "two"))}
    try:
        logs = {name: finish(proc, tmp_path / f"{name}.log") for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for name, (code, out) in logs.items():
        assert code == 0, f"{name}:\n{out}"
    assert "mesh {'data': 1, 'fsdp': 8, 'tensor': 1, 'expert': 1}" in logs["two-0"][1]
    assert "rollout engine: one over 2 processes (engine_hosts = 2)" in logs["two-0"][1]
    assert f"step    {STEPS} " in logs["two-0"][1] and "step    1 " not in logs["two-1"][1]

    one = reproducible(read_metrics(tmp_path / "one" / "runs" / "one"))
    two = reproducible(read_metrics(tmp_path / "two" / "runs" / "two"))  # both processes share this folder
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for a, b in zip(two, one, strict=True):
        assert a.keys() == b.keys()
        for k in ("reward/mean", "reward/std", "seq_len", "rollouts/failed", "train/samples"):
            assert a[k] == b[k], (a["step"], k)
        assert a["train/samples"] == 8  # each group played once, by one of the two processes
        assert a["val/rollouts/failed"] == 0 and a["val/seq_len"] > 0  # [val]: 3 examples split 1 + 2, gathered
        for k, v in b.items():
            np.testing.assert_allclose(a[k], v, rtol=1e-5, atol=1e-6, err_msg=f"step {a['step']} {k}")

    model_cfg = hf.load_config(tiny_model_dir)
    loras = {}
    for name, cfg in runs.items():
        source = exporter.find_source(f"{url}/{name}", config=cfg)
        assert source.step == STEPS
        loras[name] = exporter.restore_lora(source, model_cfg)
    # Adam moves every element by up to about the learning rate (1e-2) a step, whatever its gradient's
    # size, so an element whose gradient is near zero carries the float differences far (seen: 1e-5).
    # A lost, doubled or misplaced group would move elements by the order of the learning rate.
    for a, b in zip(jax.tree.leaves(loras["two"]), jax.tree.leaves(loras["one"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def test_two_processes_async_keep_the_bound_resume_after_both_are_killed_and_stop_together(
        tmp_path, tiny_model_dir):
    """max_async_level = 2, oversampling_factor = 2, an engine per process: both processes SIGKILLed after
    step 1, started again (they resume from the last checkpoint, the groups it had in flight played
    again), then SIGTERM to process 1 only after step 2: both stop after the same step, checkpointed.
    No trained token lags its step by more than 2 policy versions (`async/staleness_max`, from the
    versions every sampled token recorded), and generation did overlap training (a lag of 1)."""
    # 16 decode slots: every rollout in flight samples at once
    cfg = write_run_config(tmp_path / "rl.toml", tiny_model_dir, name="async", max_steps=6, synchronous=False,
                           extra="max_async_level = 2\noversampling_factor = 2.0", decode_slots=16,
                           tables="[buffer]\nskip_verification = true")
    ckpt_dir = str(tmp_path / "runs" / "async" / "checkpoints")
    procs = _pair(cfg, tmp_path, "killed")
    try:
        wait_for(procs[0], tmp_path / "killed-0.log", "step    1 ", timeout=1200)
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        assert [proc.wait(60) for proc in procs] == [-signal.SIGKILL] * 2
        after_kill = Checkpointer(ckpt_dir, read_only=True).latest_step() or 0

        procs = _pair(cfg, tmp_path, "stopped")
        log = tmp_path / "stopped-0.log"
        if after_kill:
            wait_for(procs[0], log, f"resuming from checkpoint step {after_kill}", timeout=1200)
        wait_for(procs[0], log, "step    2 ", timeout=1200)
        procs[1].send_signal(signal.SIGTERM)
        (code0, out0), (code1, out1) = (finish(proc, tmp_path / f"stopped-{pid}.log") for pid, proc in enumerate(procs))
    finally:
        for proc in procs:
            proc.kill()
    assert (code0, code1) == (143, 143), out0 + out1
    stopped_at = int(out0.split("a signal to another host: stopped after step ")[1].split(";")[0])
    assert 2 <= stopped_at < 6
    meta = Checkpointer(ckpt_dir, read_only=True).read_meta(stopped_at)
    assert meta["step"] == stopped_at and meta["producer"]["in_flight"]  # the groups then in flight, listed

    rows = read_metrics(tmp_path / "runs" / "async")
    assert [r["step"] for r in rows] == list(range(1, stopped_at + 1))
    for r in rows:
        assert r["rollouts/failed"] == 0 and r["train/samples"] == 8
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 2  # max_async_level
        assert r["async/stale_dropped"] % 4 == 0  # whole groups
    assert max(r["async/staleness_max"] for r in rows) >= 1  # trained on tokens of an older policy
