"""The shipped tool example at tiny shapes, through the real CLI: `jaxrl sft configs/sft_tools.toml` teaches the tiny
random Qwen3 Qwen3's tool-call format, then `jaxrl run configs/rl_tools.toml` trains from its checkpoint on the
classic ToolEnv (`jaxrl/tool-lookup`) and the v1 MCP taskset (`jaxrl/tool-lookup-mcp`) at once (3 steps): the
SFT'd model calls the tool where the random one never does, both envs train and log turns and tool calls. Whether
RL raises the eval reward is measured on the full example (README, "Tool environments"), not asserted here."""

import importlib.util
import json
import math

from helpers import REPO, jaxrl, read_metrics, shrink

EVAL = "eval/jaxrl/tool-lookup/reward/mean"


def test_the_shipped_data_is_what_the_script_writes():
    spec = importlib.util.spec_from_file_location("make_sft_tools", REPO / "scripts" / "make_sft_tools.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    lines = (REPO / "configs" / "data" / "sft_tools.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == script.rows()


def test_sft_teaches_the_tool_call_format_and_rl_trains_both_tool_envs_from_it(tmp_path, tiny_model_dir):
    where = [('model_path = "../assets/qwen3-tiny"', f'model_path = "{tiny_model_dir}"\noutput_dir = "{tmp_path}"')]
    sft = shrink((REPO / "configs" / "sft_tools.toml").read_text(), where + [
        ('data = "data/sft_tools.jsonl"', f'data = "{REPO / "configs" / "data" / "sft_tools.jsonl"}"'),
        ("max_steps = 80", "max_steps = 60"), ("interval = 80", "interval = 60"),
        ("[checkpoints]\ninterval = 40", "[checkpoints]\ninterval = 60")])
    (tmp_path / "sft.toml").write_text(sft)
    done = jaxrl("sft", tmp_path / "sft.toml", timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sft_rows = read_metrics(tmp_path / "sft-tools")
    start = sft_rows[-1][EVAL]
    assert sft_rows[0][EVAL] == 0 and start > 0  # the random model never calls the tool; the SFT'd one does
    assert sft_rows[-1]["eval/jaxrl/tool-lookup/tool_call_rate"] > 0.2

    rl = shrink((REPO / "configs" / "rl_tools.toml").read_text(), where + [
        ("max_steps = 10", "max_steps = 3"), ("interval = 10", "interval = 3"), ("batch_size = 32", "batch_size = 16"),
        ("rollouts_per_example = 8", "rollouts_per_example = 4")])
    (tmp_path / "rl.toml").write_text(rl)
    done = jaxrl("run", tmp_path / "rl.toml", timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = read_metrics(tmp_path / "rl-tools")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0][EVAL] == start  # the SFT'd start, played again with the same seeds
    for row in rows[1:]:  # a rare empty reply fails its classic rollout (verifiers' client refuses it)
        assert row["rollouts/failed"] <= 2 and math.isfinite(row["loss"]) and row["turns"] > 1
    for env in ("jaxrl/tool-lookup", "jaxrl/tool-lookup-mcp"):  # each step's groups are drawn from both envs
        rates = [row[f"tool_call_rate/{env}"] for row in rows[1:] if f"tool_call_rate/{env}" in row]
        assert rates and sum(rates) / len(rates) > 0.2, (env, rates)
