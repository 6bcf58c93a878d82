"""Generation overlapping training (`max_async_level`, `oversampling_factor`) in a real run: the tiny
Qwen3, the lowercase environment, through the CLI in a subprocess. The producer's rules themselves are
tested in test_producer.py; the synchronous mode by every other run test (they pin max_async_level = 0)."""

from helpers import jaxrl, read_metrics, write_run_config


def test_async_run_trains_on_older_policy_tokens_keeps_the_oversampled_rollouts_in_flight_and_resumes(
        tmp_path, tiny_model_dir):
    def config(max_steps):
        # 16 decode slots: every rollout in flight samples at once, so the second step's groups were
        # sampled (at least in part) by policy 0 while step 1 trained.
        return write_run_config(tmp_path / "rl.toml", tiny_model_dir, max_steps=max_steps, checkpoint_interval=2,
                                synchronous=False, extra="max_async_level = 2\noversampling_factor = 2.0",
                                decode_slots=16)

    first = jaxrl("run", str(config(3)))
    assert first.returncode == 0, first.stdout + first.stderr
    rows = read_metrics(tmp_path / "runs" / "e2e")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollouts/failed"] == 0
        if r["step"] < 3:
            assert r["async/in_flight"] == 16  # batch_size 8 x oversampling_factor 2.0
        else:
            assert r["async/in_flight"] <= 8  # what was left: nothing is launched for a step that never runs
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 2  # max_async_level
        assert r["async/stale_dropped"] % 4 == 0  # whole groups
    assert rows[0]["async/staleness_max"] == 0  # step 1: every rollout launched at policy 0
    assert max(r["async/staleness_max"] for r in rows[1:]) >= 1

    resumed = jaxrl("run", str(config(4)))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from checkpoint step 3" in resumed.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "e2e")] == [1, 2, 3, 4]


def test_full_finetuning_at_async_level_1_keeps_the_engines_weights_readable(tmp_path, tiny_model_dir):
    """`[jax] finetune = "full"` with `max_async_level = 1` on one device (float32: the engine's weights need
    no cast, and the engine shares the trainer's mesh): each train step donates the master weights
    (`Trainer._step`, `donate_argnames=("state",)`) while the engine samples the next step's rollouts with
    the weights it was given before, so it must own a copy of them (`Job.engine_params`). A donated buffer
    read by the engine raises "Array has been deleted" in its decode step, failing rollouts (or the run);
    here every rollout of 4 steps succeeds, and some step trains on tokens sampled one policy back, so the
    engine decoded while a step held the weights it had been given. 16 decode slots: all 8 in flight at once."""
    cfg = write_run_config(tmp_path / "rl.toml", tiny_model_dir, name="full", max_steps=4, learning_rate=1e-3,
                           synchronous=False, extra="max_async_level = 1\noversampling_factor = 1.0",
                           max_tokens=32, decode_slots=16, tables="[buffer]\nskip_verification = true\n",
                           jax_extra='finetune = "full"\n')
    cfg.write_text(cfg.read_text().replace("lora_rank = 4\n", ""))
    run = jaxrl("run", str(cfg))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Array has been deleted" not in run.stdout + run.stderr
    rows = read_metrics(tmp_path / "runs" / "full")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollouts/failed"] == 0 for r in rows), rows
    assert all(r["async/staleness_max"] <= 1 for r in rows) and max(r["async/staleness_max"] for r in rows) == 1
