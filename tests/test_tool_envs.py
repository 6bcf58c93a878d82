"""Tool turns in training: the shipped `jaxrl/tool-lookup` (a classic verifiers ToolEnv) and `jaxrl/tool-lookup-mcp`
(a v1 taskset whose tool is an MCP server in a subprocess) played through a real server whose scripted backend
calls the tool, then answers: one sample per conversation with both replies (tool-call tokens included) masked
in and the tool's answer masked out, a failing tool answered with its error text, turns and tool calls counted;
and the v1 harness's answers to a hanging, an unknown and a garbled tool call. Training through `jaxrl run` is
test_tool_example.py's."""

import asyncio
import importlib.metadata
import importlib.util
import socket
import time

import pytest
from helpers import REPO, Scripted
from tool_lookup.corpus import CORPUS

from jaxrl.envs import mcp_tools
from jaxrl.envs.loader import Rollout, load_env, run_group
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.server import start_server
from jaxrl.inference.template import ChatTemplate

ENVS = ("jaxrl/tool-lookup", "jaxrl/tool-lookup-mcp")
_spec = importlib.util.spec_from_file_location("make_sft_tools", REPO / "scripts" / "make_sft_tools.py")
SFT = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(SFT)
CALL = '<tool_call>\n{{"name": "lookup", "arguments": {{"name": "{}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    template = ChatTemplate.load(tiny_model_dir)
    backend = Scripted(template)
    handle = start_server(backend, chat_template=template)
    yield handle, backend
    handle.stop()


def play(env_id: str, scripted, tiny_model_dir, scripts: list[list[str]]) -> tuple[list[Rollout], list[list[list[int]]],
                                                                                  str]:
    """One rollout of the env's first train task per script of replies (NAME and CODE stand for the task's name
    and code), one after another while the env serves (a v1 env's MCP server starts once); (the rollouts, each
    one's prompts as the backend got them, the name)."""
    handle, backend = scripted
    env = load_env(env_id, {"num_train_examples": 2, "num_eval_examples": 1})
    task = env.tasks[0]
    name = task.input["answer"] if env.classic else task.data.entry
    prompts = []

    async def go():
        out = []
        async with env.serving():
            for replies in scripts:
                backend.replies = [r.replace("NAME", name).replace("CODE", CORPUS[name]) for r in replies]
                backend.prompts = []
                out += await run_group(env, 0, 1, base_url=handle.base_url, model_name=backend.model_name,
                                       tokenizer_path=tiny_model_dir, sampling=SamplingParams(max_tokens=64, seed=0),
                                       enable_thinking=True)  # as configs/rl_tools.toml
                prompts.append(backend.prompts)
        return out

    rollouts = asyncio.run(go())
    assert all(r.ok for r in rollouts), [r.error for r in rollouts]
    return rollouts, prompts, name


def spans(mask: list[bool]) -> list[tuple[int, int]]:
    """The [start, end) runs of True in `mask`."""
    out, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("env_id", ENVS)
