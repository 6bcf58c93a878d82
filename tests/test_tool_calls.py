"""Tool calling on /v1/chat/completions over a real uvicorn socket, through the official `openai` SDK: tools
rendered by the chat template, `<tool_call>` blocks parsed into `tool_calls` (streaming and not), malformed
blocks kept as text, tool_choice, and a history with tool calls rendered back token for token."""

import json

import httpx
import openai
import pytest
from helpers import Scripted
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl.inference.server import start_server
from jaxrl.inference.template import ChatTemplate
from jaxrl.inference.tools import ContentHold, parse_reply

MODEL = Scripted.model_name
ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
USER = [{"role": "user", "content": "What is 2 + 40?"}]


@pytest.fixture(scope="module")
def template(tiny_model_dir):
    return ChatTemplate.load(tiny_model_dir)


@pytest.fixture(scope="module")
def backend(template):
    return Scripted(template)


@pytest.fixture(scope="module")
def client(backend, template):
    handle = start_server(backend, chat_template=template)
    yield openai.OpenAI(base_url=handle.base_url, api_key="unused", max_retries=0)
    handle.stop()


def ask(client, backend, reply: str, stream: bool = False, **kwargs):
    """One request answered with `reply`: the final ChatCompletion (a stream is accumulated by the SDK's own
    `chat.completions.stream` helper, which checks the tool-call deltas as it goes)."""
    backend.replies = [reply]
    kwargs = {"model": MODEL, "messages": USER, "tools": [ADD], "extra_body": {"return_token_ids": True},
              "logprobs": True, **kwargs}
    if not stream:
        return client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as events:
        for _ in events:
            pass
        return events.get_final_completion()


def test_tools_are_rendered_by_the_chat_template(client, backend, template):
    out = ask(client, backend, "No tool needed.")
    assert out.choices[0].message.content == "No tool needed." and out.choices[0].finish_reason == "stop"
    text = template.tokenizer.apply_chat_template(USER, tools=[ADD], tokenize=False, add_generation_prompt=True)
    assert backend.prompts[-1] == template.tokenizer.encode(text, add_special_tokens=False)
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_block_comes_back_as_tool_calls(client, backend, template, stream):
    out = ask(client, backend, "Adding.\n" + CALL + "\n" + CALL.replace("40", "1"), stream=stream)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Adding."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["add", "add"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"a": 2, "b": 40}, {"a": 2, "b": 1}]
    assert calls[0].function.arguments == '{"a": 2, "b": 40}'  # the block's own text
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert [e.logprob for e in choice.logprobs.content][:2] == [-0.25, -0.26]
    if not stream:
        sampled = template.tokenizer.encode("Adding.\n" + CALL + "\n" + CALL.replace("40", "1"),
                                            add_special_tokens=False)
        assert choice.model_extra["token_ids"] == sampled + [template.stop_token_ids[0]]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reply", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    CALL + "\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": ",  # the second block never closes
    "I use <tool_call without closing",
])
def test_a_malformed_block_stays_text(client, backend, reply, stream):
    out = ask(client, backend, reply, stream=stream)
    assert out.choices[0].message.content == reply and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_tool_choice_none_never_parses_and_required_and_named_open_the_call(client, backend, template):
    out = ask(client, backend, CALL, tool_choice="none")
    assert out.choices[0].message.content == CALL and out.choices[0].finish_reason == "stop"
    base = template.tokenizer.apply_chat_template(USER, tools=[ADD], tokenize=False, add_generation_prompt=True)
    for choice, forced in [("required", '<tool_call>\n{"name": "'),
                           ({"type": "function", "function": {"name": "add"}},
                            '<tool_call>\n{"name": "add", "arguments": ')]:
        for stream in (False, True):
            out = ask(client, backend, CALL[len(forced):], stream=stream, tool_choice=choice)
            assert backend.prompts[-1] == template.tokenizer.encode(base + forced, add_special_tokens=False)
            assert out.choices[0].finish_reason == "tool_calls"
            assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"a": 2, "b": 40}
    r = httpx.post(str(client.base_url) + "chat/completions", json={"messages": USER, "tool_choice": "required"})
    assert r.status_code == 400 and "needs tools" in r.json()["error"]["message"]


def test_a_history_with_tool_calls_renders_back_token_for_token(client, backend, template):
    first = ask(client, backend, "Adding.\n" + CALL)
    message = first.choices[0].message
    history = [*USER, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}]
    second = ask(client, backend, "It is 42.", messages=history)
    assert second.choices[0].message.content == "It is 42."
    prompt, sampled = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    assert backend.prompts[-1][: len(prompt) + len(sampled)] == prompt + sampled  # the turns chain
    text = template.tokenizer.apply_chat_template(history, tools=[ADD], tokenize=False, add_generation_prompt=True)
    assert backend.prompts[-1] == template.tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


_names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
_args = st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=8), st.none()), max_size=3)


