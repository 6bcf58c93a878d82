"""The shipped tool example at tiny shapes, through the real CLI: `jaxrl sft configs/sft_tools.toml` (60 steps, a
deliberately partial start: the tiny random Qwen3 calls the tool in about half its replies) teaches Qwen3's
tool-call format, then `jaxrl run configs/rl_tools.toml` trains from its checkpoint on the classic ToolEnv
(`jaxrl/tool-lookup`) and the v1 MCP taskset (`jaxrl/tool-lookup-mcp`) at once, each env in at least 2 of its 6
steps, and raises the eval reward (the eval split: names never trained on) above the SFT start's, with the
tool-call rate reported before and after. docs/tools.md has the full example's figures."""

import importlib.util
import json
import math

from helpers import REPO, jaxrl, read_metrics, shrink

ENVS = ("jaxrl/tool-lookup", "jaxrl/tool-lookup-mcp")
EVAL = "eval/jaxrl/tool-lookup/"


def test_the_shipped_data_is_what_the_script_writes():
    spec = importlib.util.spec_from_file_location("make_sft_tools", REPO / "scripts" / "make_sft_tools.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    lines = (REPO / "configs" / "data" / "sft_tools.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == script.rows()


def test_sft_then_rl_on_both_tool_envs_raises_the_eval_reward(tmp_path, tiny_model_dir):
    where = [('model_path = "../assets/qwen3-tiny"', f'model_path = "{tiny_model_dir}"\noutput_dir = "{tmp_path}"')]
    # The SFT run as shipped, without its [eval] (it would compile the engine): the RL run's step-0 eval plays
    # the SFT'd start, with the same seeds as its last eval.
    sft = shrink((REPO / "configs" / "sft_tools.toml").read_text(), where + [
        ('data = "data/sft_tools.jsonl"', f'data = "{REPO / "configs" / "data" / "sft_tools.jsonl"}"'),
        ('[eval]\ninterval = 60\nnum_examples = 20\neval_base_model = true\n\n[[eval.env]]\nid = "jaxrl/tool-lookup"\n',
         "")])
    (tmp_path / "sft.toml").write_text(sft)
    done = jaxrl("sft", tmp_path / "sft.toml", timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sft_rows = read_metrics(tmp_path / "sft-tools")
    assert sft_rows[-1]["step"] == 60 and sft_rows[-1]["loss"] < sft_rows[0]["loss"] / 5

    rl = shrink((REPO / "configs" / "rl_tools.toml").read_text(), where + [
        ("max_steps = 10", "max_steps = 6"), ("[eval]\ninterval = 10", "[eval]\ninterval = 6"),
        ("[checkpoints]\ninterval = 5", "[checkpoints]\ninterval = 6"), ("batch_size = 32", "batch_size = 16"),
        ("rollouts_per_example = 8", "rollouts_per_example = 4")])
    (tmp_path / "rl.toml").write_text(rl)
    done = jaxrl("run", tmp_path / "rl.toml", timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = read_metrics(tmp_path / "rl-tools")
    assert [r["step"] for r in rows] == list(range(7))
    start, end = rows[0], rows[-1]
    print(f"eval reward {start[EVAL + 'reward/mean']:.3f} -> {end[EVAL + 'reward/mean']:.3f}, tool-call rate "
          f"{start[EVAL + 'tool_call_rate']:.2f} -> {end[EVAL + 'tool_call_rate']:.2f}")
    # The SFT'd start calls the tool in part of its replies (the random model never does: docs/tools.md), so the
    # groups' rewards differ and RL has something to raise: more well-formed calls.
    assert start[EVAL + "reward/mean"] > 0 and 0.2 < start[EVAL + "tool_call_rate"] < 0.8
    assert end[EVAL + "reward/mean"] > start[EVAL + "reward/mean"]
    assert end[EVAL + "tool_call_rate"] > start[EVAL + "tool_call_rate"]
    for row in rows[1:]:  # a rare empty reply fails its classic rollout (verifiers' client refuses it)
        assert row["rollouts/failed"] <= 2 and math.isfinite(row["loss"]) and row["turns"] > 1
    for env in ENVS:  # each step's groups are drawn from both envs: each trains in at least 2 steps
        trained = [row for row in rows[1:] if f"tool_call_rate/{env}" in row]
        assert len(trained) >= 2, (env, len(trained))
        assert sum(r[f"tool_call_rate/{env}"] for r in trained) / len(trained) > 0.2, env
