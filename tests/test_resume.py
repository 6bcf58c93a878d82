"""Resume after a crash, for real: `python -m jaxrl run` subprocesses killed with SIGKILL and SIGTERM and
started again, against an uninterrupted run of the same config; and processes killed in the middle of
an Orbax write, locally and on the GCS emulator."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import finish, read_metrics, reproducible, start, subprocess_env, wait_for, write_run_config

from jaxrl.rl.train import TrainState
from jaxrl.run.checkpoint import Checkpointer


@pytest.mark.numerics
def test_killed_and_preempted_run_reproduces_the_uninterrupted_one(tmp_path, tiny_model_dir, gcs):
    """The reference run checkpoints locally; the interrupted one to gs:// (the emulator). SIGKILL lands
    at a random moment after a step is logged (its checkpoint being written, the next step's rollouts
    or train step); SIGTERM makes the run checkpoint and exit 143. The resumed run's metrics equal
    the reference's exactly, step for step, on CPU."""
    seed = int(os.environ.get("JAXRL_TEST_SEED", random.randrange(1 << 16)))
    rng = random.Random(seed)
    print(f"kill timing seed {seed} (set JAXRL_TEST_SEED to replay)")
    steps = 5  # the kill may land a step or two late on a fast machine: SIGTERM must still find a step to cut
    (tmp_path / "ref").mkdir()
    ref_cfg = write_run_config(tmp_path / "ref" / "rl.toml", tiny_model_dir, name="ref", max_steps=steps)
    code, out = finish(start(ref_cfg, tmp_path / "ref.log"), tmp_path / "ref.log")
    assert code == 0, out
    reference = reproducible(read_metrics(tmp_path / "ref" / "runs" / "ref"))
    assert [r["step"] for r in reference] == list(range(1, steps + 1))

    (tmp_path / "cut").mkdir()
    url = "gs://jaxrl-test/resume"
    cfg = write_run_config(tmp_path / "cut" / "rl.toml", tiny_model_dir, name="cut", max_steps=steps,
                           jax_extra=f'checkpoint_dir = "{url}"')
    run_dir = tmp_path / "cut" / "runs" / "cut"

    log = tmp_path / "cut-1.log"  # SIGKILL after step 1 is logged
    proc = start(cfg, log)
    wait_for(proc, log, "step    1 ")
    time.sleep(rng.uniform(0.0, 1.0))
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    ckpt = Checkpointer(f"{url}/cut", read_only=True)
    after_kill = ckpt.latest_step() or 0
    print(f"killed with checkpoints {ckpt.all_steps()}, {len(read_metrics(run_dir))} metrics rows")

    log = tmp_path / "cut-2.log"  # SIGTERM after the next step is logged: checkpoint, exit 143
    proc = start(cfg, log)
    wait_for(proc, log, "resuming from checkpoint" if after_kill else "step    1 ")
    wait_for(proc, log, f"step    {after_kill + 1} ")
    time.sleep(rng.uniform(0.0, 0.5))
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc, log)
    assert code == 143, out
    assert "SIGTERM: stopped after step" in out and "Traceback" not in out
    preempted_at = int(out.split("SIGTERM: stopped after step ")[1].split(";")[0])
    assert after_kill + 1 < steps and preempted_at >= after_kill + 1
    assert Checkpointer(f"{url}/cut", read_only=True).latest_step() == preempted_at

    log = tmp_path / "cut-3.log"
    code, out = finish(start(cfg, log), log)
    assert code == 0, out
    if preempted_at < steps:
        assert f"resuming from checkpoint step {preempted_at}" in out
    assert reproducible(read_metrics(run_dir)) == reference
    assert Checkpointer(f"{url}/cut", read_only=True).all_steps() == list(range(1, steps + 1))
    assert not (run_dir / "checkpoints").exists()  # checkpoints went to gs://, metrics stayed local


WRITER = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    from jaxrl.run.checkpoint import Checkpointer
    from jaxrl.rl.train import TrainState

    def state(value, n):
        return TrainState({"w": jnp.full((n,), value, jnp.float32)}, {"count": jnp.int32(value)}, jnp.int32(value))

    ckpt = Checkpointer(sys.argv[1], keep=-1)
    ckpt.save(1, state(1, 1024), {"step": 1})
    ckpt.wait()
    ckpt.save(2, state(2, 48 * 2**20), {"step": 2})  # 192 MB: long enough to be killed while writing
    print("writing", flush=True)
    ckpt.wait()
    print("written", flush=True)
""")


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_checkpoint_killed_mid_write_is_never_resumed_from(tmp_path, where, request):
    if where == "gcs":
        emulator = request.getfixturevalue("gcs")
        directory, partial = "gs://jaxrl-test/mid-write", lambda: emulator.list_objects(prefix="mid-write/2/")
    else:
        directory = str(tmp_path / "ckpt")
        partial = lambda: [p for p in Path(directory).glob("2.orbax-checkpoint-tmp*")]  # noqa: E731
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    proc = subprocess.Popen([sys.executable, str(script), directory], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env())
    assert proc.stdout.readline().strip() == "writing"
    deadline = time.monotonic() + 60
    while not partial():
        assert proc.poll() is None and time.monotonic() < deadline, "the write never started"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL and "written" not in proc.stdout.read()
    assert partial(), "nothing partial was left behind"

    ckpt = Checkpointer(directory, keep=-1)
    if where == "local":
        assert not partial()  # the leftover temporary folder is gone once the folder is open
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    like = TrainState({"w": jnp.zeros((1024,), jnp.float32)}, {"count": jnp.int32(0)}, jnp.int32(0))
    restored, meta = ckpt.restore(1, like)
    assert meta == {"step": 1} and np.all(np.asarray(restored.lora["w"]) == 1)
    ckpt.save(2, restored, {"step": 2})  # and the step can be written again
    ckpt.close()
    assert Checkpointer(directory, read_only=True).all_steps() == [1, 2]