@settings(max_examples=40)
@given(st.text(max_size=20).filter(lambda t: "<tool_call>" not in t), st.lists(st.tuples(_names, _args), min_size=1,
                                                                              max_size=3))
def test_a_reply_in_the_templates_format_parses_to_what_renders_it_again(content, calls):
    """What the template renders from (content, calls) parses back to the same content and argument text."""
    blocks = [f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a, ensure_ascii=False)}}}\n</tool_call>'
              for n, a in calls]
    content = content.rstrip("\n")
    text = content + ("\n" if content else "") + "\n".join(blocks)
    parsed = parse_reply(text)
    assert parsed is not None and parsed.content == (content or None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == \
        [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    hold = ContentHold()
    sent = "".join(hold.add(ch) for ch in text)
    assert sent == content[: len(sent)] and hold.calling


@settings(max_examples=40)
@given(st.text(max_size=40).filter(lambda t: "<tool_call>" not in t))
def test_text_without_a_block_is_plain_and_streams_whole(text):
    assert parse_reply(text) is None
    hold = ContentHold()
    sent = "".join(hold.add(ch) for ch in text)
    assert text.startswith(sent) and not hold.calling


CALLED = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'}},
    {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}}]}


def _tool(call_id="call_a", content="42"):
    return {"role": "tool", "content": content} | ({"tool_call_id": call_id} if call_id is not None else {})


@pytest.mark.parametrize(("history", "param", "needle"), [
    ([_tool(), *USER], "messages.[0].role", "is 'tool', but it is first in the conversation"),
    ([*USER, {"role": "assistant", "content": "Hi."}, _tool()], "messages.[2].role",
     "is 'tool', but it follows no assistant message with tool_calls"),
    ([*USER, CALLED, _tool(), {"role": "user", "content": "and?"}, _tool("call_b")], "messages.[4].role",
     "is 'tool', but it follows no assistant message with tool_calls"),  # a call answered once the user spoke again
    ([*USER, CALLED, _tool("call_z")], "messages.[2].tool_call_id",
     "'call_z' is not the id of a call in the tool_calls of the assistant message before it (call_a, call_b)"),
    ([*USER, CALLED, _tool(None)], "messages.[2].tool_call_id", "is required"),
    ([*USER, {"role": "assistant", "content": "", "tool_calls": "oops"}, _tool()], "messages.[1].tool_calls",
     "must be a list of tool call objects, got a string"),
    ([*USER, {"role": "assistant", "content": "", "tool_calls": [{}]}, _tool()], "messages.[1].tool_calls.[0].id",
     "must be a non-empty string, got null"),
    ([*USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}, _tool("c")],
     "messages.[1].tool_calls.[0].function.name", "must be a non-empty string"),
    ([*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "function": {}}]}],
     "messages.[1].tool_calls.[0].type", 'must be "function"'),
    ([*USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "add"}}]}],
     "messages.[1].tool_calls.[0].function.arguments", "must be a JSON string (or an object), got null"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_histories_are_checked_by_openais_rules(client, backend, history, param, needle, stream):
    """Through the SDK: each broken history is a 400 naming the message's index and field (`param` in OpenAI's
    spelling), before the chat template sees it (no jinja UndefinedError)."""
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, backend, "unused", messages=history, stream=stream)
    path = param.replace(".[", "[")
    assert refused.value.status_code == 400 and refused.value.param == param, refused.value
    assert f"{path} {needle}" in refused.value.message and "Undefined" not in refused.value.message, refused.value


def test_a_history_answering_each_call_in_turn_is_served(client, backend, template):
    history = [*USER, CALLED, _tool("call_b", "2"), _tool("call_a", "42")]  # answered in any order
    out = ask(client, backend, "It is 42.", messages=history)
    assert out.choices[0].message.content == "It is 42."
    text = template.tokenizer.apply_chat_template(history, tools=[ADD], tokenize=False, add_generation_prompt=True)
    assert backend.prompts[-1] == template.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.[0].function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.[0].content.[0]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.[0].role"),
    ({"stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options.include_usage"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_every_refusal_names_its_field(client, backend, kwargs, param):
    """A sample of the route's 400s through the SDK: `param` is never null (test_structure-like scan below for
    the rest)."""
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, backend, "unused", **kwargs)
    assert refused.value.param == param, refused.value


def test_every_400_the_server_raises_sets_param():
    """Every `BadRequest` raised in jaxrl's code gives the request field it is about (`param`), unless its
    status is not 400: a new refusal without one fails here."""
    import ast
    from pathlib import Path

    import jaxrl

    missing = []
    for path in sorted(Path(jaxrl.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "BadRequest":
                status = node.args[1] if len(node.args) > 1 else None
                not_400 = isinstance(status, ast.Constant) and status.value != 400
                if not not_400 and len(node.args) < 3 and "param" not in {k.arg for k in node.keywords}:
                    missing.append(f"{path.name}:{node.lineno}")
    assert not missing, missing
