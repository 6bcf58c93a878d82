"""Write the tool example's SFT data: `configs/data/sft_tools.jsonl`, one conversation per task of the
`jaxrl/tool-lookup` train split (its default 100; never its eval split) in Qwen3's tool-call format:

    user:      What is the code of kalo?
    assistant: <tool_call>\\n{"name": "lookup", "arguments": {"name": "kalo"}}\\n</tool_call>
    tool:      169
    assistant: 169
    user:      Thanks.

Each line carries `tools`, the `lookup` tool as the environments advertise it (the classic ToolEnv's schema
on even lines, the MCP server's on odd ones: both flavours of the task train from this data), so the chat
template renders the same `<tools>` system turn the rollouts' prompts hold. The closing user turn is there
because Qwen3's template gives the last assistant turn after the last user message an empty
`<think>\\n\\n</think>\\n\\n`, which an RL prompt with thinking left on (`configs/rl_tools.toml`) does not hold:
with it, every reply renders as `<|im_start|>assistant\\n` + the reply, as RL samples it.

    python scripts/make_sft_tools.py [--out FILE]

configs/sft_tools.toml trains on it (`jaxrl sft`); configs/rl_tools.toml then runs RL from its checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tool_lookup.corpus import CORPUS, QUESTION, split

DESCRIPTION = "Looks a name up in the corpus and returns its three-digit code."
# `lookup` as verifiers' classic client sends it (convert_func_to_tool_def, then to_native_tool) ...
CLASSIC_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": DESCRIPTION,
    "parameters": {"properties": {"name": {"description": "the entry's name, e.g. \"kalo\".", "title": "Name",
                                           "type": "string"}},
                   "required": ["name"], "title": "lookup_args", "type": "object", "additionalProperties": False},
    "strict": True}}
# ... and as jaxrl's chat harness lists it from the MCP server (FastMCP's input schema).
MCP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": DESCRIPTION,
    "parameters": {"properties": {"name": {"title": "Name", "type": "string"}}, "required": ["name"],
                   "title": "lookupArguments", "type": "object"}}}
CALL = '<tool_call>\n{{"name": "lookup", "arguments": {{"name": "{}"}}}}\n</tool_call>'


def rows(num_train: int = 100, num_eval: int = 20) -> list[dict]:
    """The conversations of the train split (as `tool_lookup.load_environment` splits the corpus)."""
    train, _ = split(num_train, num_eval)
    return [{"messages": [{"role": "user", "content": QUESTION.format(name=name)},
                          {"role": "assistant", "content": CALL.format(name)},
                          {"role": "tool", "content": CORPUS[name]},
                          {"role": "assistant", "content": CORPUS[name]},
                          {"role": "user", "content": "Thanks."}],
             "tools": [(CLASSIC_TOOL, MCP_TOOL)[i % 2]]} for i, name in enumerate(train)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[1] / "configs/data/sft_tools.jsonl"
    parser.add_argument("--out", type=Path, default=default, help=f"output file (default: {default})")
    args = parser.parse_args()
    data = rows()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    print(f"wrote {len(data)} conversations to {args.out}")


if __name__ == "__main__":
    main()
