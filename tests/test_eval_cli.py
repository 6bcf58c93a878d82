"""`jaxrl eval run`: a shipped environment played against the tiny model served in process, its saved
`results.jsonl` re-read and summarised as the seeds' snippet does, and bad flags refused in one line."""

import json

import numpy as np
import pytest
from helpers import jaxrl
from typer.testing import CliRunner

from jaxrl.cli.main import app


def test_eval_run_saves_rows_whose_summary_matches(tiny_model_dir, tmp_path):
    out = tmp_path / "eval"
    r = jaxrl("eval", "run", "jaxrl/lowercase", "-m", tiny_model_dir, "-n", "3", "-r", "3", "-s", "-o", out,
              "-S", '{"max_tokens": 8, "seed": 3}', "--seq-len", "640", "--decode-slots", "4", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 9 and {(r["example_id"], r["rollout_idx"]) for r in rows} == {(e, i) for e in range(3)
                                                                                        for i in range(3)}
    assert all(r["prompt"][-1]["role"] == "user" and r["completion"][0]["role"] == "assistant" for r in rows)
    assert all(r["metrics"]["lowercase_fraction"] == r["reward"] for r in rows if r["error"] is None)
    # The seeds' snippet (training-options-and-best-practices: "Before Training"): rewards grouped by example.
    examples: dict[int, list[float]] = {}
    for row in rows:
        examples.setdefault(row["example_id"], []).append(row["reward"])
    stds = {ex: float(np.std(rewards)) for ex, rewards in examples.items()}
    summary = json.loads((out / "metadata.json").read_text())["summary"]
    assert summary["reward_mean"] == pytest.approx(np.mean([row["reward"] for row in rows]))
    assert {int(k): v for k, v in summary["example_std"].items()} == pytest.approx(stds)
    flat = sum(s == 0.0 for s in stds.values())
    assert summary["no_diversity"] == pytest.approx(flat / 3)
    assert f"reward mean {summary['reward_mean']:.4f}" in r.stdout
    assert f"no reward diversity (all rollouts of the example scored alike): {flat}/3 examples" in r.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["-a", "{not json"], "--env-args: not JSON"),
    (["-S", '{"temprature": 1}'], "--sampling-args: temprature: Extra inputs are not permitted"),
    (["-n", "0"], "--num-examples must be -1 (all) or >= 1, got 0"),
    (["-m", "no/such-model"], "is not a local model folder"),
])
def test_eval_run_refuses_bad_flags_in_one_line(tiny_model_dir, args, message):
    r = CliRunner().invoke(app, ["eval", "run", "jaxrl/lowercase", "-m", str(tiny_model_dir), *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize("env_id", ["jaxrl/lowercase", "jaxrl/echo-word"])
def test_eval_plays_through_a_remote_endpoint(recording_server, env_id):
    """The endpoint path (no local tokenizer: v1 through verifiers' eval client, classic through its chat
    client), against the session's real rollout server standing in for a remote one."""
    import asyncio

    from jaxrl.config.schema import SamplingConfig
    from jaxrl.envs import loader
    from jaxrl.evaluation import play, report
    from jaxrl.evaluation.endpoint import Endpoint

    handle, _ = recording_server
    env = loader.load_env(env_id)
    rows = asyncio.run(play.play(env, play.examples(env, 2), 2, Endpoint(handle.base_url, "policy"),
                                 SamplingConfig(max_tokens=4, seed=1), 4, 160))
    assert [(r.example_id, r.rollout_idx) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r.error is None and 0.0 <= r.reward <= 1.0 and r.completion for r in rows), rows
    assert report.summarise(rows).num_examples == 2


def test_eval_run_takes_a_run_config(recording_server, tmp_path):
    """A jaxrl run config: its [[env]] (with args) and [sampling], -S overriding a key; here on the session's
    server as an endpoint (-b), so no model loads. Without -m, an environment id is refused."""
    handle, _ = recording_server
    r = CliRunner().invoke(app, ["eval", "run", "configs/quickstart.toml", "-b", handle.base_url, "-m", "policy",
                                 "-n", "2", "-r", "2", "-o", str(tmp_path), "-S", '{"max_tokens": 3}'])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["env_id"] == "jaxrl/lowercase" and meta["sampling_args"]["max_tokens"] == 3
    assert meta["sampling_args"]["temperature"] == 1.0
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4
    r = CliRunner().invoke(app, ["eval", "run", "jaxrl/lowercase"])
    assert r.exit_code == 2 and r.output.strip() == "--model / -m is required with an environment id", r.output


def test_eval_run_against_an_endpoint_that_is_down_is_one_line():
    """Nothing listens on port 9: the eval stops before its first rollout, in one line naming the URL."""
    r = CliRunner().invoke(app, ["eval", "run", "jaxrl/reverse-text", "-m", "tiny", "-b", "http://127.0.0.1:9/v1",
                                 "-n", "2", "-r", "2"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().startswith("jaxrl eval run: http://127.0.0.1:9/v1: the endpoint cannot be reached ("), \
        r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize("env_id", ["jaxrl/lowercase", "jaxrl/echo-word"])
def test_eval_run_where_every_rollout_failed_exits_1_and_saves_why(recording_server, tmp_path, env_id):
    """A model the (real, running) server does not serve: every rollout gets its 404. The eval exits 1 with one
    line on stderr (no mean reward over nothing), and each saved row holds the example's prompt and the error."""
    handle, _ = recording_server
    r = CliRunner().invoke(app, ["eval", "run", env_id, "-b", handle.base_url, "-m", "not-served", "-n", "2",
                                 "-r", "2", "-o", str(tmp_path), "-S", '{"max_tokens": 3}'])
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{env_id}: 2 examples"), r.output  # the header, then the error
    assert lines[1].startswith(f"jaxrl eval run: {env_id}: every rollout failed (4 of 4 rollouts failed (100%)); "
                               "first error: "), r.output
    assert "'not-served' does not exist" in lines[1] and str(tmp_path / "results.jsonl") in lines[1], r.output
    assert "reward mean" not in r.output
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all("'not-served' does not exist" in row["error"] for row in rows), rows
    assert all(row["prompt"] and row["prompt"][-1]["role"] == "user" and row["prompt"][-1]["content"]
               for row in rows), rows
    assert json.loads((tmp_path / "metadata.json").read_text())["summary"]["failed"] == 4


def test_the_summary_reports_the_share_of_failed_rollouts():
    from jaxrl.evaluation import report
    from jaxrl.evaluation.play import Row

    rows = [Row(e, i, [], [], reward, {}, False, error) for e, i, reward, error in
            [(0, 0, 1.0, None), (0, 1, 0.0, "boom"), (1, 0, 0.5, None), (1, 1, 0.5, None)]]
    summary = report.summarise(rows)
    assert (summary.failed, summary.rollouts, summary.all_failed) == (1, 4, False)
    assert report.lines(summary)[0] == ("reward mean 0.5000 (std 0.3536) over 2 examples x 2 rollouts; 1 of 4 "
                                        "rollouts failed (25%)")
    assert "failed" not in report.lines(report.summarise(rows[2:]))[0]
