"""The rollout server over a real uvicorn socket: wire format, verifiers' train client, 400s."""

import asyncio

import httpx
import pytest
from renderers import Qwen3RendererConfig
from starlette.requests import Request
from verifiers.v1 import SamplingConfig, TrainClientConfig
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.dialects import ChatDialect

from jaxrl.inference.protocol import BackendStopped, Completion, SamplingParams
from jaxrl.inference.server import GENERATE_ROUTE, ClientGone, read_json, start_server, unless_disconnected
from jaxrl.inference.wire import BadRequest

MODEL = "test-model"
MAX_MODEL_LEN = 256
RAISE_ID = 999_999  # a prompt containing it makes the backend fail (not a bad request)
NAN_ID = 999_998  # a prompt containing it makes the backend return a NaN logprob
STOPPED_ID = 999_997  # a prompt containing it meets a backend that is shutting down
IM_END = 151_645
STOP_IDS = (IM_END, 151_643)  # what Qwen3's renderer sends: <|im_end|>, <|endoftext|>


class ReverseBackend:
    """Emits the prompt reversed until a stop token (kept) or `max_tokens`; token i gets logprob
    -0.5 - i / 100."""

    model_name = MODEL
    max_model_len = MAX_MODEL_LEN

    def __init__(self):
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        self.calls.append((prompt_ids, params))
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens is too long")
        if RAISE_ID in prompt_ids:
            raise RuntimeError("engine exploded")
        if STOPPED_ID in prompt_ids:
            raise BackendStopped("the scheduler is stopped")
        out: list[int] = []
        finish = "length"
        for token in reversed(prompt_ids):
            if len(out) == params.max_tokens:
                break
            out.append(token)
            if token in params.stop_token_ids:
                finish = "stop"
                break
        logprobs = [-0.5 - i / 100 for i in range(len(out))]
        if NAN_ID in prompt_ids:
            logprobs[0] = float("nan")
        return Completion(out, logprobs, finish, [0] * len(out))


def expected_logprobs(n: int) -> list[float]:
    return [-0.5 - i / 100 for i in range(n)]


@pytest.fixture(scope="module")
def backend():
    return ReverseBackend()


@pytest.fixture(scope="module")
def server(backend):
    handle = start_server(backend)
    yield handle
    handle.stop()


@pytest.fixture
def root(server):
    return f"http://127.0.0.1:{server.port}"


def test_handle(server):
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
    assert server.port > 0


def test_generate_wire_format(root, backend):
    # The body verifiers' train client sends (renderers.client.generate): sampling from the rollout's
    # SamplingConfig, plus the renderer's stop ids, logprobs=1 and skip_special_tokens=False.
    body = {
        "model": MODEL,
        "token_ids": [11, 12, 13, 14],
        "sampling_params": {
            "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 7, "max_tokens": 3,
            "stop_token_ids": list(STOP_IDS), "logprobs": 1, "skip_special_tokens": False,
        },
    }
    r = httpx.post(root + GENERATE_ROUTE, json=body, headers={"X-Session-ID": "trace-1"})
    assert r.status_code == 200, r.text
    data = r.json()
    assert set(data) == {"request_id", "prompt_token_ids", "choices", "usage"}
    assert isinstance(data["request_id"], str) and data["request_id"]
    assert data["prompt_token_ids"] == [11, 12, 13, 14]
    assert data["choices"] == [{
        "index": 0,
        "token_ids": [14, 13, 12],
        "logprobs": {"content": [
            {"token": "token_id:14", "logprob": -0.5},
            {"token": "token_id:13", "logprob": -0.51},
            {"token": "token_id:12", "logprob": -0.52},
        ]},
        "finish_reason": "length",
    }]
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert backend.calls[-1] == (
        [11, 12, 13, 14],
        SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=3, stop_token_ids=STOP_IDS, seed=7),
    )


