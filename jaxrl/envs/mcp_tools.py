"""The tool half of the in-process chat harness (`jaxrl.envs.loader.ChatHarness`): a verifiers v1 rollout's
MCP tool servers (`Taskset.toolsets` / `Task.toolsets`, served by verifiers over streamable HTTP) listed as
OpenAI tools and called for the model's tool calls.

It follows verifiers' own `null` harness program (`verifiers/v1/harnesses/null/program.py`): tools are
advertised as `<server>_<tool>` (bare for a server named ""), each call opens a fresh MCP session, listing
and calling are tried up to `ATTEMPTS` times (a busy server may drop a connection; as with the null
harness, a call whose answer was lost may run twice), and a call's problems are answered in the tool
message as text, never raised: arguments that are not a JSON object, an unknown tool, a tool that raises
(FastMCP answers `isError` with the error text), a call that fails, and, beyond the null harness, a call
that takes longer than the harness's `tool_timeout` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import importlib.metadata
import json
from collections.abc import AsyncIterator
from typing import Any

ATTEMPTS = 3
"""Tries of an MCP listing or call that fails (not one that times out), 0.5 s, then 1 s, ... apart."""


@dataclasses.dataclass(frozen=True)
class Tools:
    """A rollout's tools: `schemas` the OpenAI `tools` list, `dispatch` advertised name -> (server URL, the
    server's own tool name), `timeout` seconds a call may take."""

    schemas: list[dict[str, Any]]
    dispatch: dict[str, tuple[str, str]]
    timeout: float


def _timeout(seconds: float) -> Any:
    """`seconds` per request, 5 to connect, as the HTTP library of the installed MCP client wants it: mcp 1.x
    (verifiers 0.3.1) runs on httpx, mcp 2.x (verifiers 0.4) on httpx2, whose `Timeout` types differ."""
    major = int(importlib.metadata.version("mcp").split(".")[0])
    lib = importlib.import_module("httpx2" if major >= 2 else "httpx")
    return lib.Timeout(seconds, connect=5.0)


@contextlib.asynccontextmanager
async def _session(url: str, timeout: float) -> AsyncIterator[Any]:
    from mcp import ClientSession  # imported by a rollout with tools only
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(create_mcp_http_client(timeout=_timeout(timeout)))
        read, write, *_ = await stack.enter_async_context(streamable_http_client(url, http_client=http))
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        yield session


async def connect(mcp_urls: dict[str, str], timeout: float) -> Tools:
    """Lists each server's tools. Raises ValueError for two tools advertised under one name, and what the
    MCP client raises for a server that cannot be reached (the rollout then fails: its tools are missing)."""
    schemas: list[dict[str, Any]] = []
    dispatch: dict[str, tuple[str, str]] = {}
    for server, url in mcp_urls.items():
        async def list_tools(url: str = url) -> list[Any]:
            async with _session(url, timeout) as session:
                return (await session.list_tools()).tools

        listed = await _retried(list_tools)
        for tool in listed:
            name = f"{server}_{tool.name}" if server else tool.name
            if name in dispatch:
                raise ValueError(f"two MCP tools are advertised as {name!r}")
            schemas.append({"type": "function", "function": {"name": name, "description": tool.description or "",
                                                             "parameters": _input_schema(tool)}})
            dispatch[name] = (url, tool.name)
    return Tools(schemas, dispatch, timeout)


async def _retried(fn: Any) -> Any:
    """`await fn()`, tried again after a failure (not a timeout or a cancellation) up to `ATTEMPTS` times."""
    for attempt in range(ATTEMPTS):
        try:
            return await fn()
        except (TimeoutError, asyncio.CancelledError):
            raise
        except Exception:
            if attempt == ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def _input_schema(tool: Any) -> dict[str, Any]:
    """A listed MCP tool's JSON schema: `input_schema` in mcp 2.x, `inputSchema` in mcp 1.x."""
    return tool.input_schema if hasattr(tool, "input_schema") else tool.inputSchema


def _text(blocks: list[Any]) -> str:
    """An MCP result's content blocks as one tool message text (text blocks joined by newlines)."""
    return "\n".join(b.text if getattr(b, "type", None) == "text" else str(b) for b in blocks)


async def answer(tools: Tools, call: dict[str, Any]) -> dict[str, Any]:
    """The tool message answering one OpenAI tool call (`{"id", "function": {"name", "arguments"}}`)."""
    fn = call.get("function") or {}
    name = fn.get("name")

    def reply(content: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call.get("id", ""), "content": content}

    try:
        arguments = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError as e:
        return reply(f"error: invalid JSON in tool arguments ({e}); resend the call with valid JSON")
    if not isinstance(arguments, dict):
        return reply(f"error: tool arguments must be a JSON object, got {type(arguments).__name__}")
    if name not in tools.dispatch:
        return reply(f"error: unknown tool {name!r}")
    url, raw = tools.dispatch[name]

    async def request() -> Any:
        async with _session(url, tools.timeout) as session:
            return await session.call_tool(raw, arguments)

    try:
        async with asyncio.timeout(tools.timeout):
            result = await _retried(request)
    except TimeoutError:
        return reply(f"error: tool {name!r} timed out after {tools.timeout:g} s")
    except Exception as e:  # noqa: BLE001 - a failed call is answered to the model, as verifiers' harnesses do
        while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:  # anyio's task groups wrap errors
            e = e.exceptions[0]
        return reply(f"error: tool {name!r} failed: {type(e).__name__}: {e}")
    return reply(_text(result.content))
