"""The main job end to end, through the real CLI in a subprocess: tiny Qwen3, a shipped verifiers
environment, the in-process rollout server, LoRA training, checkpoints and resume, the PEFT adapters a run
writes. (That the quickstart learns: tests/test_quickstart.py, a file of its own so that its long run can go to
the other worker.)"""

import math
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from helpers import REPO, jaxrl, read_metrics, write_run_config

from jaxrl.model import assets, hf, hf_lora


def _config(tmp_path: Path, model: Path, *, max_steps: int, jax_extra: str = "", sampling: str = "",
            tables: str = "") -> Path:
    return write_run_config(tmp_path / "rl.toml", model, max_steps=max_steps, checkpoint_interval=2,
                            jax_extra=jax_extra, sampling=sampling, tables=tables)


ADAPTERS = "[adapters]\ninterval = 1\nkeep_last = 1\n"


def test_run_trains_checkpoints_and_resumes(tmp_path, tiny_model_dir):
    """3 steps on 2 devices with checkpoints every 2 steps and `[adapters] interval = 1, keep_last = 1`; run
    again (already complete); then resumed to 5 steps. After the first run only `adapters/step_3` is left,
    and it holds the LoRA of checkpoint 3, as `jaxrl export --adapter` writes it from there."""
    cfg = _config(tmp_path, tiny_model_dir, max_steps=3, tables=ADAPTERS)
    first = jaxrl("run", str(cfg), devices=2)  # all-1 mesh -> fsdp=2: the restore is sharded
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = tmp_path / "runs" / "e2e"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["rollouts/failed"] == 0
        assert r["seq_len"] > 8 and r["tokens_per_s"] > 0 and abs(r["policy/kl"]) < 1e-3
        assert r["async/staleness_max"] == 0 and r["async/in_flight"] == 0  # synchronous: nothing ahead
        # the environments' own seconds (scoring, the harness), the engine's excluded, and the LoRA's hand-over
        assert 0 < r["time/env_per_rollout"] <= r["time/env"] and r["time/weight_update"] > 0
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [2, 3]
    _check_adapters(first.stdout, run_dir, tmp_path / "exported", tiny_model_dir)

    again = jaxrl("run", str(cfg), devices=2)  # same run, already complete
    assert again.returncode == 0 and "already complete" in again.stdout

    cfg = _config(tmp_path, tiny_model_dir, max_steps=5, tables=ADAPTERS)
    resumed = jaxrl("run", str(cfg), devices=2)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from checkpoint step 3" in resumed.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]


def _check_adapters(log: str, run_dir: Path, out: Path, model: Path) -> None:
    """The run wrote its PEFT adapter each step and kept the last only (`adapters/step_3`), and that adapter
    is bit for bit what `jaxrl export --adapter` writes from the run's last checkpoint (3), trained (some
    lora_B non-zero), with an A and a B for each of the 7 targets of each layer."""
    from typer.testing import CliRunner

    from jaxrl.cli.main import app

    assert f"PEFT adapters in {run_dir / 'adapters'}" in log
    assert sorted(p.name for p in (run_dir / "adapters").iterdir()) == ["step_3"]
    result = CliRunner().invoke(app, ["export", str(run_dir), "--out", str(out), "--adapter"])
    assert result.exit_code == 0, result.output
    written = safetensors.numpy.load_file(run_dir / "adapters" / "step_3" / hf_lora.ADAPTER_WEIGHTS)
    exported = safetensors.numpy.load_file(out / hf_lora.ADAPTER_WEIGHTS)
    assert written.keys() == exported.keys() and len(written) == 2 * 7 * hf.load_config(model).num_layers
    for k, v in written.items():
        np.testing.assert_array_equal(v, exported[k])
    assert any(np.any(v != 0) for k, v in written.items() if "lora_B" in k)  # trained, not the fresh LoRA


def test_run_refuses_a_missing_model_without_traceback(tmp_path):
    cfg = _config(tmp_path, tmp_path / "nowhere", max_steps=1)
    out = jaxrl("run", str(cfg))
    assert out.returncode == 2
    assert "jax.model_path" in out.stderr + out.stdout and "Traceback" not in out.stderr + out.stdout


def test_moe_run_with_expert_parallelism(tmp_path):
    """The main job on a tiny Qwen3-MoE with 2-way expert parallelism trains, checkpoints and logs."""
    moe_dir = assets.ensure_tiny_assets(REPO / "assets", moe=True).resolve()
    cfg = _config(tmp_path, moe_dir, max_steps=2, jax_extra="mesh = { expert = 2 }")
    proc = jaxrl("run", str(cfg), devices=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'expert': 2" in proc.stdout
    rows = read_metrics(tmp_path / "runs" / "e2e")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["optim/grad_norm"] > 0 for r in rows)
    assert (tmp_path / "runs" / "e2e" / "checkpoints" / "2").is_dir()


def test_run_with_training_knobs_on_a_2x2x2_mesh(tmp_path, tiny_model_dir):
    """A 2-step run on a data x fsdp x tensor = 2 x 2 x 2 mesh of 8 devices with every [jax] training table set
    away from its default: the PPO loss with clip-higher, dual clip, a k3 KL penalty and an entropy bonus,
    GRPO's std-normalised advantages with reward clipping, and a linear decay logged as optim/lr; and [sampling]
    min_tokens (through the real rollout client) with a temperature schedule: the rollouts of step 1 sample at
    1.5 and are trained at 1.5 (the engine's and the trainer's logprobs agree before any update), those of step
    2 at 0.5. (One run for both, the mesh's and the knobs', to start one subprocess instead of two.)"""
    knobs = """mesh = { data = 2, fsdp = 2, tensor = 2 }
[jax.loss]
type = "ppo"
clip_high = 1.28
dual_clip = 3.0
aggregation = "sequence_mean"
kl_coef = 0.05
entropy_coef = 1e-3

[jax.advantage]
estimator = "std"
reward_min = 0.0
reward_max = 1.0

[jax.optim]
schedule = "linear"
weight_decay = 0.01

[sampling.temp_scheduler]
start_temperature = 1.5
end_temperature = 0.5
"""
    cfg = _config(tmp_path, tiny_model_dir, max_steps=2, jax_extra=knobs, sampling="min_tokens = 2")
    out = jaxrl("run", str(cfg), devices=8)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "'data': 2, 'fsdp': 2, 'tensor': 2" in out.stdout
    rows = read_metrics(tmp_path / "runs" / "e2e")
    assert [r["optim/lr"] for r in rows] == pytest.approx([1e-2, 5e-3])
    assert [r["sampling/temperature"] for r in rows] == [1.5, 0.5] and rows[0]["policy/kl"] < 1e-3
    assert all(r["rollouts/failed"] == 0 and r["seq_len"] > 2 for r in rows)
    assert rows[0]["policy/ref_kl"] == 0.0 and rows[1]["policy/ref_kl"] >= 0.0  # LoRA starts as the base
    assert all(math.isfinite(r["loss"]) for r in rows)
