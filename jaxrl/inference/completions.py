"""OpenAI's text completions over a `GenerateBackend`: one prompt in, its continuation out, with vLLM's fields.

    POST /v1/completions {"model", "prompt", "stream", sampling fields, "logprobs": k, ...}
      -> {"id": "cmpl-...", "object": "text_completion", "created", "model", "choices": [{"index", "text",
          "logprobs": {"tokens", "token_logprobs", "top_logprobs", "text_offset"} or null, "finish_reason"}],
          "usage"}
      or, with "stream": true, one `data: {text_completion}` event per batch of tokens, one with the
      `finish_reason`, a usage event (`stream_options.include_usage`), then `data: [DONE]`

`prompt` is a string (tokenized as is, no special tokens added: Qwen3's tokenizer adds none either way), a
list of token ids, or a list holding one of those; several prompts in one request are refused (`n` is 1).
It runs as a chat request does (`jaxrl.inference.chat.ChatRun`: the same backend call, text decoding, stop
strings and end-of-turn ids), with the same sampling fields and ranges (`chat`'s docstring), `max_tokens`
defaulting to 16 (OpenAI's and vLLM's default on this route). `logprobs: k` (0..20, OpenAI's range) returns,
per sampled token, its text, its logprob under the sampling distribution, its character offset in the
completion, and a `top_logprobs` dict of its k most likely tokens (text -> logprob, most likely first) under
that same distribution, with the sampled token added when it is not among them (OpenAI's "up to logprobs + 1
elements"); `logprobs: 0` gives the sampled token alone. vLLM's `prompt_logprobs: 0` adds to the choice each
prompt token's logprob given the tokens before it, at temperature 1 (`Scheduler.score`: what a distillation
run's server teacher asks, `jaxrl.rl.teacher_client`), as vLLM lays it out: None for the first token, then
`{"<token id>": {"logprob", "rank", "decoded_token"}}`; a count above 0 (alternatives) and `stream` with it
are refused. `echo`, `suffix`, `best_of` > 1 and `n` > 1 are refused with a 400 naming them, as is any
field the route does not know.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from jaxrl.inference import chat
from jaxrl.inference.chat import ChatRequest, ChatRun, flag
from jaxrl.inference.template import ChatTemplate, encode_within
from jaxrl.inference.wire import BadRequest, is_int, sampling_from

ROUTE = "/v1/completions"
DEFAULT_MAX_TOKENS = 16
# Neutral values of fields this route has not built; anything else is refused.
_NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "suffix": "", "presence_penalty": 0, "frequency_penalty": 0,
            "include_stop_str_in_output": False}
_BUILT = frozenset({"model", "prompt", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
                    "repetition_penalty", "max_tokens", "seed", "stop", "stop_token_ids", "min_tokens", "logprobs",
                    "return_token_ids", "return_tokens_as_token_ids", "skip_special_tokens", "ignore_eos",
                    "logit_bias", "prompt_logprobs"})


def _prompt_ids(raw: Any, template: ChatTemplate, max_model_len: int) -> list[int]:
    """The prompt's token ids; `BadRequest` naming `prompt` for anything but one string or one list of ids,
    or a prompt that fills the context."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]
    if isinstance(raw, str) and raw:
        return encode_within(template.tokenizer, raw, max_model_len, param="prompt")
    if isinstance(raw, list) and raw and all(is_int(t) and t >= 0 for t in raw):
        if len(raw) >= max_model_len:
            raise BadRequest(f"the prompt is {len(raw)} tokens; this model's context is {max_model_len} "
                             "(prompt and completion)", param="prompt")
        return raw
    raise BadRequest("prompt must be one non-empty string or one non-empty list of token ids", param="prompt")


