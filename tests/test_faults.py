"""Faults, each made real: environments that raise or hang, a GCS that starts answering errors mid-run,
a full disk, a non-finite loss, a missing or corrupt model folder, warm starts from a missing checkpoint
or another model's, and secrets that must not leak. The matrix is in docs/reliability.md."""

import dataclasses
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (
    finish,
    random_batch,
    read_metrics,
    start,
    subprocess_env,
    tiny_model_config,
    tiny_trainer,
    wait_for,
    write_run_config,
)

from jaxrl.config.schema import ConfigError, load_config
from jaxrl.model import hf
from jaxrl.model.modules import init_lora
from jaxrl.parallel.sharding import make_mesh
from jaxrl.rl.rollouts import failure_verdict
from jaxrl.rl.train import Trainer, make_optimizer
from jaxrl.run import runner
from jaxrl.run.checkpoint import Checkpointer
from jaxrl.run.identity import model_identity
from jaxrl.run.redaction import redact, secret_values

REPO = Path(__file__).resolve().parents[1]
SECRET_FILE_VALUE = "sk-live-FILE-5ecret-0123456789"
SECRET_ENV_VALUE = "wandb-ENV-5ecret-abcdef"

# An environment package whose reward fails on purpose: `plan` maps the n-th reward call (1-based,
# over the whole run; call 1 is the pre-flight rollout's) to "raise" or "hang"; calls past `fail_after`
# all raise. Error messages quote secrets, as a careless environment would.
FAULTY_ENV = textwrap.dedent('''
    import asyncio, os
    import verifiers.v1 as vf
    from lowercase.taskset import LowercaseConfig, LowercaseTask, LowercaseTaskset

    CALLS = [0]

    class FaultyConfig(LowercaseConfig):
        plan: dict[str, str] = {}
        fail_after: int = 1_000_000

    class FaultyTask(LowercaseTask):
        @vf.reward(weight=1.0)
        async def lowercase_fraction(self, trace):
            CALLS[0] += 1
            action = "raise" if CALLS[0] > PLAN["fail_after"] else PLAN["plan"].get(str(CALLS[0]))
            if action == "hang":
                await asyncio.sleep(3600)
            if action == "raise":
                raise RuntimeError("reward backend refused key " + os.environ["FAULTY_API_KEY"] + " and "
                                   + os.environ["WANDB_API_KEY"])
            return 1.0

    PLAN = {}

    # The generic base names the config class verifiers validates `args` against.
    class FaultyTaskset(LowercaseTaskset, vf.Taskset[FaultyTask, FaultyConfig]):
        def load(self):
            PLAN.update(plan=self.config.plan, fail_after=self.config.fail_after)
            for task in super().load():
                yield FaultyTask(task.data, self.config.task)

    __all__ = ["FaultyTaskset"]
''')


def _faulty_env_path(tmp_path: Path) -> Path:
    where = tmp_path / "envpkgs"
    where.mkdir(exist_ok=True)
    (where / "faulty_env.py").write_text(FAULTY_ENV)
    return where


def _leaks(root: Path, text: str) -> list[str]:
    """Files under `root` and the text that contain a secret value."""
    found = [f"output contains {s}" for s in (SECRET_FILE_VALUE, SECRET_ENV_VALUE) if s in text]
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path} contains {s}" for s in (SECRET_FILE_VALUE, SECRET_ENV_VALUE) if s.encode() in data]
    return found


def test_failing_and_hanging_rollouts_are_dropped_then_a_mostly_failing_run_stops(tmp_path, tiny_model_dir):
    """Step 1: one reward raises and one hangs past the 3 s rollout timeout; both are dropped and
    counted, training goes on. Step 2: every reward raises; the run stops with the errors, secrets
    redacted, and the checkpoint of step 1 intact."""
    (tmp_path / "secrets.env").write_text(f"FAULTY_API_KEY={SECRET_FILE_VALUE}\n")
    cfg = write_run_config(tmp_path / "rl.toml", tiny_model_dir, name="faulty", max_steps=3,
                           extra='env_file = ["secrets.env"]',
                           env='id = "jaxrl/faulty-env"\n'
                               'args = { plan = { "3" = "raise", "6" = "hang" }, fail_after = 9 }',
                           jax_extra="rollout_timeout = 3.0")
    log = tmp_path / "run.log"
    proc = start(cfg, log, PYTHONPATH=str(_faulty_env_path(tmp_path)), WANDB_API_KEY=SECRET_ENV_VALUE)
    code, out = finish(proc, log)
    assert code == 1, out
    rows = read_metrics(tmp_path / "runs" / "faulty")
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["rollouts/failed"] == 2 and rows[0]["rollouts/timed_out"] == 1 and rows[0]["reward/mean"] == 1.0
    assert "step 1: 2 rollouts failed and were dropped" in out
    assert "step 2: stopping, every rollout of the step failed (8/8)" in out
    assert "RuntimeError: reward backend refused key *** and ***" in out and "Traceback" not in out
    assert Checkpointer(str(tmp_path / "runs" / "faulty" / "checkpoints"), read_only=True).all_steps() == [1]
    assert _leaks(tmp_path / "runs", out) == []