def test_generate_stop_and_defaults(root, backend):
    r = httpx.post(root + GENERATE_ROUTE, json={"token_ids": [1, IM_END, 2, 3], "sampling_params": {
        "stop_token_ids": [IM_END], "max_tokens": 10, "routed_experts_prompt_start": 0, "n": 1}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [3, 2, IM_END]
    assert choice["finish_reason"] == "stop"
    # Without sampling_params: SamplingParams' defaults, max_tokens = the room left in the context.
    r = httpx.post(root + GENERATE_ROUTE, json={"token_ids": [5, 6]})
    assert r.status_code == 200, r.text
    assert backend.calls[-1][1] == SamplingParams(max_tokens=MAX_MODEL_LEN - 2)


def test_models_and_health(server, root):
    models = httpx.get(server.base_url + "/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", MAX_MODEL_LEN)
    health = httpx.get(root + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "pending": 0}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "invalid JSON"),
        (b"\xff\xfe", "invalid JSON"),
        ([1, 2], "JSON object"),
        ({"model": MODEL}, "token_ids is required"),
        ({"token_ids": []}, "non-empty"),
        ({"token_ids": "1 2"}, "non-empty list"),
        ({"token_ids": [1, 2.5]}, "integers"),
        ({"token_ids": [1, "2"]}, "integers"),
        ({"token_ids": [True]}, "integers"),
        ({"token_ids": [-1]}, "integers"),
        ({"token_ids": [1], "sampling_params": {"temperature": -0.1}}, "temperature"),
        ({"token_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "max_tokens"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 2.0}}, "max_tokens"),
        ({"token_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"token_ids": [1], "sampling_params": {"top_k": 1.5}}, "top_k"),
        ({"token_ids": [1], "sampling_params": {"seed": "x"}}, "seed"),
        ({"token_ids": [1], "sampling_params": {"stop_token_ids": [1.5]}}, "stop_token_ids"),
        ({"token_ids": [1], "sampling_params": {"logprobs": 5}}, "logprobs"),
        ({"token_ids": [1], "sampling_params": {"min_p": 1.5}}, "min_p"),
        ({"token_ids": [1], "sampling_params": {"min_tokens": -1}}, "min_tokens"),
        ({"token_ids": [1], "sampling_params": {"min_tokens": True}}, "min_tokens"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 4, "min_tokens": 5}},
         "min_tokens must be an integer in [0, max_tokens = 4], got 5"),
        ({"token_ids": [1], "sampling_params": {"beam_width": 4}}, "beam_width"),
        ({"token_ids": [1], "sampling_params": [1]}, "object"),
        ({"token_ids": [1], "features": {}}, "features"),
        ({"token_ids": [1], "sampling_params": {"temperature": 1e39}}, "temperature"),  # beyond float32
        ({"token_ids": [1], "sampling_params": {"max_tokens": -5}}, "max_tokens"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": True}}, "max_tokens"),
        ({"token_ids": [1], "sampling_params": {"seed": 2**64}}, "seed"),
        ({"token_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
        (b'{"token_ids": [1], "sampling_params": {"max_tokens": 1e999}}', "max_tokens"),  # inf
        (b'{"token_ids": [1], "sampling_params": {"top_p": NaN}}', "top_p"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid JSON"),  # deeper than the parser's recursion limit
        ({"token_ids": list(range(MAX_MODEL_LEN)), "sampling_params": {"max_tokens": 1}}, "too long"),
        ({"token_ids": list(range(MAX_MODEL_LEN))}, "fills the context"),
    ],
)
def test_bad_requests_are_400(root, body, needle):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(root + GENERATE_ROUTE, **kwargs)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert needle in message
    assert httpx.get(root + "/health").status_code == 200


def test_huge_values_within_range_are_served(root, backend):
    """Values at the edge of their range; `max_tokens` fills the context exactly (one more is a 400, as
    in vLLM: test_chat.py)."""
    params = {"top_k": 10**30, "max_tokens": backend.max_model_len - 2, "seed": -(2**63), "temperature": 1e-9,
              "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": backend.max_model_len - 2}
    r = httpx.post(root + GENERATE_ROUTE, json={"token_ids": [3, 4], "sampling_params": params})
    assert r.status_code == 200, r.text
    assert backend.calls[-1][1] == SamplingParams(temperature=0.0, top_k=2**31 - 1, min_p=0.05, repetition_penalty=1.3,
                                                  max_tokens=backend.max_model_len - 2, seed=-(2**63),
                                                  min_tokens=backend.max_model_len - 2)


def test_body_over_the_limit_is_413(root):
    r = httpx.post(root + GENERATE_ROUTE, content=b" " * (16 * 2**20 + 1))
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_api_key(backend):
    handle = start_server(backend, api_key="s3cret")
    root = f"http://127.0.0.1:{handle.port}"
    try:
        body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(root + GENERATE_ROUTE, json=body, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
            error = r.json()["error"]
            assert "API key" in error["message"] and (error["type"], error["param"], error["code"]) == (
                "AuthenticationError", None, 401)
            assert httpx.get(handle.base_url + "/models", headers=headers).status_code == 401
        assert httpx.get(root + "/nowhere").status_code == 401  # no route is revealed without the key
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.post(root + GENERATE_ROUTE, json=body, headers=good).status_code == 200
        for scheme in ("bearer", "BEARER"):  # an auth scheme is matched without regard to case (RFC 9110)
            r = httpx.post(root + GENERATE_ROUTE, json=body, headers={"Authorization": f"{scheme} s3cret"})
            assert r.status_code == 200, r.text
        assert httpx.get(handle.base_url + "/models", headers=good).status_code == 200
        assert httpx.get(root + "/health").status_code == 200  # open, for load balancers
    finally:
        handle.stop()


def test_a_request_dropped_at_shutdown_is_a_503_not_a_logged_failure(root, caplog):
    """A run's close stops the scheduler under requests still in flight: their clients get a 503, and the
    run's console no traceback (a 500 logs one)."""
    with caplog.at_level("INFO", logger="jaxrl.inference.server"):
        r = httpx.post(root + GENERATE_ROUTE, json={"token_ids": [1, STOPPED_ID]})
        assert r.status_code == 503 and "the request was dropped" in r.json()["error"]["message"]
        assert not [rec for rec in caplog.records if rec.exc_info]
        r = httpx.post(root + GENERATE_ROUTE, json={"token_ids": [1, RAISE_ID]})
        assert r.status_code == 500 and [rec for rec in caplog.records if rec.exc_info]


def test_other_errors(root):
    r = httpx.post(root + GENERATE_ROUTE, json={"model": "other", "token_ids": [1]})
    assert r.status_code == 404 and "other" in r.json()["error"]["message"]
    assert {k: v for k, v in r.json()["error"].items() if k != "message"} == {  # OpenAI's shape, vLLM's values
        "type": "NotFoundError", "param": None, "code": 404}
    r = httpx.post(root + GENERATE_ROUTE, json={"token_ids": [1], "sampling_params": {"best_of": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.best_of", r.text
    assert r.json()["error"]["type"] == "BadRequestError"
    r = httpx.post(root + GENERATE_ROUTE, json={"token_ids": [1, RAISE_ID]})
    assert r.status_code == 500 and "engine exploded" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "InternalServerError"
    r = httpx.post(root + GENERATE_ROUTE, json={"token_ids": [1, NAN_ID]})
    assert r.status_code == 500 and "non-finite" in r.json()["error"]["message"]
    r = httpx.get(root + GENERATE_ROUTE)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(root + "/nowhere")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(root + "/health").status_code == 200


def test_verifiers_train_client_accepts_responses(server, backend, qwen3_tokenizer_dir):
    """verifiers' own client renders the chat, posts it, and parses our response without complaint."""
    config = TrainClientConfig(
        base_url=server.base_url,
        api_key_var="JAXRL_TEST_KEY",
        renderer=Qwen3RendererConfig(enable_thinking=False),
        renderer_model_name=str(qwen3_tokenizer_dir),
    )

    async def ask():
        client = TrainClient(config)
        try:
            return await client.get_response(
                ChatDialect(),
                {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}]},
                SamplingConfig(temperature=0.5, max_tokens=4, top_k=3, seed=1),
                session_id="trace-2",
            )
        finally:
            await client.close()

    response = asyncio.run(ask())
    prompt_ids, params = backend.calls[-1]
    tokens = response.tokens
    assert tokens.prompt_ids == prompt_ids
    assert tokens.completion_ids == prompt_ids[::-1][:4]
    assert tokens.completion_logprobs == pytest.approx(expected_logprobs(4))
    assert response.finish_reason == "length"
    assert params == SamplingParams(temperature=0.5, top_k=3, max_tokens=4, stop_token_ids=STOP_IDS, seed=1)


def _request_from_a_client_that_left() -> Request:
    """A real starlette request whose connection is already closed (`receive` answers `http.disconnect`)."""
    async def receive():
        return {"type": "http.disconnect"}
    return Request({"type": "http", "method": "POST", "path": GENERATE_ROUTE, "headers": []}, receive)


def test_a_client_gone_before_the_backend_answers_is_client_gone_not_an_internal_error():
    """The backend's work is cancelled and `ClientGone` raised (a 499), not `InvalidStateError` from reading a
    result that a just-requested cancel has not yet set (seen in a SIGTERM'd run's console)."""
    async def slow_backend():
        await asyncio.sleep(60)

    with pytest.raises(ClientGone):
        asyncio.run(asyncio.wait_for(unless_disconnected(_request_from_a_client_that_left(), slow_backend()), 10))


def test_a_client_gone_while_its_body_is_read_is_a_bad_request_not_a_traceback():
    """starlette's `ClientDisconnect` from the body stream becomes `BadRequest` 499, which the routes answer
    (uvicorn logged it as an unhandled exception, with a traceback, in a SIGTERM'd run's console)."""
    with pytest.raises(BadRequest) as e:
        asyncio.run(read_json(_request_from_a_client_that_left(), 1 << 20))
    assert e.value.status == 499
