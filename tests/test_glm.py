"""GLM-4.5 MoE (`glm4_moe`, INTELLECT-3's architecture): parity with transformers' `Glm4MoeForCausalLM` on
tiny random checkpoints, one per option set, on one device and on an expert-parallel mesh; the load /
save round trip; the KV-cache decode against the full forward.

Two option sets cover every option (one compile per mesh):
  * "air": GLM-4.5-Air's options, 3 layers: q/k/v biases, no qk-norm, a dense first layer, a shared expert,
    norm_topk_prob on, routed scaling 2.5, partial RoPE (half of each head); its stack runs as two scans
    (`decoder.scan_runs`: the dense layer, then the two MoE layers), reading `layers` and the cache by index;
  * "grouped": 2 layers, no biases, qk-norm, both MoE (one scan), a shared expert, norm_topk_prob off,
    routed scaling 1.0, grouped top-k (8 experts in 4 groups, 2 chosen), RoPE on a quarter of each head.
The torch models get random weights of std 0.1, norms near 1 and a score-correction bias of std 0.3 (HF's
zeros would hide a bias that chooses nothing), as tests/test_hf.py does for Qwen3.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kv.dense import Dense
from jaxrl.model import decode, decoder, hf, modules
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import make_mesh, spec_shardings
from jaxrl.parallel.spec import is_spec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 256
TOKENS_BT = np.random.default_rng(0).integers(0, VOCAB, size=(4, 10)).astype(np.int32)
_forward = jax.jit(decoder.forward, static_argnums=0, static_argnames="mesh")

OPTIONS = {
    "air": dict(num_hidden_layers=3, attention_bias=True, use_qk_norm=False, first_k_dense_replace=1,
                n_routed_experts=4, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=1, topk_group=1,
                partial_rotary_factor=0.5),
    "grouped": dict(num_hidden_layers=2, attention_bias=False, use_qk_norm=True, first_k_dense_replace=0,
                    n_routed_experts=8, norm_topk_prob=False, routed_scaling_factor=1.0, n_group=4, topk_group=2,
                    partial_rotary_factor=0.25),
}


def hf_glm(options: dict, seed: int = 0):
    """A random transformers `Glm4MoeForCausalLM` with `options` (hidden 32, 4 heads of 16)."""
    torch.manual_seed(seed)
    opts = dict(options)
    rope = {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": opts.pop("partial_rotary_factor")}
    cfg = transformers.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=16, num_experts_per_tok=3, n_shared_experts=1,
        max_position_embeddings=256, rope_parameters=rope, tie_word_embeddings=False, **opts)
    m = transformers.Glm4MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1 if "gate.weight" not in name else 0.5)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return m


def torch_logits(m, tokens_BT: np.ndarray = TOKENS_BT) -> np.ndarray:
    with torch.no_grad():
        return m(torch.from_numpy(tokens_BT.astype(np.int64))).logits.float().numpy()


def _jax_logits(cfg, params, mesh=None, tokens_BT: np.ndarray = TOKENS_BT) -> np.ndarray:
    positions_BT = np.broadcast_to(np.arange(tokens_BT.shape[1], dtype=np.int32), tokens_BT.shape)
    hidden_BTD, _ = _forward(cfg, params, jnp.asarray(tokens_BT), jnp.asarray(positions_BT), mesh=mesh)
    return np.asarray(decoder.logits(params, hidden_BTD))


@pytest.fixture(scope="module", params=list(OPTIONS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, np.ndarray]:
    """(option set, a transformers-written checkpoint folder, its torch logits for TOKENS_BT)."""
    m = hf_glm(OPTIONS[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    m.save_pretrained(folder)
    return request.param, folder, torch_logits(m)


@pytest.mark.numerics
def test_logits_match_transformers_on_one_device_and_expert_parallel(checkpoint):
    name, folder, want = checkpoint
    cfg, params = hf.load_hf(folder)
    o = OPTIONS[name]
    assert (cfg.family, cfg.attention_bias, cfg.use_qk_norm, cfg.n_group, cfg.n_shared_experts) == (
        "glm4_moe", o["attention_bias"], o["use_qk_norm"], o["n_group"], 1)
    assert cfg.rotary_dim == int(16 * o["partial_rotary_factor"]) and cfg.mlp_layers == tuple(
        range(o["first_k_dense_replace"]))
    shapes = jax.tree.map(lambda s: s.shape(cfg.dims()), modules.param_specs(cfg), is_leaf=is_spec)
    assert jax.tree.map(lambda x: x.shape, params) == shapes
    assert ("bq" in params["layers"]) == o["attention_bias"] and ("q_norm" in params["layers"]) == o["use_qk_norm"]
    assert float(np.max(np.abs(_jax_logits(cfg, params) - want))) <= ATOL

    mesh = make_mesh({"data": 2, "expert": 4})  # each device holds E / 4 experts
    sharded = jax.device_put(params, spec_shardings(modules.param_specs(cfg), cfg.dims(), mesh))
    assert float(np.max(np.abs(_jax_logits(cfg, sharded, mesh) - want))) <= ATOL


@pytest.mark.numerics
def test_round_trip_through_save_hf(checkpoint, tmp_path):
    name, folder, want = checkpoint
    cfg, params = hf.load_hf(folder)
    hf.save_hf(tmp_path, cfg, params)
    m, info = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert float(np.max(np.abs(torch_logits(m.eval()) - want))) <= ATOL
    cfg2, params2 = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, params2))


@pytest.mark.numerics
def test_kv_cache_decode_matches_full_forward(checkpoint):
    """Prefill then one token at a time through the cache (biases and partial RoPE on every step), by
    `decoder.forward` and by the engine's `decode.decode_step`; on the "air" options only (the other set's
    attention differs by qk-norm alone, which Qwen3's tests cover)."""
    if checkpoint[0] != "air":
        pytest.skip("one option set suffices")
    cfg, params = hf.load_hf(checkpoint[1])
    b, t = TOKENS_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    tokens_BT = jnp.asarray(TOKENS_BT)
    full_BTD, _ = _forward(cfg, params, tokens_BT, positions_BT)
    shape = (cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
    cache = {"k": jnp.zeros(shape), "v": jnp.zeros(shape)}
    first_BTD, cache = _forward(cfg, params, tokens_BT[:, :6], positions_BT[:, :6], cache=cache)
    steps, fast, fast_cache = [first_BTD], [first_BTD], cache
    step = jax.jit(functools.partial(decode.decode_step, cfg, layout=Dense(cfg, b, t)))
    for s in range(6, t):
        step_BTD, cache = _forward(cfg, params, tokens_BT[:, s:s + 1], positions_BT[:, s:s + 1], cache=cache)
        steps.append(step_BTD)
        fast_BTD, fast_cache = step(params, tokens_BT[:, s], positions_BT[:, s], fast_cache)
        fast.append(fast_BTD)
    for got in (steps, fast):
        assert float(jnp.max(jnp.abs(jnp.concatenate(got, axis=1) - full_BTD))) <= ATOL


def test_config_reads_glm_fields_and_skips_mtp_layers(tmp_path: Path):
    """Glm4MoeConfig's defaults for keys a config.json leaves out; the MTP layer a GLM-4.5 checkpoint
    carries past num_hidden_layers is skipped; an unsupported option is refused by name."""
    m = hf_glm(OPTIONS["air"])
    m.save_pretrained(tmp_path)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("use_qk_norm", "n_group", "topk_group", "routed_scaling_factor", "rope_parameters"):
        hf_cfg.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    cfg = hf.load_config(tmp_path)
    assert (cfg.use_qk_norm, cfg.n_group, cfg.routed_scaling_factor, cfg.partial_rotary_factor) == (False, 1, 1.0, 0.5)
    assert cfg.rms_norm_eps == 1e-5 and cfg.first_k_dense_replace == 1 and cfg.moe_layers == (1, 2)

    import safetensors.numpy
    tensors = safetensors.numpy.load_file(tmp_path / hf.WEIGHTS_FILE)
    mtp = hf_cfg["num_hidden_layers"]  # GLM-4.5's MTP layer comes after the decoder's layers
    tensors[f"model.layers.{mtp}.eh_proj.weight"] = np.zeros((32, 64), np.float32)  # an MTP layer's tensor
    safetensors.numpy.save_file(tensors, tmp_path / hf.WEIGHTS_FILE)
    hf.load_hf(tmp_path)
    with pytest.raises(ValueError, match="n_shared_experts = 2"):
        ModelConfig.from_hf({**hf_cfg, "n_shared_experts": 2})


@pytest.fixture(scope="module")
def glm_tiny() -> Path:
    """The offline tiny GLM (`assets/glm-tiny`: scripts/make_assets.py), built once."""
    from helpers import REPO

    from jaxrl.model import assets
    return assets.ensure_tiny_assets(REPO / "assets", glm=True).resolve()


CONVERSATIONS = [
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello", "reasoning_content": "hmm",
      "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": "a"}}}]},
     {"role": "tool", "content": "42"}, {"role": "tool", "content": "43"},
     {"role": "assistant", "content": "<think>r</think>done"}, {"role": "user", "content": "ok?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add"}],
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_matches_the_glm45_renderer(glm_tiny, thinking):
    """The shipped GLM-4.5 chat template gives, token for token, what the renderers package's GLM-4.5 renderer
    (the one rollouts use, `jaxrl.envs.loader.renderer_config`) gives: tools, tool calls and responses,
    reasoning dropped before the last user turn and kept after it, `/nothink` and the empty think block."""
    from renderers.configs import GLM45RendererConfig
    from renderers.glm45 import GLM45Renderer

    from jaxrl.envs.loader import renderer_config

    assert renderer_config(glm_tiny, thinking) == GLM45RendererConfig(enable_thinking=thinking)
    tok = transformers.AutoTokenizer.from_pretrained(glm_tiny)
    renderer = GLM45Renderer(tok, GLM45RendererConfig(enable_thinking=thinking))
    for messages, prompt in ((CONVERSATIONS[0], True), (CONVERSATIONS[1], False)):
        want = renderer.render(messages, tools=TOOLS if prompt else None, add_generation_prompt=prompt).token_ids
        got = tok.apply_chat_template(messages, tools=TOOLS if prompt else None, add_generation_prompt=prompt,
                                      enable_thinking=thinking, tokenize=True, return_dict=True)["input_ids"]
        assert got == list(want), tok.decode(got)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"]) == json.loads(
        (glm_tiny / "generation_config.json").read_text())["eos_token_id"] == renderer.get_stop_token_ids()


