"""`jaxrl run CONFIG --bench` (jaxrl/run/bench.py) through the real CLI in a subprocess, on the tiny Qwen3:
synthetic rollouts, no environment, the engine's and the trainer's throughput, nothing written."""

import json

from helpers import jaxrl, write_run_config

from jaxrl.run.bench import BENCH_STEPS, BenchStep


def test_bench_reports_engine_and_trainer_throughput_and_writes_nothing(tmp_path, tiny_model_dir):
    """Two groups of 4 rollouts, prompts of 128 - 8 = 120 random tokens, exactly 8 tokens sampled each: every
    step's figures (and their median) present and positive, and no run folder, checkpoint or metrics file."""
    cfg = write_run_config(tmp_path / "rl.toml", tiny_model_dir, max_steps=10, checkpoint_interval=1)
    done = jaxrl("run", cfg, "--bench")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["rollouts"], report["prompt_tokens"], report["max_tokens"]) == (8, 120, 8)
    assert len(report["steps"]) == BENCH_STEPS
    for figures in [*report["steps"], report["summary"]]:
        assert set(figures) == set(BenchStep.__dataclass_fields__)
        assert all(v > 0 for v in figures.values()), figures
    assert "bench step 3/3" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rl.toml"]  # no runs/ folder: nothing saved
