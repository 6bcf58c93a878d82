"""The rollout server: vLLM's token-in/token-out route, served over a `GenerateBackend`.

verifiers' train client (`verifiers.v1.clients.train.TrainClient`, via `renderers.client.generate`)
renders chats to token ids itself and POSTs them to `/inference/v1/generate`; it checks that every
sampled token comes with a finite logprob tagged `token_id:<id>`. `/v1/models` tells it the context
length, so it refuses an overlong prompt before sending it.

    POST /inference/v1/generate  {"model", "token_ids", "sampling_params": {...}}
      -> {"request_id", "prompt_token_ids", "choices": [{"index", "token_ids",
          "logprobs": {"content": [{"token": "token_id:<id>", "logprob"}]}, "finish_reason"}], "usage"}
    GET  /v1/models              -> {"object": "list", "data": [{"id", "object", "max_model_len", ...}]}
    GET  /health                 -> {"status": "ok"}

A request the backend cannot serve is a 400 (a 404 for another model's name) with
`{"error": {"message": ...}}`; an error inside the backend is a 500 of the same shape. The server runs
uvicorn on its own event loop in a daemon thread (`start_server`); `backend.generate` is awaited on that
loop, so a backend that computes on other threads must hand its results back thread-safely.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import threading
import time
import uuid
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from jaxrl.protocol import Completion, GenerateBackend, SamplingParams

logger = logging.getLogger(__name__)

GENERATE_ROUTE = "/inference/v1/generate"

# Sampling keys the train client sends that cannot change the sampled tokens here, so they are
# accepted and ignored: `skip_special_tokens` only shapes detokenized text (this route returns ids);
# `routed_experts_prompt_start` asks for MoE routing replay data, which the client reads only when the
# response carries `routed_experts` (this one never does).
_IGNORED_SAMPLING_KEYS = frozenset({"skip_special_tokens", "routed_experts_prompt_start"})
# vLLM knobs accepted only at the value that disables them (what a client that sets them everywhere
# sends by default); any other value would ask for sampling this engine does not do.
_NEUTRAL_SAMPLING_VALUES: dict[str, Any] = {
    "n": 1,
    "min_p": 0.0,
    "min_tokens": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "ignore_eos": False,
}
_SAMPLING_KEYS = frozenset(
    {"temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed", "logprobs"}
) | _IGNORED_SAMPLING_KEYS | frozenset(_NEUTRAL_SAMPLING_VALUES)
# Top-level request keys besides the three the route needs: `cache_salt` isolates vLLM's prefix cache
# between tenants and `priority` orders its queue; neither changes what is sampled.
_REQUEST_KEYS = frozenset({"model", "token_ids", "sampling_params", "cache_salt", "priority", "request_id"})


class BadRequest(ValueError):
    """A request the server refuses: HTTP `status` with `message` in the JSON error body."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse_sampling(raw: Any, prompt_len: int, max_model_len: int) -> SamplingParams:
    """Validates a request's `sampling_params` object into `SamplingParams`; raises `BadRequest`.

    Missing keys take `SamplingParams`' defaults, except `max_tokens`, which defaults to the room left
    in the context (`max_model_len - prompt_len`), as in vLLM.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object")
    unknown = sorted(set(raw) - _SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unsupported sampling parameter(s): {', '.join(unknown)}")
    for key, neutral in _NEUTRAL_SAMPLING_VALUES.items():
        if key in raw and raw[key] is not None and raw[key] != neutral:
            raise BadRequest(f"sampling parameter {key}={raw[key]!r} is not supported (only {neutral!r})")
    defaults = SamplingParams()

    temperature = raw.get("temperature")
    if temperature is None:
        temperature = defaults.temperature
    elif not _is_number(temperature) or temperature < 0:
        raise BadRequest(f"temperature must be a number >= 0, got {temperature!r}")

    top_p = raw.get("top_p")
    if top_p is None:
        top_p = defaults.top_p
    elif not _is_number(top_p) or not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p!r}")

    top_k = raw.get("top_k")
    if top_k is None:
        top_k = defaults.top_k
    elif not _is_int(top_k):
        raise BadRequest(f"top_k must be an integer, got {top_k!r}")

    max_tokens = raw.get("max_tokens")
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
        if max_tokens < 1:
            raise BadRequest(f"a prompt of {prompt_len} tokens fills the context of {max_model_len}")
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}")

    stop = raw.get("stop_token_ids")
    if stop is None:
        stop = []
    elif not isinstance(stop, list) or not all(_is_int(t) and t >= 0 for t in stop):
        raise BadRequest("stop_token_ids must be a list of non-negative integers")

    seed = raw.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed must be an integer, got {seed!r}")

    # The response always carries the sampled token's own logprob, which is what `logprobs` 0 or 1
    # asks vLLM for; more would mean top-k alternatives per position, which this route does not return.
    logprobs = raw.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or logprobs not in (0, 1)):
        raise BadRequest(f"logprobs must be 0 or 1, got {logprobs!r}")

    return SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        max_tokens=max_tokens,
        stop_token_ids=tuple(stop),
        seed=seed,
    )


def parse_generate_request(
    body: Any, backend: GenerateBackend
) -> tuple[list[int], SamplingParams, str | None]:
    """Validates a generate request body: (prompt ids, sampling, request id or None); raises `BadRequest`."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(set(body) - _REQUEST_KEYS)
    if unknown:
        raise BadRequest(f"unsupported request field(s): {', '.join(unknown)}")
    model = body.get("model")
    if model is not None and model != backend.model_name:
        raise BadRequest(f"model {model!r} does not exist; this server serves {backend.model_name!r}", 404)
    token_ids = body.get("token_ids")
    if token_ids is None:
        raise BadRequest("token_ids is required")
    if not isinstance(token_ids, list) or not token_ids:
        raise BadRequest("token_ids must be a non-empty list of integers")
    if not all(_is_int(t) and t >= 0 for t in token_ids):
        raise BadRequest("token_ids must contain only non-negative integers")
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("request_id must be a string")
    params = parse_sampling(body.get("sampling_params"), len(token_ids), backend.max_model_len)
    return token_ids, params, request_id


