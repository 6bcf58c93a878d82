"""OpenAI chat completions over a `GenerateBackend`: chat template in, text (or server-sent events) out.

    POST /v1/chat/completions {"model", "messages", "stream", sampling fields, ...}
      -> {"id", "object": "chat.completion", "created", "model", "choices": [{"index", "message":
          {"role": "assistant", "content"}, "logprobs", "finish_reason"}], "usage"}
      or, with "stream": true, `data: {chat.completion.chunk}` events and a final `data: [DONE]`

The messages are rendered by the tokenizer's chat template (`jaxrl.inference.template.ChatTemplate`:
transformers `apply_chat_template`, with
the request's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`) and sampled until one of the
model's end-of-turn ids (its `generation_config.json` `eos_token_id`, else the tokenizer's), a stop
string, or `max_tokens`. Streaming is incremental: the backend hands each token over as it is sampled
(`on_token`), and each event carries the text decoded since the last one. Text is decoded with
offsets (`jaxrl.inference.detokenize.TextStream`, vLLM's incremental detokenizer), holding back a token
whose bytes end mid-character, and,
while stop strings are set, the last `len(longest stop) - 1` characters, which could begin one. A
request that hits a stop string is cancelled in the backend at once.

Sampling fields (vLLM's ranges): `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`,
`max_tokens` or `max_completion_tokens` (prompt plus completion within the context, else a 400 naming both),
`seed`, `stop` (a string or a list of up to 16), `stop_token_ids`, `min_tokens` (vLLM's: neither a stop
token, the end-of-turn ids included, nor a stop string ends the completion before that many tokens); `n`,
`presence_penalty` and `frequency_penalty` (each in [-2, 2]), vLLM's `echo`, `add_generation_prompt`,
`continue_final_message`, `include_stop_str_in_output` only at their neutral values, and `logit_bias` empty.
`logprobs: true` gives each sampled token's logprob under the sampling distribution (`log_softmax` of the
penalised logits over the temperature, T = 1 when greedy; before top_p / top_k / min_p:
`jaxrl.inference.sampling`), and `top_logprobs: k` (0..20, with `logprobs: true`, as OpenAI requires) each
token's k most likely tokens under that same distribution, most likely first, as `{token, logprob, bytes}`
(a greedy token is the first of its own list, with the same logprob; -9999.0 stands for -inf, as in vLLM).
Extras, as vLLM's: `return_token_ids: true` adds `prompt_token_ids` to the response (the first event when
streaming) and `token_ids` to each choice (each event), which is what a trainer needs to train on the exact
tokens; `return_tokens_as_token_ids: true` names each logprob's token `token_id:<id>`; `skip_special_tokens:
false` keeps special tokens in the text. Fields that cannot change the output (`user`, `metadata`, `store`,
`service_tier`, `parallel_tool_calls`, vLLM's `cache_salt`, `priority`, `request_id`,
`spaces_between_special_tokens`) are accepted, and so is `reasoning_effort` (one of OpenAI's values; as in
vLLM, which reads it only for gpt-oss, it has no effect on Qwen3, whose switch is `chat_template_kwargs:
{"enable_thinking": ...}`). `tools` and `tool_choice` are served as vLLM's hermes parser serves Qwen3
(`jaxrl.inference.tools`: the reply's `<tool_call>` blocks come back as `message.tool_calls` with
finish_reason "tool_calls", streamed as one delta per call once the reply is complete); the legacy
`functions`, non-text content parts, and any other field are refused with a 400 naming them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxrl.inference import tools
from jaxrl.inference.detokenize import TextStream
from jaxrl.inference.messages import chat_messages
from jaxrl.inference.protocol import MAX_TOP_LOGPROBS, Completion, GenerateBackend, SamplingParams
from jaxrl.inference.template import ChatTemplate
from jaxrl.inference.wire import BadRequest, check_penalties, error_body, is_int, sampling_from

CHAT_ROUTE = "/v1/chat/completions"
MAX_STOP_STRINGS = 16
# Neutral values of OpenAI and vLLM fields this server has no sampling for; anything else is refused.
_NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "echo": False,
            "add_generation_prompt": True, "continue_final_message": False, "include_stop_str_in_output": False}
# Fields this route reads (besides `_NEUTRAL`'s), and fields that cannot change its output.
_BUILT = frozenset({"model", "messages", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
                    "repetition_penalty", "max_tokens", "max_completion_tokens", "seed", "stop", "stop_token_ids",
                    "min_tokens", "logprobs", "top_logprobs", "return_token_ids", "return_tokens_as_token_ids",
                    "skip_special_tokens", "chat_template_kwargs", "ignore_eos", "logit_bias", "tools", "functions",
                    "response_format", "tool_choice", "function_call", "reasoning_effort"})
# OpenAI's reasoning_effort values. vLLM accepts the field and uses it only for its harmony (gpt-oss) models; Qwen3
# has no effort control (its switch is chat_template_kwargs.enable_thinking), so it has no effect here either.
_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "cache_salt", "priority",
                        "request_id", "spaces_between_special_tokens"})


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated chat request: prompt ids, sampling, stop strings and what the response carries."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    skip_special_tokens: bool = True
    tool_plan: tools.ToolPlan = tools.ToolPlan()
    prompt_logprobs: bool = False  # the completions route's vLLM `prompt_logprobs: 0`


def top_logprobs(value: Any, field: str) -> int:
    """A request's count of alternatives per token (`field`: chat's `top_logprobs`, the completions route's
    `logprobs`): None is 0; else an integer in [0, `MAX_TOP_LOGPROBS`] (OpenAI's range), or `BadRequest`
    naming `field`."""
    if value is None:
        return 0
    if not is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{field} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}", param=field)
    return value


def flag(body: dict, key: str, default: bool = False, param: str | None = None) -> bool:
    """`body[key]` as a bool (absent or null: `default`); `BadRequest` (about `param`, else `key`) for anything
    but true or false."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, got {value!r}", param=param or key)
    return value


