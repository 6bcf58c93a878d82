"""OpenAI tool calling on `/v1/chat/completions`, as vLLM's `hermes` tool parser does it for Qwen3.

Request: `tools` (`[{"type": "function", "function": {"name", "description"?, "parameters"?}}]`) go to the
chat template, which lists them in the system turn (Qwen3's `<tools></tools>`). `tool_choice`:

- "auto" (the default): the reply is parsed for tool calls.
- "none": the tools are still rendered (vLLM's default) and the reply is text, never parsed.
- "required", or `{"type": "function", "function": {"name": N}}`: this engine has no guided decoding
  (vLLM constrains the whole reply to a JSON schema), so what is enforced is how the reply begins: the
  assistant's turn is opened with `<tool_call>\n{"name": "` (required) or `<tool_call>\n{"name": "N",
  "arguments": ` (named). That text is part of the prompt ids (masked out in training), never of the
  sampled ones; the rest (valid JSON, the arguments' schema) is sampled freely and parsed as with "auto".

The legacy `functions` / `function_call` fields are refused (400).

Reply (`parse_reply`): every `<tool_call>...</tool_call>` block (an unclosed last block included, as
vLLM's regex reads it) must hold a JSON object with a string `name` and an `arguments` value; then
`content` is the text before the first block (None when empty) and each block becomes an OpenAI tool call
`{"id": "call_<24 hex>", "type": "function", "function": {"name", "arguments": <JSON text>}}`, with
finish_reason "tool_calls". One malformed block and the whole reply stays text in `content` (vLLM's rule).

Token for token: Qwen3's template renders an assistant turn as `content`, then per call `"\n"` (unless it
is the first call and content is empty), `<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>`.
So `content` drops one newline before the first block, and `arguments` is the block's own JSON text when
the block is written that way (else `json.dumps(arguments, ensure_ascii=False)`, vLLM's choice): a reply in
the template's format, sent back in the history, renders to the very tokens that were sampled, and a
multi-turn rollout stays one sample (`jaxrl.envs.classic.chain_turns`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxrl.inference.wire import BadRequest

TOOL_CALL_START = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
# A block written as Qwen3's template writes one: group 1 the name's JSON string body, group 2 the arguments' text.
_TEMPLATE_BLOCK = re.compile(r'\n\{"name": "((?:[^"\\\n]|\\.)*)", "arguments": (.*)\}\n\Z', re.DOTALL)
_CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a request's `tools` and `tool_choice` ask of the route.

    tools: passed to the chat template (None: no tools). parse: parse the reply for tool calls.
    forced: text appended to the rendered prompt ("" unless tool_choice is "required" or named).
    """

    tools: list[dict] | None = None
    parse: bool = False
    forced: str = ""


def plan(body: dict[str, Any]) -> ToolPlan:
    """Validates `tools`, `tool_choice`, `functions` and `function_call`; raises `BadRequest` naming the field."""
    for key in ("functions", "function_call"):
        if body.get(key) is not None and body[key] not in ("none", "auto"):
            raise BadRequest(f"{key} (OpenAI's legacy function calling) is not supported; send tools and tool_choice",
                             param=key)
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of objects", param="tools")
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                             param=f"tools.[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}].function.name must be a non-empty string", param=f"tools.[{i}].function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON Schema object",
                             param=f"tools.[{i}].function.parameters")
        names.append(fn["name"])
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise BadRequest('tool_choice must be "none", "auto", "required" or {"type": "function", '
                             '"function": {"name": ...}}', param="tool_choice")
        if name not in names:
            raise BadRequest(f"tool_choice names function {name!r}, which is not among tools", param="tool_choice")
        return ToolPlan(tools, True, f'{TOOL_CALL_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, '
                                     '"arguments": ')
    if choice not in _CHOICES:
        raise BadRequest(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                         param="tool_choice")
    if choice != "none" and not tools:
        raise BadRequest(f"tool_choice={choice!r} needs tools", param="tool_choice")
    if choice == "required":
        return ToolPlan(tools, True, f'{TOOL_CALL_START}\n{{"name": "')
    return ToolPlan(tools or None, choice == "auto")


@dataclasses.dataclass(frozen=True)
class ParsedReply:
    """A reply that called tools: `content` the text before the first call (None when empty), `tool_calls`
    OpenAI's `message.tool_calls` entries."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_reply(text: str) -> ParsedReply | None:
    """The tool calls in a reply's text (module docstring); None when it holds no `<tool_call>` or a malformed
    block, the reply being plain text then. Never raises."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return None
    calls = []
    for match in _BLOCK.finditer(text, start):
        call = _tool_call(match.group(1) if match.group(1) is not None else match.group(2))
        if call is None:
            return None
        calls.append(call)
    content = text[:start]
    content = content[:-1] if content.endswith("\n") else content
    return ParsedReply(content or None, calls)


def _tool_call(inner: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"] or "arguments" not in obj:
        return None
    arguments = json.dumps(obj["arguments"], ensure_ascii=False)
    exact = _TEMPLATE_BLOCK.match(inner)
    if exact is not None and _loads(f'"{exact.group(1)}"') == obj["name"] \
            and _loads(exact.group(2)) == obj["arguments"]:
        arguments = exact.group(2)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


_MISSING = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _MISSING


class ContentHold:
    """While streaming a reply that may call tools: the content that is safe to send. Text is sent as it
    comes, except a tail that could begin `"\\n<tool_call>"`; from the first `<tool_call>` on nothing
    more is sent (the calls are parsed once the reply is complete, and sent whole: one delta per call).
    `text` is what the stream has received, `sent` how many of its characters were sent as content."""

    _MARK = "\n" + TOOL_CALL_START

    def __init__(self, forced: str = "") -> None:
        self.text = forced
        self.sent = 0
        self.calling = TOOL_CALL_START in forced

    def add(self, new: str) -> str:
        """Appends `new`; returns the content that may be sent now."""
        self.text += new
        if self.calling or TOOL_CALL_START in self.text[max(0, self.sent - len(TOOL_CALL_START)):]:
            self.calling = True
            return ""
        end = len(self.text)
        for k in range(min(len(self._MARK), len(self.text) - self.sent), 0, -1):
            if self._MARK.startswith(self.text[-k:]) or TOOL_CALL_START.startswith(self.text[-k:]):
                end -= k
                break
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out
