"""`jaxrl serve` as a user runs it: a subprocess serving the tiny Qwen3 folder (with an API key) and a
run's checkpoint (base + LoRA, checked against the model's own logprobs), answering /health and chat,
then stopped by SIGINT / SIGTERM; and its errors as one clear line."""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import spawn
from typer.testing import CliRunner

from jaxrl.cli.main import app
from jaxrl.config.schema import load_config
from jaxrl.model import decoder, hf, modules
from jaxrl.parallel.spec import is_spec
from jaxrl.rl.train import TrainState, make_optimizer
from jaxrl.run import layout
from jaxrl.run.checkpoint import Checkpointer
from jaxrl.run.identity import model_identity

KEY_VAR = "JAXRL_TEST_SERVE_KEY"
RANK, ALPHA = 4, 8
RUN_TOML = """
name = "exp"
model = "jaxrl/qwen3-tiny"
max_steps = 3
batch_size = 4
rollouts_per_example = 4
lora_alpha = {alpha}

[[env]]
id = "jaxrl/lowercase"

[jax]
model_path = "{model}"
output_dir = "{runs}"
lora_rank = {rank}
"""


def serve(args: list[str], log: Path, **env: str) -> tuple[subprocess.Popen, str]:
    """`python -m jaxrl serve ARGS --port 0` on one CPU device; returns the process and its base URL
    once it prints it."""
    proc = spawn("serve", *args, "--port", "0", "--seq-len", "64", "--decode-slots", "2", "--no-warmup", log=log,
                 **env)
    deadline = time.monotonic() + 300
    while not (found := re.search(r"at (http://127\.0\.0\.1:\d+/v1) ", log.read_text())):
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc, found.group(1)


def stop(proc: subprocess.Popen, sig: int, log: Path) -> None:
    proc.send_signal(sig)
    assert proc.wait(60) == 0, log.read_text()
    assert "stopping" in log.read_text() and "Traceback" not in log.read_text()


def test_serve_a_model_folder_with_an_api_key(tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    proc, base = serve([str(tiny_model_dir), "--name", "tiny", "--api-key-env", KEY_VAR, "--decode-steps-per-dispatch",
                        "3"], log, **{KEY_VAR: "k3y"})
    try:
        root = base.removesuffix("/v1")
        assert httpx.get(root + "/health").json() == {"status": "ok", "pending": 0}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 5, "temperature": 0}
        assert httpx.post(base + "/chat/completions", json=body).status_code == 401
        r = httpx.post(base + "/chat/completions", json=body, headers={"Authorization": "Bearer k3y"}, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
        assert r.json()["usage"]["completion_tokens"] == 5 or choice["finish_reason"] == "stop"
        models = httpx.get(base + "/models", headers={"Authorization": "Bearer k3y"}).json()
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", 64)]
        assert "3 decode steps a dispatch" in log.read_text()
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGINT, log)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    """A run folder as `jaxrl run` leaves it (run_config.json, checkpoints/3) with a random LoRA (both factors
    nonzero, so it moves the logits), and that LoRA."""
    tmp = tmp_path_factory.mktemp("served-run")
    toml = tmp / "rl.toml"
    toml.write_text(RUN_TOML.format(model=tiny_model_dir, runs=tmp / "runs", alpha=ALPHA, rank=RANK))
    cfg = load_config(toml)
    run = tmp / "runs" / "exp"
    run.mkdir(parents=True)
    layout.write_run_config(run, cfg)
    mcfg, params = hf.load_hf(tiny_model_dir)
    targets = tuple(cfg.jax.lora_targets)
    specs = modules.lora_specs(mcfg, RANK, targets)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    rng = np.random.default_rng(1)
    dims = {**mcfg.dims(), "R": RANK}
    lora = jax.tree.unflatten(treedef, [jnp.asarray(0.3 * rng.standard_normal(s.shape(dims)), jnp.float32)
                                        for s in leaves])
    ckpt = Checkpointer(str(run / "checkpoints"))
    identity = model_identity(cfg.model, dataclasses.asdict(mcfg), RANK, targets)
    opt_state = make_optimizer(1e-3).init({"base": params, "lora": lora})
    ckpt.save(3, TrainState(lora, opt_state, jnp.asarray(3, jnp.int32)), {"step": 3, "identity": identity})
    ckpt.wait()
    ckpt.close()
    return run, mcfg, params, lora


@pytest.mark.numerics
def test_serve_a_checkpoint_applies_its_lora(run_dir, tmp_path):
    run, mcfg, params, lora = run_dir
    log = tmp_path / "serve.log"
    proc, base = serve([str(run)], log)
    try:
        assert f"checkpoint step 3 of {run / 'checkpoints'} (LoRA r{RANK}" in log.read_text()
        body = {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6, "temperature": 1.0, "seed": 5,
                "logprobs": True, "return_token_ids": True}
        r = httpx.post(base + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGTERM, log)
    prompt, ids = got["prompt_token_ids"], got["choices"][0]["token_ids"]
    lps = [e["logprob"] for e in got["choices"][0]["logprobs"]["content"]]
    tokens = jnp.asarray([prompt + ids])
    positions = jnp.arange(tokens.shape[1])[None]

    def logprobs(lora_or_none):
        hidden, _ = decoder.forward(mcfg, params, tokens, positions, lora=lora_or_none, lora_scale=ALPHA / RANK)
        lp = np.asarray(jax.nn.log_softmax(decoder.logits(params, hidden)[0], axis=-1))
        return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(ids)]

    np.testing.assert_allclose(lps, logprobs(lora), atol=1e-4)
    assert np.max(np.abs(np.asarray(lps) - logprobs(None))) > 1e-2  # the LoRA matters at this size


@pytest.mark.parametrize(("args", "message"), [
    (["{tmp}/nowhere"], "nowhere is not a model folder (config.json + safetensors), a Hugging Face id nor a run's "
                        "checkpoint"),
    (["owner/model@v2"], "model owner/model@v2 is not in the Hugging Face cache {tmp}/hf and HF_HUB_OFFLINE is set"),
    (["{model}", "--api-key-env", "JAXRL_TEST_UNSET_VAR"], "JAXRL_TEST_UNSET_VAR is not set or empty"),
    (["{model}", "--dtype", "int8"], "--dtype: 'int8' is not float32 or bfloat16"),
    (["{model}", "--mesh", "tensor=3"], "--mesh: mesh {'data': 1, 'fsdp': 1, 'tensor': 3"),
    (["{model}", "--decode-steps-per-dispatch", "0"], "Invalid value for '--decode-steps-per-dispatch'"),
])
def test_errors_are_one_clear_line(tiny_model_dir, tmp_path, args, message):
    args = [a.format(tmp=tmp_path, model=tiny_model_dir) for a in args]
    env = {"JAXRL_TEST_UNSET_VAR": "", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf")}
    result = CliRunner().invoke(app, ["serve", *args], env=env)
    assert result.exit_code == 2, result.output
    assert message.replace("{tmp}", str(tmp_path)) in result.stderr and "Traceback" not in result.output