def check_fields(body: Any, model_name: str, built: frozenset[str], neutral: dict[str, Any]) -> dict[str, Any]:
    """`body`, checked as a text route's request: a JSON object naming this server's model, if any (else a
    404), with no field outside `built`, `NO_EFFECT` and `neutral`, the fields in `neutral` only at their
    neutral value, penalties in OpenAI's [-2, 2] and `logit_bias` empty; raises `BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} does not exist; this server serves {model_name!r}", 404)
    unknown = sorted(set(body) - built - NO_EFFECT - set(neutral))
    if unknown:
        raise BadRequest(f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
    check_penalties(body)
    for key, value in neutral.items():
        if body.get(key) is not None and body[key] != value:
            raise BadRequest(f"{key}={body[key]!r} is not supported (only {value!r})", param=key)
    if body.get("logit_bias"):
        raise BadRequest("logit_bias is not supported", param="logit_bias")
    return body


def include_usage(body: dict[str, Any]) -> bool:
    """`stream_options.include_usage`; `BadRequest` for `stream_options` that is not an object."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    return flag(options or {}, "include_usage", param="stream_options.include_usage")


def stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    """The request's `stop`: a string or a list of up to `MAX_STOP_STRINGS` non-empty ones; `BadRequest` else."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                         param="stop")
    return tuple(stop)


def _check_effort(body: dict[str, Any]) -> None:
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in _REASONING_EFFORTS:
        raise BadRequest(f"reasoning_effort must be one of {', '.join(_REASONING_EFFORTS)}, got {effort!r}",
                         param="reasoning_effort")


def parse_chat_request(body: Any, template: ChatTemplate, model_name: str, max_model_len: int,
                       clamp_max_tokens: bool = False) -> ChatRequest:
    """Validates a chat completions body and renders its prompt; raises `BadRequest` (404 for another
    model's name, 400 for anything else, naming the field). `clamp_max_tokens`: `wire.sampling_from`'s."""
    body = check_fields(body, model_name, _BUILT, _NEUTRAL)
    _check_effort(body)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest("response_format is not supported (only {'type': 'text'})", param="response_format")
    messages = chat_messages(body.get("messages"))
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    stop = stop_strings(body)
    tool_plan = tools.plan(body)
    prompt_ids = template.render(messages, template_kwargs, tool_plan.tools, tool_plan.forced, max_model_len)
    fields = {k: body.get(k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")}
    fields["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens"))
    fields["stop_token_ids"] = body.get("stop_token_ids")
    fields["min_tokens"] = body.get("min_tokens")
    params = sampling_from(fields, len(prompt_ids), max_model_len, clamp_max_tokens)
    if not flag(body, "ignore_eos"):
        params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *template.stop_token_ids))
    logprobs, top = flag(body, "logprobs"), top_logprobs(body.get("top_logprobs"), "top_logprobs")
    if top and not logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    params = dataclasses.replace(params, top_logprobs=top)
    return ChatRequest(prompt_ids, params, stop, flag(body, "stream"), include_usage(body), logprobs, top,
                       flag(body, "return_token_ids"), flag(body, "return_tokens_as_token_ids"),
                       flag(body, "skip_special_tokens", True), tool_plan)


class ChatRun:
    """One chat request running in the backend; its tokens arrive in a queue as they are sampled.

    Created (and the backend request started) before the response begins, so `on_done` (the server's
    admission count) is called exactly once when the backend request ends, however the client leaves.
    """

    def __init__(self, backend: GenerateBackend, template: ChatTemplate, req: ChatRequest,
                 on_done: Callable[[], None]) -> None:
        self.req, self.backend = req, backend
        self.text = TextStream(template.tokenizer, req.stop, req.skip_special_tokens, req.params.min_tokens)
        self._tok = template.tokenizer
        self._queue: asyncio.Queue[tuple[int, float, list[tuple[int, float]]] | None] = asyncio.Queue()
        self.task = asyncio.ensure_future(backend.generate(req.prompt_ids, req.params, on_token=self._on_token))
        # The task ends after every on_token call it caused (both are scheduled on this loop in order),
        # so None is always the last item of the queue.
        self.task.add_done_callback(lambda _: (self._queue.put_nowait(None), on_done()))
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []

    def _on_token(self, token: int, logprob: float, top: list[tuple[int, float]] | None = None) -> None:
        self._queue.put_nowait((token, logprob, top or []))

    async def steps(self) -> AsyncIterator[tuple[list[int], list[float], list[list[tuple[int, float]]]]]:
        """The tokens, their logprobs and their alternatives (empty lists unless the request asked for
        `top_logprobs`) added to `text` since the last step, as they arrive; ends when the backend request
        ends or a stop string is found (the request is then cancelled). Raises what the backend raised."""
        try:
            done = False
            while not done:
                items = [await self._queue.get()]
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                ids, lps, tops = [], [], []
                for item in items:
                    if item is None:
                        done = True
                        break
                    self.text.add(item[0])
                    ids.append(item[0])
                    lps.append(item[1])
                    tops.append(item[2])
                    if self.text.stopped:
                        done = True
                        break
                self.logprobs += lps
                self.tops += tops
                if done and not self.text.stopped:
                    self.text.finish()
                    self.task.result()  # raises the backend's error, if any
                yield ids, lps, tops
        finally:
            self.task.cancel()

    @property
    def finish_reason(self) -> str:
        if self.text.stopped:
            return "stop"
        done = self.task.result() if self.task.done() and not self.task.cancelled() else None
        return done.finish_reason if isinstance(done, Completion) else "length"

    def usage(self) -> dict[str, int]:
        p, c = len(self.req.prompt_ids), len(self.text.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        """One token as OpenAI's logprob entries carry it: `token` (its text, or `token_id:<id>` with
        `return_tokens_as_token_ids`), `logprob` (-inf as -9999.0, vLLM's stand-in: JSON has no infinity)
        and the UTF-8 `bytes` of its text."""
        text = self._tok.decode([token], skip_special_tokens=False)
        return {"token": f"token_id:{token}" if self.req.tokens_as_ids else text, "logprob": max(logprob, -9999.0),
                "bytes": list(text.encode("utf-8"))}

    def logprob_entries(self, ids: list[int], lps: list[float],
                        tops: list[list[tuple[int, float]]]) -> dict[str, list[dict]]:
        """OpenAI's `logprobs` object for these tokens, each with its `top_logprobs` (`tops`: (id, logprob)
        pairs, most likely first; empty unless the request asked)."""
        return {"content": [{**self.entry(t, lp), "top_logprobs": [self.entry(a, alp) for a, alp in top]}
                            for t, lp, top in zip(ids, lps, tops, strict=True)]}


def response_head(model_name: str, kind: str, prefix: str = "chatcmpl") -> dict[str, Any]:
    """The fields every response body and event starts with: a new `id` (`prefix-<hex>`), `object` `kind`,
    `created` (Unix seconds) and `model`."""
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model_name}


def _reply(run: ChatRun, text: str) -> tuple[dict[str, Any], str]:
    """The reply's message (`content`, and `tool_calls` when it called tools) and its finish reason."""
    plan = run.req.tool_plan
    parsed = tools.parse_reply(plan.forced + text) if plan.parse else None
    if parsed is None:
        return {"role": "assistant", "content": plan.forced + text}, run.finish_reason
    return {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}, "tool_calls"


