"""`jaxrl run` multi-host with generation overlapping training, for real: 2 processes x 4 emulated CPU devices
joined on 127.0.0.1 through the JAX_* variables, `max_async_level = 2`, `oversampling_factor = 2`, an engine per
process, killed, resumed and stopped. (The synchronous run on 2 processes against 1: tests/test_distributed_run.py.)"""

import signal

from helpers import finish, read_metrics, start_pair, wait_for, write_run_config

from jaxrl.run.checkpoint import Checkpointer


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
    procs = start_pair(cfg, tmp_path, "killed")
    try:
        wait_for(procs[0], tmp_path / "killed-0.log", "step    1 ", timeout=1200)
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        assert [proc.wait(60) for proc in procs] == [-signal.SIGKILL] * 2
        after_kill = Checkpointer(ckpt_dir, read_only=True).latest_step() or 0

        procs = start_pair(cfg, tmp_path, "stopped")
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
