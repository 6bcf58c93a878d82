"""Offline assets: the rebuilt Qwen3 tokenizer, its chat template, and the tiny random model folder."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.model import assets, decoder, hf, modules
from jaxrl.model.config import ModelConfig

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """`ensure_tiny_assets` into a fresh root (about 10 s: RNG compiles and the tokenizer)."""
    return assets.ensure_tiny_assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="session")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny)


def test_tokenizer_matches_qwen3(tok):
    assert tok("Hello world").input_ids == [9707, 1879]
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == [
        151644, 151645, 151667, 151668]
    specials = [t for t, _ in assets.SPECIAL_TOKENS]
    assert len(specials) == 26
    assert tok.convert_tokens_to_ids(specials) == list(range(151643, 151669))
    assert len(tok) == 151669 <= assets.VOCAB_ROWS
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (
        "<|im_end|>", 151645, "<|endoftext|>", 151643)
    assert tok.bos_token is None


def test_special_tokens_are_atomic_and_flagged_like_qwen3(tok):
    ids = tok.encode("<|im_start|>user\n<think>x</think><tool_call><|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645 and 151667 in ids and 151657 in ids
    # <|im_*|> are special (dropped); the think and tool markers stay in decoded text, as in Qwen3
    assert tok.decode(ids, skip_special_tokens=True) == "user\n<think>x</think><tool_call>"


def test_text_round_trips(tok):
    text = "naïve café — 東京 12345\n\n  def f(x):\treturn x ** 2  # 🙂"
    assert tok.decode(tok.encode(text)) == text


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]


def test_chat_template_two_messages(tok):
    prompt = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert no_prompt == prompt.removesuffix("<|im_start|>assistant\n")
    no_think = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
    assert no_think == prompt + "<think>\n\n</think>\n\n"
    ids = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == 151644 and ids[-3:] == tok.encode("<|im_start|>assistant\n")


def test_chat_template_reasoning_is_kept_only_after_the_last_query(tok):
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\na1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "new"},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\nnew\n</think>\n\na2<|im_end|>\n")


def test_chat_template_tools(tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\n1+2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_generation_config(tiny):
    gen = transformers.GenerationConfig.from_pretrained(tiny)
    assert gen.eos_token_id == [151645, 151643] and gen.pad_token_id == 151643


@pytest.mark.numerics
def test_tiny_model_loads_in_jaxrl_and_transformers(tiny):
    import torch

    cfg, params = hf.load_hf(tiny)
    assert cfg.vocab_size == 151936 and cfg.tie_word_embeddings and "unembed" not in params
    assert cfg == ModelConfig(vocab_size=151936, hidden_size=64, intermediate_size=192, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)

    tokens_BT = np.array([[9707, 1879, 151645, 0, 151668, 100]], np.int32)
    positions_BT = jnp.arange(tokens_BT.shape[1], dtype=jnp.int32)[None]
    hidden_BTD, _ = decoder.forward(cfg, params, jnp.asarray(tokens_BT), positions_BT)
    got = np.asarray(decoder.logits(params, hidden_BTD))

    m = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    assert type(m).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        want = m(torch.from_numpy(tokens_BT.astype(np.int64))).logits.numpy()
    assert got.shape == want.shape == (1, 6, 151936)
    assert float(np.max(np.abs(got - want))) <= 1e-4
    assert float(np.std(want)) > 0.05  # the weights are really random, not zeros


def test_tiny_model_is_reproducible(tiny, tmp_path):
    cfg = hf.load_config(tiny)
    params = modules.init_params(cfg, jax.random.key(0))
    _, loaded = hf.load_hf(tiny)
    np.testing.assert_array_equal(np.asarray(loaded["embed"]), np.asarray(params["embed"] * (0.25 / 0.02)))
    np.testing.assert_array_equal(np.asarray(loaded["layers"]["wq"]), np.asarray(params["layers"]["wq"]))


def test_tiny_model_files_follow_the_umask(tiny):
    """safetensors creates its file 0600 and mkdtemp its folder 0700; the asset folder and every file in it get
    what the umask gives, as `open` and `mkdir` would (the issue found model.safetensors 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tiny.iterdir()}
    assert hf.WEIGHTS_FILE in modes and set(modes.values()) == {0o666 & ~mask}, modes
    assert stat.S_IMODE(tiny.stat().st_mode) == 0o777 & ~mask


def test_ensure_is_idempotent_and_replaces_unfinished_builds(tmp_path, monkeypatch):
    builds = []

    def fake_build(out_dir):
        builds.append(out_dir)
        for name in (hf.CONFIG_FILE, hf.WEIGHTS_FILE, *assets.TOKENIZER_FILES):
            (Path(out_dir) / name).write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(assets, "build_tiny_model", fake_build)
    unfinished = tmp_path / assets.TINY_MODEL_DIR
    unfinished.mkdir()
    (unfinished / hf.CONFIG_FILE).write_text("{}")  # an interrupted build left only this
    assert assets.ensure_tiny_assets(tmp_path) == unfinished
    assert assets.is_complete(unfinished) and len(builds) == 1
    assert assets.ensure_tiny_assets(tmp_path) == unfinished and len(builds) == 1
    assert [p.name for p in tmp_path.iterdir()] == [assets.TINY_MODEL_DIR]  # no staging folder left


def test_assets_do_not_import_torch():
    code = ("import sys, jaxrl.model.assets, jaxrl.model.hf\n"
            "from transformers import PreTrainedTokenizerFast\n"
            "from transformers.convert_slow_tokenizer import TikTokenConverter\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


def test_make_assets_script(tiny, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_assets
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert make_assets.main(["--root", str(tiny.parent)]) == 0
    out = capsys.readouterr().out
    assert "already complete" in out and "model.safetensors" in out
    assert json.loads((tiny / "config.json").read_text())["vocab_size"] == 151936