def test_shipped_glm_config_runs_two_synchronous_steps(tmp_path, glm_tiny):
    """`configs/quickstart_glm.toml` (tiny GLM, LoRA on attention and experts, 2-way expert parallelism),
    shrunk to 2 synchronous steps of 8 rollouts through the real CLI: the engine's logprobs of the sampled
    tokens agree with the trainer's at fp32 (`policy/kl` < 1e-5), after the in-flight weight update too."""
    from helpers import REPO, jaxrl, read_metrics, shrink

    cfg = tmp_path / "glm.toml"
    cfg.write_text(shrink((REPO / "configs" / "quickstart_glm.toml").read_text(), [
        ("max_steps = 15", "max_steps = 2\nmax_async_level = 0\noversampling_factor = 1"),
        ("batch_size = 32", "batch_size = 8"), ("rollouts_per_example = 8", "rollouts_per_example = 4"),
        ("max_tokens = 24", "max_tokens = 8"), ("seq_len = 256", "seq_len = 128"),
        ("decode_slots = 32", "decode_slots = 8"),
        ('model_path = "../assets/glm-tiny"', f'model_path = "{glm_tiny}"\noutput_dir = "{tmp_path / "runs"}"'),
    ]))
    out = jaxrl("run", str(cfg), devices=2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "'expert': 2" in out.stdout
    rows = read_metrics(tmp_path / "runs" / "quickstart-glm")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollouts/failed"] == 0 and r["optim/grad_norm"] > 0 and abs(r["policy/kl"]) < 1e-5, r
