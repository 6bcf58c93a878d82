"""The external teacher (`[jax.teacher] base_url`, `jaxrl.rl.teacher_client`) against a real HTTP server on
127.0.0.1 that answers vLLM's `/v1/models` and `/v1/completions` with `prompt_logprobs` (the reply format of
vllm.entrypoints.openai: one dict per prompt position keyed by token id, None first) from a bigram teacher
whose logprobs the test knows, and against `jaxrl serve`'s own server over the tiny Qwen3; and the run's
one-line refusal of a server that is down or does not score prompts."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from gcs_fixtures import free_port
from helpers import jaxrl, write_run_config

from jaxrl.config.teacher import TeacherConfig
from jaxrl.rl.batch import make_batch
from jaxrl.rl.teacher_client import TeacherUnavailable, check_server, parse_prompt_logprobs, score

VOCAB = 64
LOGITS = np.random.default_rng(0).normal(size=(VOCAB, VOCAB))
LOGP = LOGITS - np.log(np.exp(LOGITS).sum(axis=1, keepdims=True))  # log p(next | previous), a bigram teacher


class VllmStandIn(ThreadingHTTPServer):
    """vLLM's two routes over the bigram teacher; `fail_first` requests to /v1/completions answer 503,
    `prompt_logprobs=False` answers 400 to that field (as a server that does not know it does)."""

    def __init__(self, fail_first: int = 0, prompt_logprobs: bool = True) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.fail_left, self.prompt_logprobs, self.completions = fail_first, prompt_logprobs, 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: VllmStandIn

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": "teacher", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.completions += 1
        if self.server.fail_left > 0:
            self.server.fail_left -= 1
            return self._send(503, {"error": "busy"})
        if not self.server.prompt_logprobs:
            return self._send(400, {"error": {"message": "unknown field: prompt_logprobs"}})
        ids = body["prompt"]
        entries = [None] + [{str(t): {"logprob": float(LOGP[p, t]), "rank": 1, "decoded_token": f"t{t}"}}
                            for p, t in zip(ids[:-1], ids[1:], strict=True)]
        self._send(200, {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length",
                                      "prompt_logprobs": entries}]})


def _cfg(url: str, **kw) -> TeacherConfig:
    return TeacherConfig(base_url=url, model_name="teacher", **kw)


def test_the_client_reads_vllm_prompt_logprobs_and_retries():
    server = VllmStandIn(fail_first=2)
    try:
        samples = [[1, 5, 9, 2], [3, 3], [7, 0, 63]]
        logprobs, errors = asyncio.run(score(_cfg(server.base_url, max_concurrent=2), samples, backoff_s=0.01))
        assert errors == [] and server.completions == 5  # two 503s retried
        for ids, lps in zip(samples, logprobs, strict=True):
            np.testing.assert_allclose(lps, [0.0] + [LOGP[p, t] for p, t in zip(ids[:-1], ids[1:], strict=True)])
        batch = make_batch([(ids, [False] + [True] * (len(ids) - 1), [0.0] * len(ids)) for ids in samples],
                           np.zeros(3), 1.0, 8, logprobs)
        np.testing.assert_allclose(batch.teacher_logprobs[0, :3], [LOGP[1, 5], LOGP[5, 9], LOGP[9, 2]], rtol=1e-6)
        assert batch.teacher_logprobs[1, 1:].sum() == 0 and batch.teacher_logprobs[2, 2:].sum() == 0
        server.fail_left = 10
        logprobs, errors = asyncio.run(score(_cfg(server.base_url, retries=1), [[1, 2]], backoff_s=0.01))
        assert logprobs == [None] and len(errors) == 1 and "503" in errors[0]
    finally:
        server.shutdown()


def test_bad_replies_are_named():
    with pytest.raises(ValueError, match="no choices\\[0\\].prompt_logprobs"):
        parse_prompt_logprobs({"choices": [{}]}, [1, 2])
    with pytest.raises(ValueError, match="prompt_logprobs has 1 entries for 2 prompt tokens"):
        parse_prompt_logprobs({"choices": [{"prompt_logprobs": [None]}]}, [1, 2])
    with pytest.raises(ValueError, match="prompt_logprobs\\[1\\] has no finite logprob for token 2"):
        parse_prompt_logprobs({"choices": [{"prompt_logprobs": [None, {"3": {"logprob": -1.0}}]}]}, [1, 2])


def test_a_server_that_cannot_teach_is_one_line():
    port = free_port()
    with pytest.raises(TeacherUnavailable, match=f"the teacher's server http://127.0.0.1:{port}/v1/models cannot be "
                                                 "reached: ConnectError"):
        asyncio.run(check_server(_cfg(f"http://127.0.0.1:{port}/v1"), list, "student"))
    server = VllmStandIn(prompt_logprobs=False)
    try:
        with pytest.raises(TeacherUnavailable, match="does not serve 'other' \\(it serves 'teacher'\\)"):
            asyncio.run(check_server(TeacherConfig(base_url=server.base_url, model_name="other"), list, "student"))
        with pytest.raises(TeacherUnavailable, match="refuses a prompt_logprobs request: HTTP 400: .*unknown field"):
            asyncio.run(check_server(_cfg(server.base_url), list, "student"))
    finally:
        server.shutdown()


def test_jaxrl_run_with_a_server_down_is_one_line(tmp_path, tiny_model_dir):
    """Before anything loads: exit 2, one line naming the key and the server."""
    url = f"http://127.0.0.1:{free_port()}/v1"
    distil = f'\n[jax.loss]\nteacher_tau = 1.0\n\n[jax.teacher]\nbase_url = "{url}"\nmodel_name = "teacher"\n'
    cfg = write_run_config(tmp_path / "distil.toml", tiny_model_dir, name="distil", jax_extra=distil)
    done = jaxrl("run", cfg)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"{cfg}: jax.teacher.base_url: the teacher's server {url}/models cannot be reached: ConnectError: "
        "All connection attempts failed"]


def _encoder(folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def test_jaxrl_serve_teaches_with_the_models_own_logprobs(tmp_path, tiny_model_dir):
    """`jaxrl serve`'s `/v1/completions` answers `prompt_logprobs: 0` as vLLM does: each token's logprob given
    the tokens before it, the raw logits' log-softmax (here against the whole vocabulary's, from the model's
    forward), so the client reads the same numbers; alternatives (a count above 0) are refused by name.
    Its tokenizer is probed against the student's (`check_server`): the same passes; a student of another
    vocabulary is refused in one line, by `check_server` and by `jaxrl run` (exit 2, before anything loads)."""
    import httpx
    import jax.numpy as jnp
    from test_teacher import _other_tokenizer

    from jaxrl.cli import serve
    from jaxrl.inference.server import start_server
    from jaxrl.model import decoder, hf

    loaded = serve.load(str(tiny_model_dir), name="teacher", decode_slots=2, seq_len=128)
    handle = start_server(loaded.scheduler, chat_template=loaded.chat_template)
    try:
        cfg = _cfg(handle.base_url)
        asyncio.run(check_server(cfg, _encoder(tiny_model_dir), str(tiny_model_dir)))
        other = _other_tokenizer(tmp_path, tiny_model_dir)
        with pytest.raises(TeacherUnavailable) as err:
            asyncio.run(check_server(cfg, _encoder(other), str(other)))
        mismatch = ("the teacher's server tokenizes a probe text otherwise than the student's tokenizer "
                    f"({other}): 76 tokens there, 76 here, token 1 is 9707 there, 1879 here; distillation scores "
                    "the student's token ids, so the teacher must share its vocabulary")
        assert str(err.value) == mismatch
        distil = (f'\n[jax.loss]\nteacher_tau = 1.0\nadv_tau = 0.0\n\n[jax.teacher]\nbase_url = "{handle.base_url}"\n'
                  f'model_name = "teacher"\n')
        run_cfg = write_run_config(tmp_path / "other.toml", tiny_model_dir, name="other",
                                   jax_extra=f'tokenizer_path = "{other}"\n' + distil)
        done = jaxrl("run", run_cfg)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.strip().splitlines() == [f"{run_cfg}: jax.teacher.base_url: {mismatch}"]
        assert not (tmp_path / "runs" / "other" / "checkpoints").exists()
        samples = [[9707, 1879, 11, 1246], [151644, 872, 198]]
        logprobs, errors = asyncio.run(score(cfg, samples))
        assert errors == []
        mcfg, weights = hf.load_hf(str(tiny_model_dir))
        for ids, lps in zip(samples, logprobs, strict=True):
            hidden, _ = decoder.forward(mcfg, weights, jnp.asarray([ids]), jnp.arange(len(ids))[None])
            logits = np.asarray(decoder.logits(weights, hidden)[0], np.float64)
            full = logits - logits.max(-1, keepdims=True)
            full = full - np.log(np.exp(full).sum(-1, keepdims=True))
            np.testing.assert_allclose(lps[1:], [full[i, t] for i, t in enumerate(ids[1:])], atol=2e-5)
        reply = httpx.post(f"{handle.base_url}/completions", json={"model": "teacher", "prompt": [1, 2],
                                                                   "max_tokens": 1, "prompt_logprobs": 2})
        assert reply.status_code == 400 and "prompt_logprobs: only 0 is built" in reply.text
    finally:
        handle.stop()
        loaded.scheduler.stop()


def test_a_run_taught_by_a_served_teacher(tmp_path, tiny_model_dir):
    """`jaxrl run` with `[jax.teacher] base_url` on `jaxrl serve`'s server over a tiny Qwen3 of another seed:
    each trained sample's logprobs come from the server, `teacher/kl` is logged and none failed."""
    from jaxrl.cli import serve
    from jaxrl.inference.server import start_server
    from jaxrl.model import assets

    teacher = assets.build_tiny_model(tmp_path / "teacher", seed=1)
    loaded = serve.load(str(teacher), name="teacher", decode_slots=4, seq_len=160)
    handle = start_server(loaded.scheduler, chat_template=loaded.chat_template)
    try:
        distil = (f'\n[jax.loss]\nteacher_tau = 1.0\nadv_tau = 0.0\n\n[jax.teacher]\nbase_url = "{handle.base_url}"\n'
                  f'model_name = "teacher"\n')
        cfg = write_run_config(tmp_path / "served.toml", tiny_model_dir, name="served", jax_extra=distil)
        done = jaxrl("run", cfg, timeout=1200)
    finally:
        handle.stop()
        loaded.scheduler.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs" / "served" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["teacher/failed"] == 0 and rows[-1]["teacher/kl"] > 0 and rows[-1]["train/samples"] == 8