def generate_response(request_id: str, prompt_ids: list[int], completion: Completion) -> dict:
    """The response body for one finished request. Raises ValueError for a completion that breaks the
    backend contract (the client would reject it: one finite logprob per token)."""
    tokens, logprobs = completion.token_ids, completion.logprobs
    if len(tokens) != len(logprobs):
        raise ValueError(f"backend returned {len(tokens)} tokens but {len(logprobs)} logprobs")
    if not all(math.isfinite(lp) for lp in logprobs):
        raise ValueError("backend returned a non-finite logprob")
    content = [{"token": f"token_id:{t}", "logprob": float(lp)} 
               for t, lp in zip(tokens, logprobs, strict=True)]
    return {
        "request_id": request_id,
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "index": 0,
                "token_ids": tokens,
                "logprobs": {"content": content},
                "finish_reason": completion.finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt_ids) + len(tokens),
        },
    }


def build_app(backend: GenerateBackend) -> Starlette:
    """The starlette app serving `backend` (routes in the module docstring)."""
    created = int(time.time())

    async def generate(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
            return error_response(f"invalid JSON body: {e}", 400)
        try:
            prompt_ids, params, request_id = parse_generate_request(body, backend)
        except BadRequest as e:
            return error_response(str(e), e.status)
        try:
            completion = await backend.generate(prompt_ids, params)
        except ValueError as e:  # the backend's contract: a request it cannot serve
            return error_response(str(e), 400)
        except Exception as e:  # noqa: BLE001 - one failed request must not take the server down
            logger.exception("backend failed on a generate request")
            return error_response(f"backend error: {type(e).__name__}: {e}", 500)
        try:
            payload = generate_response(request_id or f"gen-{uuid.uuid4().hex}", prompt_ids, completion)
        except ValueError as e:
            logger.error("backend broke its contract: %s", e)
            return error_response(f"backend error: {e}", 500)
        return JSONResponse(payload)

    async def models(request: Request) -> JSONResponse:
        card = {
            "id": backend.model_name,
            "object": "model",
            "created": created,
            "owned_by": "jaxrl",
            "max_model_len": backend.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return error_response(exc.detail, exc.status_code)

    return Starlette(
        routes=[
            Route(GENERATE_ROUTE, generate, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
    )


@dataclasses.dataclass
class ServerHandle:
    """A running server. `base_url` is the OpenAI-style root ("http://HOST:PORT/v1") that verifiers'
    `TrainClientConfig.base_url` takes; the generate route lives beside it, at the server root."""

    host: str
    port: int
    _server: uvicorn.Server
    _thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self, timeout: float = 10.0) -> None:
        """Asks uvicorn to exit and waits up to `timeout` seconds for its thread."""
        self._server.should_exit = True
        self._thread.join(timeout)


def start_server(
    backend: GenerateBackend, host: str = "127.0.0.1", port: int = 0, *, startup_timeout: float = 30.0
) -> ServerHandle:
    """Serves `backend` on `host:port` (0: a free port) from a daemon thread; returns once the server
    accepts connections. Raises RuntimeError if it has not started within `startup_timeout` seconds,
    OSError if the port cannot be bound."""
    # Binding here, not in uvicorn, gives port 0's real port before the thread starts and surfaces
    # a bind error in the caller.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(backend), log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="jaxrl-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive():
            sock.close()
            raise RuntimeError(f"server on {host}:{bound_port} exited during startup")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"server on {host}:{bound_port} did not start in {startup_timeout:g} s")
        time.sleep(0.01)
    return ServerHandle(host=host, port=bound_port, _server=server, _thread=thread)