async def complete(run: ChatRun, model_name: str) -> dict[str, Any]:
    """The non-streaming response body; raises what the backend raised."""
    async for _ in run.steps():
        pass
    message, finish_reason = _reply(run, run.text.take(final=True))
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": run.logprob_entries(run.text.token_ids, run.logprobs, run.tops) if run.req.logprobs else None,
        "finish_reason": finish_reason,
    }
    body = {**response_head(model_name, "chat.completion"), "choices": [choice], "usage": run.usage()}
    if run.req.return_token_ids:
        choice["token_ids"] = run.text.token_ids
        body["prompt_token_ids"] = run.req.prompt_ids
    return body


def event(data: dict[str, Any]) -> str:
    """One server-sent event carrying `data` as compact JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def closed_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, then `data: [DONE]`; an error raised once the stream began (its status line is sent) becomes
    an `{"error": ...}` event before it: 400 for a `ValueError`, else 500. `events` is closed when this is
    (a client that leaves cancels its request at once)."""
    async with contextlib.aclosing(events) as inner:
        try:
            async for item in inner:
                yield item
        except ValueError as exc:
            yield event(error_body(str(exc), 400, getattr(exc, "param", None) or "messages"))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error can only go in the stream
            yield event(error_body(f"backend error: {type(exc).__name__}: {exc}", 500))
    yield "data: [DONE]\n\n"


