"""Request validation shared by the server's routes: the error type and the sampling fields.

Every value a client sends is checked here before it reaches the engine, so that no request can push
a value the device code would overflow on (a float beyond float32, a seed beyond int64) or silently
misread (a bool where a number belongs: JSON `true` is a Python int).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxrl.inference.protocol import SamplingParams

FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
# vLLM's _SAMPLING_EPS: a temperature below it is greedy decoding (dividing logits by it would overflow).
GREEDY_BELOW = 1e-5


class BadRequest(ValueError):
    """A request the server refuses: HTTP `status` with `message` (and the request field `param` it is
    about, when one is) in the JSON error body (`error_body`)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


# The openai SDK's exception class for each status, which vLLM's ErrorResponse sends as the error's `type`.
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 409: "ConflictError", 422: "UnprocessableEntityError", 429: "RateLimitError",
                503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, as vLLM's OpenAI server
    fills it: `type` the openai SDK's exception name for the HTTP status (`BadRequestError` for other 4xx,
    `InternalServerError` for other 5xx), `param` the request field at fault or None, `code` the status."""
    kind = _ERROR_TYPES.get(status) or ("InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A JSON number (not a bool) that float32 holds without overflow."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
        and abs(value) <= FLOAT32_MAX


def check_penalties(raw: Mapping[str, Any]) -> None:
    """Raises `BadRequest` for a `presence_penalty` or `frequency_penalty` outside OpenAI's and vLLM's
    [-2, 2] (the routes then accept only 0: this engine has neither)."""
    for key in ("presence_penalty", "frequency_penalty"):
        value = raw.get(key)
        if value is not None and not (is_number(value) and -2 <= value <= 2):
            raise BadRequest(f"{key} must be a number in [-2, 2], got {value!r}", param=key)


def sampling_from(raw: Mapping[str, Any], prompt_len: int, max_model_len: int,
                  clamp_max_tokens: bool = False, prompt_field: str = "messages") -> SamplingParams:
    """`SamplingParams` from the sampling fields of a request (absent or null: the default); raises
    `BadRequest` naming the field, with vLLM's ranges.

    Fields: temperature (>= 0; below 1e-5 greedy, as in vLLM), top_p (0, 1], top_k (integer >= -1; -1
    and 0 off, as in vLLM), min_p [0, 1], repetition_penalty (> 0), max_tokens (integer >= 1 with
    `prompt_len + max_tokens <= max_model_len`, as vLLM and OpenAI require; with `clamp_max_tokens` any
    larger value is cut to the room left instead; default: the room left in the context,
    `max_model_len - prompt_len`, as in vLLM), stop_token_ids (non-negative integers), min_tokens
    (integer in [0, max_tokens], as in vLLM: no stop token is sampled before that many tokens), seed (an
    int64). Keys other than these are the caller's business. Each refusal's `param` is the field's key
    (`prompt_field`, the request's prompt, for a prompt that leaves no room for a completion).
    """
    defaults = SamplingParams()

    def number(key: str, ok, rule: str) -> float:
        value = raw.get(key)
        if value is None:
            return getattr(defaults, key)
        if not is_number(value) or not ok(value):
            raise BadRequest(f"{key} must be {rule}, got {value!r}", param=key)
        return float(value)

    temperature = number("temperature", lambda v: v >= 0, "a number >= 0")
    top_p = number("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    min_p = number("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
    repetition_penalty = number("repetition_penalty", lambda v: v > 0, "a number > 0")

    top_k = raw.get("top_k")
    if top_k is None:
        top_k = defaults.top_k
    elif not is_int(top_k) or top_k < -1:
        raise BadRequest(f"top_k must be an integer, -1 or 0 (off) or at least 1, got {top_k!r}", param="top_k")

    max_tokens = raw.get("max_tokens")
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
        if max_tokens < 1:
            raise BadRequest(f"a prompt of {prompt_len} tokens fills the context of {max_model_len}",
                             param=prompt_field)
    elif not is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
    elif prompt_len < max_model_len < prompt_len + max_tokens and not clamp_max_tokens:  # a full prompt: the engine's
        raise BadRequest(f"max_tokens: this model's maximum context length is {max_model_len} tokens, and the "
                         f"request asks for {prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} in "
                         f"the completion); reduce max_tokens to at most {max_model_len - prompt_len}",
                         param="max_tokens")

    min_tokens = raw.get("min_tokens")
    if min_tokens is None:
        min_tokens = defaults.min_tokens
    elif not is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
        raise BadRequest(f"min_tokens must be an integer in [0, max_tokens = {max_tokens}], got {min_tokens!r}",
                         param="min_tokens")

    stop = raw.get("stop_token_ids")
    if stop is None:
        stop = []
    elif not isinstance(stop, list) or not all(is_int(t) and t >= 0 for t in stop):
        raise BadRequest("stop_token_ids must be a list of non-negative integers", param="stop_token_ids")

    seed = raw.get("seed")
    if seed is not None and not (is_int(seed) and -(2**63) <= seed < 2**63):
        raise BadRequest(f"seed must be a 64-bit integer, got {seed!r}", param="seed")

    return SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=top_p,
        top_k=min(top_k, INT32_MAX) if top_k > 0 else -1,  # beyond the vocabulary keeps every token anyway
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        max_tokens=max_tokens,
        stop_token_ids=tuple(stop),
        min_tokens=min(min_tokens, INT32_MAX),  # beyond any context: never reached anyway
        seed=seed,
    )