def test_failure_verdict():
    assert failure_verdict([]) is None
    assert failure_verdict([(8, 8)]) == "every rollout of the step failed (8/8)"
    assert failure_verdict([(5, 8), (5, 8)]) is None  # not yet a window
    assert failure_verdict([(5, 8), (4, 8), (4, 8)]) == "13 of the last 24 rollouts (3 steps) failed, more than 50%"
    assert failure_verdict([(8, 8), (0, 8), (4, 8), (4, 8)]) is None  # 12 of 24: not more than half


def test_secrets_are_redacted():
    secrets = secret_values({"X": "value-from-file", "SHORT": "1"}, {"MY_TOKEN": "tok-123456", "PATH": "/usr/bin"})
    assert secrets == ["value-from-file", "tok-123456"]
    assert redact("a value-from-file b tok-123456 /usr/bin 1", secrets) == "a *** b *** /usr/bin 1"


def test_gcs_answering_errors_mid_run_stops_clearly_and_keeps_local_state(tmp_path, tiny_model_dir, gcs, gcs_proxy):
    """A run checkpointing to gs:// (warm-started from a gs:// checkpoint): the storage answers 503 from
    step 2 on; the run retries, then stops naming the step and the URL; metrics stay local."""
    mcfg, base = hf.load_hf(tiny_model_dir)
    seed_ckpt = Checkpointer("gs://jaxrl-test/faults/seed-run", keep=-1)
    seed_ckpt.save(5, _state_for(mcfg, base, rank=4), {"step": 5, "identity": _identity(mcfg)})
    seed_ckpt.close()
    cfg = write_run_config(tmp_path / "rl.toml", tiny_model_dir, name="gcs-down", max_steps=3,
                           extra='checkpoint_id = "gs://jaxrl-test/faults/seed-run/5"',
                           jax_extra='checkpoint_dir = "gs://jaxrl-test/faults"')
    cfg.write_text(cfg.read_text().replace("interval = 1", "interval = 2"))
    log = tmp_path / "run.log"
    proc = start(cfg, log)
    wait_for(proc, log, "step    1 ")
    gcs_proxy.set_mode("error")
    code, out = finish(proc, log)
    assert code == 1, out
    assert "warm start: LoRA of checkpoint step 5 in gs://jaxrl-test/faults/seed-run" in out
    assert re.search(r"cannot save step 2 to gs://jaxrl-test/faults/gcs-down: .*not writable after 4 attempts.*503",
                     out), out
    assert "Traceback" not in out
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "gcs-down")] == [1, 2]


def _state_for(mcfg, base, rank: int):
    mesh = make_mesh({}, jax.devices()[:1])
    trainer = Trainer(mcfg, mesh, make_optimizer(1e-2), lora_scale=1.0)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return trainer.init_state(base, init_lora(mcfg, rank, targets, jax.random.key(3)))


def _identity(mcfg, rank: int = 4) -> dict:
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return model_identity("jaxrl/qwen3-tiny", dataclasses.asdict(mcfg), rank, targets)


def test_warm_start_refuses_a_missing_checkpoint_or_another_models(tmp_path, tiny_model_dir):
    cfg_path = write_run_config(tmp_path / "rl.toml", tiny_model_dir, name="warm", max_steps=1,
                                extra='checkpoint_id = "nope"')
    with pytest.raises(ConfigError, match=r"checkpoint_id: 'nope': no checkpoint in .*/runs/nope/checkpoints"):
        runner.run(load_config(cfg_path))
    mcfg, base = hf.load_hf(tiny_model_dir)
    other = Checkpointer(str(tmp_path / "runs" / "other" / "checkpoints"), keep=-1)
    other.save(2, _state_for(mcfg, base, rank=8), {"step": 2, "identity": _identity(mcfg, rank=8)})
    other.close()
    cfg_path.write_text(cfg_path.read_text().replace('"nope"', '"other/2"'))
    with pytest.raises(ConfigError, match=r"different model or LoRA: lora_rank: checkpoint 8, this run 4"):
        runner.run(load_config(cfg_path))
    cfg_path.write_text(cfg_path.read_text().replace('"other/2"', '"other/7"'))
    with pytest.raises(ConfigError, match=r"no checkpoint for step 7 in .*other/checkpoints \(steps: 2\)"):
        runner.run(load_config(cfg_path))
    # a full fine-tuning checkpoint (every weight, no LoRA) cannot start a LoRA run
    full = Trainer(mcfg, make_mesh({}, jax.devices()[:1]), make_optimizer(1e-2, full=True), lora_scale=0.0, full=True)
    other = Checkpointer(str(tmp_path / "runs" / "full" / "checkpoints"), keep=-1)
    other.save(1, full.init_state(base, None), {"step": 1, "identity": model_identity(
        "jaxrl/qwen3-tiny", dataclasses.asdict(mcfg), 16, (), "full")})
    other.close()
    cfg_path.write_text(cfg_path.read_text().replace('"other/7"', '"full/1"'))
    with pytest.raises(ConfigError, match=r"different model or LoRA: finetune: checkpoint 'full', this run 'lora'"):
        runner.run(load_config(cfg_path))


