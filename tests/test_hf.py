"""HF checkpoint I/O: parity with transformers' Qwen3ForCausalLM, round trips, bf16, errors.

torch and transformers are the reference here only. The torch models get random weights of std 0.1
and norm weights near 1 (not HF's 0.02 and exact ones), so that a swapped norm or a wrong transpose
moves the logits (about 1 in size) far beyond the 1e-4 tolerance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jaxrl.model import blocks, decoder, hf, modules
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.spec import is_spec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 512
TOKENS_BT = np.random.default_rng(0).integers(0, VOCAB, size=(2, 12)).astype(np.int32)
_forward = jax.jit(decoder.forward, static_argnums=0)  # eager calls would re-trace the layer scan each time


def _hf_model(*, tie: bool, heads: int, kv_heads: int, layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
    )
    m = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return m


def _torch_logits(m, tokens_BT: np.ndarray = TOKENS_BT) -> np.ndarray:
    with torch.no_grad():
        return m(torch.from_numpy(tokens_BT.astype(np.int64))).logits.float().numpy()


def _jax_logits(cfg: ModelConfig, params: blocks.Params, tokens_BT: np.ndarray = TOKENS_BT
                ) -> np.ndarray:
    positions_BT = np.broadcast_to(np.arange(tokens_BT.shape[1], dtype=np.int32), tokens_BT.shape)
    hidden_BTD, _ = _forward(cfg, params, jnp.asarray(tokens_BT), jnp.asarray(positions_BT))
    return np.asarray(decoder.logits(params, hidden_BTD))


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


# name: (tied, q heads, kv heads, layers, max_shard_size)
CHECKPOINTS = {
    "tied-gqa1": (True, 4, 4, 2, None),
    "untied-gqa2": (False, 4, 2, 3, None),
    "tied-gqa4": (True, 8, 2, 2, None),  # N*H = 128 != D = 64: o_proj is not square
    "untied-gqa2-sharded": (False, 4, 2, 2, "200KB"),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> tuple[Path, np.ndarray]:
    """A transformers-written checkpoint folder and its torch logits for TOKENS_BT."""
    tie, heads, kv_heads, layers, shard = CHECKPOINTS[request.param]
    m = _hf_model(tie=tie, heads=heads, kv_heads=kv_heads, layers=layers)
    folder = tmp_path_factory.mktemp(request.param)
    kwargs = {"max_shard_size": shard} if shard else {}
    m.save_pretrained(folder, **kwargs)
    return folder, _torch_logits(m)


@pytest.mark.numerics
def test_load_matches_transformers(checkpoint):
    folder, want = checkpoint
    cfg, params = hf.load_hf(folder)
    assert cfg.rope_theta == 5000.0 and cfg.rms_norm_eps == 1e-5
    assert ("unembed" in params) == (not cfg.tie_word_embeddings)
    want_shapes = jax.tree.map(lambda s: s.shape(cfg.dims()), modules.param_specs(cfg), is_leaf=is_spec)
    assert jax.tree.map(lambda x: x.shape, params) == want_shapes
    assert _max_diff(_jax_logits(cfg, params), want) <= ATOL
    if (folder / hf.INDEX_FILE).exists():  # the sharded checkpoint really is split
        assert not (folder / hf.WEIGHTS_FILE).exists() and len(list(folder.glob("model-*.safetensors"))) > 2


@pytest.mark.numerics
@pytest.mark.parametrize("max_shard_bytes", [None, 150_000])
def test_round_trip_through_save_hf(checkpoint, tmp_path, max_shard_bytes):
    folder, want = checkpoint
    cfg, params = hf.load_hf(folder)
    files = hf.save_hf(tmp_path, cfg, params, max_shard_bytes=max_shard_bytes)
    assert (len(files) > 1) == (max_shard_bytes is not None)
    assert all(f.stat().st_size <= 150_000 + 2048 for f in files if max_shard_bytes)  # 2 KB: the header

    m, info = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert _max_diff(_torch_logits(m.eval()), want) <= ATOL

    cfg2, params2 = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, params2))


@pytest.mark.numerics
def test_kv_cache_decode_matches_full_forward(checkpoint):
    cfg, params = hf.load_hf(checkpoint[0])
    b, t = TOKENS_BT.shape
    prefix = 5
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    full_BTD, _ = _forward(cfg, params, jnp.asarray(TOKENS_BT), positions_BT)

    shape = (cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
    cache = {"k": jnp.zeros(shape), "v": jnp.zeros(shape)}
    tokens_BT = jnp.asarray(TOKENS_BT)
    first_BTD, cache = _forward(cfg, params, tokens_BT[:, :prefix], positions_BT[:, :prefix], cache=cache)
    steps = [first_BTD]
    for s in range(prefix, t):
        step_BTD, cache = _forward(cfg, params, tokens_BT[:, s:s + 1], positions_BT[:, s:s + 1], cache=cache)
        steps.append(step_BTD)
    assert _max_diff(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full_BTD)) <= ATOL


@pytest.mark.numerics
def test_packed_segments_match_separate_forwards(tmp_path):
    """Two samples packed into one row (positions from 0 each, segment ids 1 and 2) give each sample the
    logits transformers gives it alone; without the segment ids the second sample sees the first."""
    m = _hf_model(tie=False, heads=4, kv_heads=2)
    m.save_pretrained(tmp_path)
    cfg, params = hf.load_hf(tmp_path)
    a, b = TOKENS_BT[0, :5], TOKENS_BT[1, :7]
    want = np.concatenate([_torch_logits(m, a[None])[0], _torch_logits(m, b[None])[0]])
    tokens_1T = jnp.asarray(np.concatenate([a, b])[None])
    positions_1T = jnp.asarray(np.concatenate([np.arange(5), np.arange(7)])[None].astype(np.int32))
    segments_1T = jnp.asarray(np.array([[1] * 5 + [2] * 7], np.int32))
    packed_BTD, _ = _forward(cfg, params, tokens_1T, positions_1T, segment_ids=segments_1T)
    assert _max_diff(np.asarray(decoder.logits(params, packed_BTD))[0], want) <= ATOL
    crossed_BTD, _ = _forward(cfg, params, tokens_1T, positions_1T)
    assert _max_diff(np.asarray(decoder.logits(params, crossed_BTD))[0, 5:], want[5:]) > 1e-2


@pytest.mark.numerics
def test_load_with_shardings(tmp_path):
    """Each weight lands with the sharding asked for, and the sharded model gives the same logits."""
    from jaxrl.parallel.sharding import make_mesh, spec_shardings

    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py emulates 8 CPU devices)")
    m = _hf_model(tie=False, heads=4, kv_heads=2)
    m.save_pretrained(tmp_path)
    cfg = hf.load_config(tmp_path)
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])
    shardings = spec_shardings(modules.param_specs(cfg), cfg.dims(), mesh)
    _, params = hf.load_hf(tmp_path, shardings=shardings)
    assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, params, shardings))
    assert params["layers"]["wq"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert _max_diff(_jax_logits(cfg, params), _torch_logits(m)) <= ATOL


@pytest.mark.numerics
def test_bf16_checkpoint(tmp_path):
    """A bf16 checkpoint loads exactly (bf16 -> fp32 is exact) and, run in bf16, stays near fp32.

    Tolerance: bf16 keeps 8 significant bits (relative error 2^-9 per rounding); over 2 layers of bf16
    matmuls the logits (up to about 3.5 here) drift by a few hundredths (0.063 measured), so the bound
    is 0.1 absolute, and the argmax token must agree at 90% of the positions (23 of 24 measured).
    """
    m = _hf_model(tie=False, heads=4, kv_heads=2)
    want = _torch_logits(m)
    m.to(torch.bfloat16).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"

    cfg, exact = hf.load_hf(tmp_path, dtype=jnp.float32)
    q_proj = m.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(exact["layers"]["wq"][1]), q_proj.T.reshape(64, 4, 16))
    # the bf16 weights in fp32 (not m.float(): casting m to bf16 also rounded its RoPE frequencies)
    upcast = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert _max_diff(_jax_logits(cfg, exact), _torch_logits(upcast)) <= ATOL

    cfg, params = hf.load_hf(tmp_path, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    got = _jax_logits(cfg, params)
    assert _max_diff(got, want) <= 0.1
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9


def test_save_hf_keeps_bf16(tmp_path):
    cfg = _tiny_cfg()
    params = _random_params(cfg, jnp.bfloat16)
    hf.save_hf(tmp_path, cfg, params)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    m = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path)
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16
    _, back = hf.load_hf(tmp_path, dtype=jnp.bfloat16)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, back))


# Errors: checkpoints written by save_hf from a small random config, then damaged.


def _tiny_cfg(tie: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=8, tie_word_embeddings=tie)


def _random_params(cfg: ModelConfig, dtype=np.float32) -> blocks.Params:
    """numpy weights of `param_specs(cfg)` (modules.init_params would spend seconds compiling its RNG)."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.normal(0.0, 0.02, s.shape(cfg.dims())).astype(dtype),
                        modules.param_specs(cfg), is_leaf=is_spec)