def test_tool_calls_train_as_one_sample_and_a_failing_tool_is_answered_with_its_error(env_id, scripted,
                                                                                      tiny_model_dir):
    (called, failed), (prompts, failed_prompts), name = play(
        env_id, scripted, tiny_model_dir, [[CALL.format("NAME"), "CODE"], [CALL.format("nobody"), "I do not know."]])
    tok = scripted[1].template.tokenizer
    assert called.reward == pytest.approx(1.0) and (called.turns, called.tool_calls) == (2, 1)
    # The second turn's prompt extends the first prompt and reply token for token: one sample.
    first, second = prompts
    assert called.token_ids[: len(second)] == second and second[: len(first)] == first
    [(a, b), (c, d)] = spans(called.loss_mask)
    assert tok.decode(called.token_ids[a:b]) == CALL.format(name) + "<|im_end|>"
    assert tok.decode(called.token_ids[c:d]) == CORPUS[name] + "<|im_end|>" and d == len(called.token_ids)
    assert tok.decode(called.token_ids[b:c]) == \
        f"\n<|im_start|>user\n<tool_response>\n{CORPUS[name]}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # The first prompt is what the SFT data (scripts/make_sft_tools.py) renders: the same tools, as advertised.
    tool = SFT.CLASSIC_TOOL if env_id == "jaxrl/tool-lookup" else SFT.MCP_TOOL
    text = tok.apply_chat_template([{"role": "user", "content": f"What is the code of {name}?"}], tools=[tool],
                                   tokenize=False, add_generation_prompt=True)
    if env_id == "jaxrl/tool-lookup" or importlib.metadata.version("mcp").startswith("1."):
        assert first == tok.encode(text, add_special_tokens=False)  # mcp 2 (verifiers 0.4) words its schema anew
    assert called.logprobs[a:b] == [-0.25 - i / 100 for i in range(b - a)]
    # A tool that raises: its error text is the tool's answer, and the rollout goes on.
    answer = tok.decode(failed_prompts[1][len(failed_prompts[0]):])
    assert "no entry named 'nobody'" in answer and (failed.turns, failed.tool_calls) == (2, 1)
    assert failed.reward == pytest.approx(0.25)  # a well-formed call, the wrong name, no code


STATEFUL_ENV = '''
import verifiers as vf
from datasets import Dataset


def lookup(name: str, vault: str) -> str:
    return f"{name} is in {vault}"


class VaultEnv(vf.StatefulToolEnv):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_tool(lookup, args_to_skip=["vault"])

    def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs):
        return {**tool_args, "vault": "vault-7"}


def answered(completion, **kwargs):
    return float(any(m["role"] == "tool" and "vault-7" in m["content"] for m in completion))


def load_environment():
    data = Dataset.from_list([{"question": "Where is kalo?", "answer": ""}])
    return VaultEnv(dataset=data, rubric=vf.Rubric(funcs=[answered]), max_turns=2)
'''


def test_a_stateful_tool_env_injects_its_hidden_argument(scripted, tiny_model_dir, tmp_path, monkeypatch):
    """verifiers' StatefulToolEnv: the model sees `lookup(name)`, the env adds `vault` from its state."""
    (tmp_path / "jaxrl_test_stateful_env.py").write_text(STATEFUL_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    handle, backend = scripted
    env = load_env("someone/jaxrl-test-stateful-env")
    backend.replies, backend.prompts = [CALL.format("kalo"), "Found it."], []
    [rollout] = asyncio.run(run_group(env, 0, 1, base_url=handle.base_url, model_name=backend.model_name,
                                      tokenizer_path=tiny_model_dir, sampling=SamplingParams(max_tokens=64)))
    assert rollout.ok and rollout.reward == 1.0 and (rollout.turns, rollout.tool_calls) == (2, 1), rollout.error
    tok = backend.template.tokenizer
    assert '"name": "lookup"' in tok.decode(backend.prompts[0]) and "vault" not in tok.decode(backend.prompts[0])
    assert len(spans(rollout.loss_mask)) == 2


def test_the_harness_answers_a_hanging_an_unknown_and_a_garbled_tool_call_with_error_text():
    """jaxrl's chat harness (v1 envs): a tool server that accepts the connection and never answers is cut at the
    harness's tool_timeout; an unknown tool and arguments that are not a JSON object are answered, not raised."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/mcp"
        tools = mcp_tools.Tools([], {"slow": (url, "slow")}, timeout=0.5)

        def ask(name: str, arguments: str) -> str:
            call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
            message = asyncio.run(mcp_tools.answer(tools, call))
            assert message["role"] == "tool" and message["tool_call_id"] == "call_1"
            return message["content"]

        start = time.monotonic()
        assert ask("slow", "{}") == "error: tool 'slow' timed out after 0.5 s" and time.monotonic() - start < 5
        assert ask("nope", "{}") == "error: unknown tool 'nope'"
        assert ask("slow", "[1]") == "error: tool arguments must be a JSON object, got list"
        assert ask("slow", "{oops").startswith("error: invalid JSON in tool arguments")