@pytest.mark.parametrize("damage", ["missing", "truncated weights", "garbage config"])
def test_a_missing_or_corrupt_model_folder_is_a_clear_config_error(tmp_path, tiny_model_dir, damage):
    model = tmp_path / "model"
    if damage != "missing":
        shutil.copytree(tiny_model_dir, model)
        if damage == "truncated weights":
            weights = model / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
        else:
            (model / "config.json").write_text("{not json")
    cfg = load_config(write_run_config(tmp_path / "rl.toml", model, name="bad-model", max_steps=1))
    with pytest.raises(ConfigError, match="jax.model_path") as err:
        runner.run(cfg)
    if damage != "missing":
        assert "cannot load the model from" in str(err.value)


def test_non_finite_loss_or_gradients_skip_the_step_and_keep_weights_finite():
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = tiny_trainer(tiny_model_config(), mesh)
    lora0 = jax.tree.map(np.array, state.lora)
    for bad in ("inf advantage", "huge advantage"):
        batch = random_batch(0)
        batch.advantages[0] = np.inf if bad == "inf advantage" else 3e38
        batch.advantages[1:] = 3e38 if bad == "huge advantage" else batch.advantages[1:]
        state, m = trainer.step(state, base, batch)
        assert float(m["optim/skipped"]) == 1.0, (bad, m)
        assert int(state.step) == 0
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), lora0, state.lora)
    state, m = trainer.step(state, base, random_batch(1))  # a good batch afterwards trains normally
    assert float(m["optim/skipped"]) == 0.0 and int(state.step) == 1
    assert all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(state.lora))


DISK_FILLER = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))  # this process may write no file past 1 MB
    import numpy as np
    import jax.numpy as jnp
    from jaxrl.run.checkpoint import CheckpointError, Checkpointer
    from jaxrl.rl.train import TrainState

    def state(value, n):
        w = np.random.default_rng(value).normal(size=n).astype(np.float32)  # incompressible
        return TrainState({"w": jnp.asarray(w)}, {"count": jnp.int32(value)}, jnp.int32(value))

    ckpt = Checkpointer(sys.argv[1], keep=-1)
    ckpt.save(1, state(1, 256), {"step": 1})
    ckpt.wait()
    try:
        ckpt.save(2, state(2, 2**20), {"step": 2})  # 4 MB: past the file size limit
        ckpt.wait()
    except CheckpointError as exc:
        print("CheckpointError:", exc)
        sys.exit(1)
    print("saved")
""")


def test_a_full_disk_fails_the_checkpoint_clearly_and_keeps_the_previous_one(tmp_path):
    """A full disk, stood in for by RLIMIT_FSIZE (no root, no loop device needed): a write past 1 MB
    fails with EFBIG, as one on a full disk fails with ENOSPC."""
    script = tmp_path / "fill.py"
    script.write_text(DISK_FILLER)
    directory = tmp_path / "ckpt"
    out = subprocess.run([sys.executable, str(script), str(directory)], capture_output=True, text=True,
                         env=subprocess_env(), timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(rf"CheckpointError: cannot save step 2 to {directory}: .*(File too large|No space left)",
                     out.stdout), out.stdout
    assert "(last complete checkpoint: step 1)" in out.stdout
    assert Checkpointer(str(directory), keep=-1).all_steps() == [1]


def test_nothing_unpickles():
    """No module of the package loads pickles (checkpoints are tensorstore arrays and JSON; requests
    are JSON)."""
    pattern = re.compile(r"\bpickle\b|cloudpickle|\bdill\b|allow_pickle\s*=\s*True|torch\.load|joblib\.load")
    offenders = [f"{p.name}:{i}" for p in (REPO / "jaxrl").rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