def stream(run: ChatRun, model_name: str) -> AsyncIterator[str]:
    """Server-sent events: a role chunk, one chunk per batch of tokens, a chunk with `finish_reason`,
    a usage chunk (with `stream_options.include_usage`), then `data: [DONE]` (`closed_stream`)."""
    return closed_stream(_chunks(run, model_name))


async def _chunks(run: ChatRun, model_name: str) -> AsyncIterator[str]:
    head = response_head(model_name, "chat.completion.chunk")

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> str:
        return event({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                            **extra}]})

    first = {"prompt_token_ids": run.req.prompt_ids} if run.req.return_token_ids else {}
    yield event({**head, **first, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
    # With tools, content waits while it could begin a tool call (`tools.ContentHold`).
    hold = tools.ContentHold(run.req.tool_plan.forced) if run.req.tool_plan.parse else None
    async for ids, lps, tops in run.steps():
        text = run.text.take()
        text = hold.add(text) if hold is not None else text
        extra: dict[str, Any] = {}
        if run.req.logprobs and ids:
            extra["logprobs"] = run.logprob_entries(ids, lps, tops)
        if run.req.return_token_ids and ids:
            extra["token_ids"] = ids
        if text or extra:
            yield chunk({"content": text}, **extra)
    rest = run.text.take(final=True)
    finish_reason = run.finish_reason
    if hold is not None:
        hold.add(rest)
        message, finish_reason = _reply(run, hold.text[len(run.req.tool_plan.forced):])
        rest = (message["content"] or "")[hold.sent:]
    if rest:
        yield chunk({"content": rest})
    for i, call in enumerate(message["tool_calls"] if hold is not None and "tool_calls" in message else ()):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, finish_reason)
    if run.req.include_usage:
        yield event({**head, "choices": [], "usage": run.usage()})