@pytest.fixture
def tiny_checkpoint(tmp_path) -> Path:
    cfg = _tiny_cfg()
    hf.save_hf(tmp_path, cfg, _random_params(cfg))
    return tmp_path


def _edit_weights(folder: Path, edit) -> None:
    path = folder / hf.WEIGHTS_FILE
    with safetensors.safe_open(path, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a Mapping)
    edit(tensors)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def test_error_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        hf.load_hf(tmp_path / "no-such-model")


def test_error_missing_config(tiny_checkpoint):
    (tiny_checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        hf.load_hf(tiny_checkpoint)


def test_error_not_qwen3(tiny_checkpoint):
    hf_cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    (tiny_checkpoint / "config.json").write_text(json.dumps({**hf_cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json.*'llama'"):
        hf.load_hf(tiny_checkpoint)


def test_error_missing_weights(tiny_checkpoint):
    (tiny_checkpoint / hf.WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor model\.safetensors\.index"):
        hf.load_hf(tiny_checkpoint)


def test_error_missing_shard(tmp_path):
    cfg = _tiny_cfg()
    files = hf.save_hf(tmp_path, cfg, _random_params(cfg), max_shard_bytes=4096)
    files[-1].unlink()
    with pytest.raises(FileNotFoundError, match=files[-1].name):
        hf.load_hf(tmp_path)


def test_error_missing_tensor(tiny_checkpoint):
    _edit_weights(tiny_checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        hf.load_hf(tiny_checkpoint)


def test_error_missing_lm_head_when_untied(tiny_checkpoint):
    _edit_weights(tiny_checkpoint, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"'lm_head\.weight' is missing"):
        hf.load_hf(tiny_checkpoint)


def test_error_wrong_shape(tiny_checkpoint):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 16), np.float32)

    _edit_weights(tiny_checkpoint, edit)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape "
                                         r"\(16, 16\), expected \(8, 16\)"):
        hf.load_hf(tiny_checkpoint)


def test_error_unexpected_tensor(tiny_checkpoint):
    def edit(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(16, np.float32)

    _edit_weights(tiny_checkpoint, edit)
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        hf.load_hf(tiny_checkpoint)


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    cfg = _tiny_cfg(tie=True)
    params = _random_params(cfg)
    hf.save_hf(tmp_path, cfg, params)

    def edit(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"]
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)

    _edit_weights(tmp_path, edit)
    _, back = hf.load_hf(tmp_path)
    assert "unembed" not in back


def test_save_hf_rejects_wrong_params(tmp_path):
    cfg = _tiny_cfg()
    params = _random_params(cfg)
    with pytest.raises(ValueError, match="layers/wq has shape"):
        hf.save_hf(tmp_path, cfg, {**params, "layers": {**params["layers"], "wq": params["layers"]["wk"]}})
    with pytest.raises(ValueError, match="lack the weight unembed"):
        hf.save_hf(tmp_path, cfg, {k: v for k, v in params.items() if k != "unembed"})


def test_save_hf_replaces_stale_shards(tmp_path):
    cfg = _tiny_cfg()
    params = _random_params(cfg)
    hf.save_hf(tmp_path, cfg, params, max_shard_bytes=4096)
    hf.save_hf(tmp_path, cfg, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_sharded_files_respect_the_limit(tmp_path):
    cfg = _tiny_cfg()
    files = hf.save_hf(tmp_path, cfg, _random_params(cfg), max_shard_bytes=4096)
    index = json.loads((tmp_path / hf.INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    biggest = max(math.prod(s.shape(cfg.dims())[1:]) for s in modules.param_specs(cfg)["layers"].values()) * 4
    assert biggest <= 4096 and all(f.stat().st_size <= 4096 + 2048 for f in files)  # header included
