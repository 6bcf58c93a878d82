"""A chat completions request's `messages`, checked before the chat template sees them.

Each message is an object with a `role` (system, developer, user, assistant, tool) and text `content` (a
string, a list of text parts, or null); `developer` is read as `system`.

Tool-call histories follow OpenAI's rules for `/v1/chat/completions` (what its API refuses with a 400):

- an assistant message's `tool_calls`, when present, is a list of objects, each with a non-empty string
  `id`, `type` "function" (may be left out), and a `function` object with a non-empty string `name` and
  `arguments` (OpenAI's JSON text; an object is accepted too, as Qwen3's chat template renders either);
- a `tool` message has a string `tool_call_id` naming a call of the assistant message before it (the
  nearest message that is not itself a tool message must be an assistant message with `tool_calls`); so a
  tool message first in the conversation, after a message without calls, or with an id no call has, is
  refused.

jaxrl does not enforce OpenAI's further rule that every call be answered before the next non-tool message
(a harness that drops a call's answer is still rendered); vLLM checks none of these. Each refusal is a
`BadRequest` (400) whose message names the message's index and field (`messages[2].tool_call_id`) and
whose `param` is that path in OpenAI's spelling (`messages.[2].tool_call_id`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.inference.wire import BadRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def refuse(path: str, problem: str) -> BadRequest:
    """The 400 about the request field at `path` (`messages[1].tool_calls[0].id`): its message is the path
    and `problem`, its `param` the path in OpenAI's spelling (`messages.[1].tool_calls.[0].id`)."""
    return BadRequest(f"{path} {problem}", param=path.replace("[", ".["))


def _kind(value: Any) -> str:
    return {str: "a string", list: "a list", dict: "an object", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}")


def chat_messages(raw: Any) -> list[dict]:
    """The request's messages with text content only (parts joined), `developer` read as `system`, checked
    as the module docstring says. Raises `BadRequest` naming the message's index and field."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise refuse(f"messages[{i}]", f"must be an object, got {_kind(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise refuse(f"messages[{i}].role", f"must be one of {', '.join(sorted(ROLES))}, got {role!r}")
        out.append({**m, "role": "system" if role == "developer" else role, "content": _text(m.get("content"), i)})
    calls: set[str] | None = None  # the ids of the calls tool messages may answer now (None: no calls)
    for i, m in enumerate(out):
        if m["role"] == "tool":
            _check_answer(m, i, calls)
            continue
        calls = _call_ids(m["tool_calls"], i) if m["role"] == "assistant" and m.get("tool_calls") is not None \
            else None
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise refuse(f"messages[{i}].content[{j}]", f"must be a text part (only text is supported), got "
                                                            f"{kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    if not isinstance(content, str):
        raise refuse(f"messages[{i}].content", f"must be a string, a list of text parts or null, got {_kind(content)}")
    return content


def _call_ids(tool_calls: Any, i: int) -> set[str]:
    """The ids of an assistant message's `tool_calls`, each call checked (module docstring)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(tool_calls, list):
        raise refuse(where, f"must be a list of tool call objects, got {_kind(tool_calls)}")
    ids = set()
    for j, call in enumerate(tool_calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise refuse(at, f"must be an object, got {_kind(call)}")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise refuse(f"{at}.id", f"must be a non-empty string, got {_kind(call.get('id'))}")
        if call.get("type", "function") != "function":
            raise refuse(f"{at}.type", f"must be \"function\", got {call['type']!r}")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise refuse(f"{at}.function", f"must be an object with name and arguments, got {_kind(fn)}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise refuse(f"{at}.function.name", f"must be a non-empty string, got {_kind(fn.get('name'))}")
        if not isinstance(fn.get("arguments"), str | dict):
            raise refuse(f"{at}.function.arguments", f"must be a JSON string (or an object), got "
                                                      f"{_kind(fn.get('arguments'))}")
        ids.add(call["id"])
    return ids


def _check_answer(message: dict, i: int, calls: set[str] | None) -> None:
    """A tool message `i` answers one of `calls`, the ids of the assistant message before it (module
    docstring)."""
    if calls is None:
        before = "is first in the conversation" if i == 0 else "follows no assistant message with tool_calls"
        raise refuse(f"messages[{i}].role", f"is 'tool', but it {before}: a tool message must answer a call of "
                                            "the assistant message before it")
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise refuse(f"messages[{i}].tool_call_id", f"is required (a string naming the call it answers), got "
                                                    f"{_kind(call_id)}")
    if call_id not in calls:
        raise refuse(f"messages[{i}].tool_call_id", f"{call_id!r} is not the id of a call in the tool_calls of "
                                                    f"the assistant message before it ({', '.join(sorted(calls))})")
