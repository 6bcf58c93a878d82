"""The inference server: vLLM's token-in/token-out route and OpenAI chat completions over a `GenerateBackend`.

verifiers' train client (`verifiers.v1.clients.train.TrainClient`, via `renderers.client.generate`)
renders chats to token ids itself and POSTs them to `/inference/v1/generate`; it checks that every
sampled token comes with a finite logprob tagged `token_id:<id>`. `/v1/models` tells it the context
length, so it refuses an overlong prompt before sending it. Eval clients and people use
`/v1/chat/completions` (`jaxrl.inference.chat`) and `/v1/completions` (`jaxrl.inference.completions`), both
served when the app is given a chat template, both with `top_logprobs` from the engine's distribution.

    POST /inference/v1/generate  {"model", "token_ids", "sampling_params": {...}}
      -> {"request_id", "prompt_token_ids", "choices": [{"index", "token_ids",
          "logprobs": {"content": [{"token": "token_id:<id>", "logprob"}]}, "finish_reason"}], "usage"}
    POST /v1/chat/completions    OpenAI's format, streaming or not (see `jaxrl.inference.chat`)
    POST /v1/completions         OpenAI's text completions, streaming or not (`jaxrl.inference.completions`)
    GET  /v1/models              -> {"object": "list", "data": [{"id", "object", "max_model_len", ...}]}
    GET  /v1/models/{id}         -> {"id", "object", "max_model_len", ...} (404 for another name)
    GET  /health                 -> {"status": "ok", "pending": <generation requests queued or running>}

Every refusal is OpenAI's `{"error": {"message", "type", "param", "code"}}` as vLLM fills it (`type` the
openai SDK's exception name, `param` the field at fault or null, `code` the HTTP status): 400 for a
request the server cannot serve (naming the field), 404 for another model's name, 401 without the API
key (when one is set; `/health` is open; the scheme `Bearer` in any case), 413 for a body over the
limit, 503 with `Retry-After` while `max_pending` generation requests
are queued or running (below that bound requests wait in the scheduler's queue), 500 for an error in
the backend. A field the server does not know, or knows and has not built, is a 400 naming it on
every route (OpenAI's rule; vLLM logs and ignores them). `max_tokens` beyond the context is a 400 naming
both numbers, as in vLLM and OpenAI (the run's own server clamps it instead: `clamp_max_tokens`). A
request whose client disconnects is cancelled in the backend, streaming or not, freeing its decode
slot. A request's CPU work (parsing its JSON, rendering and tokenizing its prompt) runs in a worker
thread, and a chat prompt is refused once a prefix of it fills the context (`template.encode_within`), so a
10 MB prompt is a 400 in well under a second while `/health` keeps answering (it took 8 s when that
work ran on the event loop). The server runs uvicorn on its own event loop in a daemon thread (`start_server`);
`backend.generate` is awaited on that loop, so a backend that computes on other threads must hand its
results back thread-safely.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxrl.inference import chat, completions
from jaxrl.inference.protocol import BackendStopped, Completion, GenerateBackend, SamplingParams
from jaxrl.inference.template import ChatTemplate
from jaxrl.inference.wire import BadRequest, check_penalties, error_body, is_int, sampling_from

logger = logging.getLogger(__name__)
T = TypeVar("T")

GENERATE_ROUTE = "/inference/v1/generate"
DEFAULT_MAX_PENDING = 1024
DEFAULT_MAX_BODY_BYTES = 16 * 2**20

# Sampling keys the train client sends that cannot change the sampled tokens here, so they are
# accepted and ignored: `skip_special_tokens` only shapes detokenized text (this route returns ids);
# `routed_experts_prompt_start` asks for MoE routing replay data, which the client reads only when the
# response carries `routed_experts` (this one never does).
_IGNORED_SAMPLING_KEYS = frozenset({"skip_special_tokens", "routed_experts_prompt_start"})
# vLLM knobs accepted only at the value that disables them (what a client that sets them everywhere
# sends by default); any other value would ask for sampling this engine does not do.
_NEUTRAL_SAMPLING_VALUES: dict[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "ignore_eos": False,
}
_SAMPLING_KEYS = frozenset(
    {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "stop_token_ids", "min_tokens",
     "seed", "logprobs"}
) | _IGNORED_SAMPLING_KEYS | frozenset(_NEUTRAL_SAMPLING_VALUES)
# Top-level request keys besides the three the route needs: `cache_salt` isolates vLLM's prefix cache
# between tenants and `priority` orders its queue; neither changes what is sampled.
_REQUEST_KEYS = frozenset({"model", "token_ids", "sampling_params", "cache_salt", "priority", "request_id"})


def error_response(message: str, status: int, headers: dict[str, str] | None = None,
                   param: str | None = None) -> JSONResponse:
    """A refusal in OpenAI's error shape (`jaxrl.inference.wire.error_body`)."""
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def parse_sampling(raw: Any, prompt_len: int, max_model_len: int, clamp_max_tokens: bool = False) -> SamplingParams:
    """Validates a generate request's `sampling_params` object (`jaxrl.inference.wire.sampling_from`'s fields,
    plus vLLM's that this route accepts) into `SamplingParams`; raises `BadRequest`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object", param="sampling_params")
    unknown = sorted(set(raw) - _SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unsupported sampling parameter(s): {', '.join(unknown)}",
                         param=f"sampling_params.{unknown[0]}")
    for key, neutral in _NEUTRAL_SAMPLING_VALUES.items():
        if key in raw and raw[key] is not None and raw[key] != neutral:
            raise BadRequest(f"sampling parameter {key}={raw[key]!r} is not supported (only {neutral!r})",
                             param=f"sampling_params.{key}")
    # The response always carries the sampled token's own logprob, which is what `logprobs` 0 or 1
    # asks vLLM for; more would mean top-k alternatives per position, which this route does not return.
    logprobs = raw.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or logprobs not in (0, 1)):
        raise BadRequest(f"logprobs must be 0 or 1, got {logprobs!r}", param="sampling_params.logprobs")
    try:
        check_penalties(raw)
        return sampling_from(raw, prompt_len, max_model_len, clamp_max_tokens, prompt_field="token_ids")
    except BadRequest as exc:  # the field is a key of sampling_params here
        inside = exc.param not in (None, "token_ids")
        raise BadRequest(str(exc), exc.status, f"sampling_params.{exc.param}" if inside else exc.param) from None


def parse_generate_request(
    body: Any, backend: GenerateBackend, clamp_max_tokens: bool = False
) -> tuple[list[int], SamplingParams, str | None]:
    """Validates a generate request body: (prompt ids, sampling, request id or None); raises `BadRequest`."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    unknown = sorted(set(body) - _REQUEST_KEYS)
    if unknown:
        raise BadRequest(f"unsupported request field(s): {', '.join(unknown)}", param=unknown[0])
    model = body.get("model")
    if model is not None and model != backend.model_name:
        raise BadRequest(f"model {model!r} does not exist; this server serves {backend.model_name!r}", 404)
    token_ids = body.get("token_ids")
    if token_ids is None:
        raise BadRequest("token_ids is required", param="token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise BadRequest("token_ids must be a non-empty list of integers", param="token_ids")
    if not all(is_int(t) and t >= 0 for t in token_ids):
        raise BadRequest("token_ids must contain only non-negative integers", param="token_ids")
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("request_id must be a string", param="request_id")
    params = parse_sampling(body.get("sampling_params"), len(token_ids), backend.max_model_len, clamp_max_tokens)
    return token_ids, params, request_id


def generate_response(request_id: str, prompt_ids: list[int], completion: Completion) -> dict:
    """The response body for one finished request. Raises ValueError for a completion that breaks the
    backend contract (the client would reject it: one finite logprob per token)."""
    tokens, logprobs = completion.token_ids, completion.logprobs
    if len(tokens) != len(logprobs):
        raise ValueError(f"backend returned {len(tokens)} tokens but {len(logprobs)} logprobs")
    if not all(math.isfinite(lp) for lp in logprobs):
        raise ValueError("backend returned a non-finite logprob")
    content = [{"token": f"token_id:{t}", "logprob": float(lp)} for t, lp in zip(tokens, logprobs, strict=True)]
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


class Admission:
    """Counts the generation requests queued or running; refuses one more beyond `limit` (a 503),
    so that a flood is answered at once instead of piling up without bound. Used from the event loop
    only, hence no lock."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_pending must be >= 1, got {limit}")
        self.limit = limit
        self.active = 0

    def enter(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        self.active -= 1


class RequireApiKey:
    """ASGI middleware: every HTTP request but `GET /health` must carry `Authorization: Bearer <key>`
    (a 401 otherwise, as OpenAI's API answers). The scheme is matched without regard to case (RFC 9110,
    section 11.1: `bearer` and `BEARER` are the same scheme); the key's comparison takes constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self._expected):
                response = error_response("missing or wrong API key (send Authorization: Bearer <key>)", 401,
                                          {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client closed its connection before the response was ready."""


def backend_failure(exc: Exception, route: str) -> JSONResponse:
    """The refusal for a request on `route` whose backend work raised `exc`, one mapping for every route:
    499 when the client left (`ClientGone`), 400 for a `ValueError` (the backend's contract: a request it
    cannot serve), 503 for `BackendStopped` (shutting down: no failure to log), else 500, logged with its
    traceback."""
    match exc:
        case ClientGone():
            return error_response("client disconnected", 499)
        case ValueError():
            return error_response(str(exc), 400, param=getattr(exc, "param", None) or "body")
        case BackendStopped():
            return error_response(f"{exc}; the request was dropped", 503)
    logger.error("backend failed on a %s request", route, exc_info=exc)
    return error_response(f"backend error: {type(exc).__name__}: {exc}", 500)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects. Only after the body has been read: uvicorn then answers
    `receive()` with `http.disconnect` once the connection closes, and not before."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled (and `ClientGone` raised) when the client disconnects first: a
    non-streaming request's backend work stops, and its decode slot is freed, as a stream's is."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    finished = False
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finished = task.done()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # only requested: the task is not `cancelled()` until it next runs
    if not finished or task.cancelled():
        raise ClientGone
    return task.result()


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request's JSON body; raises `BadRequest` (413 beyond `max_bytes`, 400 for anything that is
    not JSON, including nesting too deep for the parser, 499 when the client disconnects before its body
    has arrived: a client stopped mid-request, as an environment is at a run's shutdown)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(f"request body of {declared} bytes exceeds the limit of {max_bytes}", 413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BadRequest(f"request body exceeds the limit of {max_bytes} bytes", 413)
            chunks.append(chunk)
    except ClientDisconnect:
        raise BadRequest("client disconnected before its request body arrived", 499) from None
    try:  # a 16 MiB body parses in about 0.1 s: in a worker thread, as the request's other CPU work
        return await asyncio.to_thread(json.loads, b"".join(chunks))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest(f"invalid JSON body: {e}", param="body") from None


@dataclasses.dataclass
class _Routes:
    """The app's route handlers, one method per route, over the state they share (`build_app` documents
    the arguments)."""

    backend: GenerateBackend
    chat_template: ChatTemplate | None
    admission: Admission
    max_body_bytes: int
    clamp_max_tokens: bool
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def card(self) -> dict[str, Any]:
        """The served model as `/v1/models` lists it."""
        return {"id": self.backend.model_name, "object": "model", "created": self.created, "owned_by": "jaxrl",
                "max_model_len": self.backend.max_model_len}

    def overloaded(self) -> JSONResponse:
        return error_response(f"server overloaded: {self.admission.active} requests queued or running (limit "
                              f"{self.admission.limit}); retry later", 503, {"Retry-After": "1"})

    async def generate(self, request: Request) -> JSONResponse:
        """`POST /inference/v1/generate`."""
        try:
            prompt_ids, params, request_id = await asyncio.to_thread(
                parse_generate_request, await read_json(request, self.max_body_bytes), self.backend,
                self.clamp_max_tokens)
        except BadRequest as e:
            return error_response(str(e), e.status, param=e.param)
        if not self.admission.enter():
            return self.overloaded()
        try:
            completion = await unless_disconnected(request, self.backend.generate(prompt_ids, params))
        except Exception as e:  # noqa: BLE001 - one failed request must not take the server down
            return backend_failure(e, "generate")
        finally:
            self.admission.leave()
        try:
            payload = generate_response(request_id or f"gen-{uuid.uuid4().hex}", prompt_ids, completion)
        except ValueError as e:
            logger.error("backend broke its contract: %s", e)
            return error_response(f"backend error: {e}", 500)
        return JSONResponse(payload)

    async def chat_completions(self, request: Request) -> Response:
        """`POST /v1/chat/completions`, streaming or not (served only with a chat template)."""
        return await self._text(request, chat.parse_chat_request, chat.complete, chat.stream, "chat")

    async def completions(self, request: Request) -> Response:
        """`POST /v1/completions`, streaming or not (served only with a chat template: its tokenizer)."""
        return await self._text(request, completions.parse_completion_request, completions.complete,
                                completions.stream, "completions")

    async def _text(self, request: Request, parse: Callable[..., chat.ChatRequest],
                    complete: Callable[[chat.ChatRun, str], Awaitable[dict]],
                    stream: Callable[[chat.ChatRun, str], AsyncIterator[str]], route: str) -> Response:
        """A route that answers in text over `chat.ChatRun`: `parse(body, template, model name, context,
        clamp_max_tokens)` the request, then `complete` it or `stream` its events."""
        backend, template = self.backend, self.chat_template
        assert template is not None
        try:
            body = await read_json(request, self.max_body_bytes)
            # rendering and tokenizing in a worker thread: /health and the other requests go on meanwhile
            req = await asyncio.to_thread(parse, body, template, backend.model_name, backend.max_model_len,
                                          self.clamp_max_tokens)
        except BadRequest as e:
            return error_response(str(e), e.status, param=e.param)
        if not self.admission.enter():
            return self.overloaded()
        run = chat.ChatRun(backend, template, req, self.admission.leave)
        if req.stream:
            return StreamingResponse(stream(run, backend.model_name), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return JSONResponse(await unless_disconnected(request, complete(run, backend.model_name)))
        except Exception as e:  # noqa: BLE001 - one failed request must not take the server down
            return backend_failure(e, route)

    async def models(self, request: Request) -> JSONResponse:
        """`GET /v1/models`."""
        return JSONResponse({"object": "list", "data": [self.card]})

    async def model(self, request: Request) -> JSONResponse:
        """`GET /v1/models/{name}`: 404 for another name."""
        name = request.path_params["name"]
        if name != self.backend.model_name:
            return error_response(f"model {name!r} does not exist; this server serves "
                                  f"{self.backend.model_name!r}", 404)
        return JSONResponse(self.card)

    async def health(self, request: Request) -> JSONResponse:
        """`GET /health`."""
        return JSONResponse({"status": "ok", "pending": self.admission.active})


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (e.g. 404 for an unknown path, 405 for a wrong method) in the server's error format."""
    assert isinstance(exc, HTTPException)
    return error_response(exc.detail, exc.status_code)


def build_app(backend: GenerateBackend, *, chat_template: ChatTemplate | None = None, api_key: str | None = None,
              max_pending: int = DEFAULT_MAX_PENDING, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              clamp_max_tokens: bool = False) -> ASGIApp:
    """The ASGI app serving `backend` (routes in the module docstring).

    Args:
        chat_template: the tokenizer `/v1/chat/completions` renders with and `/v1/completions` tokenizes
            with; None: neither route.
        api_key: when set, required as `Authorization: Bearer <key>` on every route but `/health`.
        max_pending: generation requests (both routes) queued or running at once; one more gets a 503
            with `Retry-After`.
        max_body_bytes: larger request bodies get a 413.
        clamp_max_tokens: cut a `max_tokens` beyond the context to the room left instead of a 400 (the
            run's own server: its rollout clients ask for `[sampling] max_tokens` on every turn, and a
            turn that reaches the context ends with finish_reason "length").
    """
    r = _Routes(backend, chat_template, Admission(max_pending), max_body_bytes, clamp_max_tokens)
    routes = [
        Route(GENERATE_ROUTE, r.generate, methods=["POST"]),
        Route("/v1/models", r.models, methods=["GET"]),
        Route("/v1/models/{name:path}", r.model, methods=["GET"]),
        Route("/health", r.health, methods=["GET"]),
    ]
    if chat_template is not None:
        routes.append(Route(chat.CHAT_ROUTE, r.chat_completions, methods=["POST"]))
        routes.append(Route(completions.ROUTE, r.completions, methods=["POST"]))
    app: ASGIApp = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    return RequireApiKey(app, api_key) if api_key else app


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
    backend: GenerateBackend, host: str = "127.0.0.1", port: int = 0, *, startup_timeout: float = 30.0,
    chat_template: ChatTemplate | None = None, api_key: str | None = None, max_pending: int = DEFAULT_MAX_PENDING,
    clamp_max_tokens: bool = False,
) -> ServerHandle:
    """Serves `backend` on `host:port` (0: a free port) from a daemon thread; returns once the server
    accepts connections. `chat_template`, `api_key`, `max_pending` and `clamp_max_tokens` are `build_app`'s. Raises
    RuntimeError if it has not started within `startup_timeout` seconds, OSError if the port cannot be
    bound."""
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
    app = build_app(backend, chat_template=chat_template, api_key=api_key, max_pending=max_pending,
                    clamp_max_tokens=clamp_max_tokens)
    # A stream still open at shutdown is cut after a few seconds rather than holding the exit.
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=5)
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