def parse_completion_request(body: Any, template: ChatTemplate, model_name: str, max_model_len: int,
                             clamp_max_tokens: bool = False) -> ChatRequest:
    """Validates a completions body and tokenizes its prompt; raises `BadRequest` (404 for another model's
    name, 400 for anything else, naming the field). `clamp_max_tokens`: `wire.sampling_from`'s."""
    body = chat.check_fields(body, model_name, _BUILT, _NEUTRAL)
    stop, top = chat.stop_strings(body), chat.top_logprobs(body.get("logprobs"), "logprobs")
    prompt_ids = _prompt_ids(body.get("prompt"), template, max_model_len)
    fields = {k: body.get(k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                                       "stop_token_ids", "min_tokens")}
    fields["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    params = sampling_from(fields, len(prompt_ids), max_model_len, clamp_max_tokens, prompt_field="prompt")
    stop_ids = params.stop_token_ids + (() if flag(body, "ignore_eos") else template.stop_token_ids)
    params = dataclasses.replace(params, stop_token_ids=stop_ids, top_logprobs=top)
    scored = _prompt_logprobs(body)
    return ChatRequest(prompt_ids, params, stop, flag(body, "stream"), chat.include_usage(body),
                       body.get("logprobs") is not None, top, flag(body, "return_token_ids"),
                       flag(body, "return_tokens_as_token_ids"), flag(body, "skip_special_tokens", True),
                       prompt_logprobs=scored)


def _prompt_logprobs(body: dict[str, Any]) -> bool:
    """Whether the request asks for vLLM's `prompt_logprobs` (each prompt token's own logprob, `0`: the
    alternatives of a count above 0 are not built, nor with `stream`); `BadRequest` naming the field."""
    value = body.get("prompt_logprobs")
    if value is None:
        return False
    if value != 0 or isinstance(value, bool):
        raise BadRequest(f"prompt_logprobs: only 0 is built (each prompt token's own logprob, no alternatives), "
                         f"got {value!r}", param="prompt_logprobs")
    if flag(body, "stream"):
        raise BadRequest("prompt_logprobs is not built with stream", param="prompt_logprobs")
    return True


async def prompt_logprobs(run: ChatRun) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of the run's prompt: None for the first token, then for each token a dict
    keyed by its id (a string) holding its `logprob` (temperature 1), `rank` and `decoded_token`.

    Raises:
        BadRequest: the backend cannot score prompts.
    """
    score = getattr(run.backend, "score", None)
    if score is None:
        raise BadRequest("prompt_logprobs: this server's backend does not score prompts", param="prompt_logprobs")
    ids = run.req.prompt_ids
    scored = await score(ids)
    entries = [run.entry(t, lp) for t, (lp, _) in zip(ids[1:], scored[1:], strict=True)]
    return [None] + [{str(t): {"logprob": e["logprob"], "rank": rank, "decoded_token": e["token"]}}
                     for t, e, (_, rank) in zip(ids[1:], entries, scored[1:], strict=True)]


class _Logprobs:
    """The legacy `logprobs` object, built a batch of tokens at a time (`text_offset` runs on across batches)."""

    def __init__(self, run: ChatRun) -> None:
        self.run, self.offset = run, 0

    def add(self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in zip(ids, lps, tops, strict=True):
            mine = self.run.entry(t, lp)
            alternatives = {e["token"]: e["logprob"] for e in (self.run.entry(a, alp) for a, alp in top)}
            alternatives.setdefault(mine["token"], mine["logprob"])
            out["tokens"].append(mine["token"])
            out["token_logprobs"].append(mine["logprob"])
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(self.offset)
            self.offset += len(bytes(mine["bytes"]).decode("utf-8", errors="replace"))
        return out


async def complete(run: ChatRun, model_name: str) -> dict[str, Any]:
    """The non-streaming response body; raises what the backend raised."""
    async for _ in run.steps():
        pass
    ids = run.text.token_ids
    logprobs = _Logprobs(run).add(ids, run.logprobs, run.tops) if run.req.logprobs else None
    choice: dict[str, Any] = {"index": 0, "text": run.text.take(final=True), "logprobs": logprobs,
                              "finish_reason": run.finish_reason}
    if run.req.prompt_logprobs:
        choice["prompt_logprobs"] = await prompt_logprobs(run)
    body = {**chat.response_head(model_name, "text_completion", "cmpl"), "choices": [choice], "usage": run.usage()}
    if run.req.return_token_ids:
        choice["token_ids"], choice["prompt_token_ids"] = ids, run.req.prompt_ids
    return body


def stream(run: ChatRun, model_name: str) -> AsyncIterator[str]:
    """Server-sent events (the module docstring's), then `data: [DONE]` (`chat.closed_stream`)."""
    return chat.closed_stream(_chunks(run, model_name))


async def _chunks(run: ChatRun, model_name: str) -> AsyncIterator[str]:
    head, logprobs = chat.response_head(model_name, "text_completion", "cmpl"), _Logprobs(run)

    def chunk(text: str, finish: str | None = None, **extra: Any) -> str:
        return chat.event({**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                                **extra}]})

    first = True
    async for ids, lps, tops in run.steps():
        text, extra = run.text.take(), {}
        if run.req.logprobs and ids:
            extra["logprobs"] = logprobs.add(ids, lps, tops)
        if run.req.return_token_ids and ids:
            extra["token_ids"] = ids
            if first:
                extra["prompt_token_ids"], first = run.req.prompt_ids, False
        if text or extra:
            yield chunk(text, **extra)
    if rest := run.text.take(final=True):
        yield chunk(rest)
    yield chunk("", run.finish_reason)
    if run.req.include_usage:
        yield chat.event({**head, "choices": [], "usage": run.usage()})
