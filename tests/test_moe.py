"""Qwen3-MoE: parity with transformers' Qwen3MoeForCausalLM (logits and every layer), HF round trips,
the dense and grouped dispatch paths, and expert parallelism on emulated CPU meshes.

Router weights get std 1 (not 0.1) so that top-k choices are decisive: a near tie between two experts
could flip on a 1e-7 difference and make a correct model look wrong.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.model import blocks, decoder, hf, modules, moe, moe_all_to_all
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import make_mesh, spec_shardings
from jaxrl.parallel.spec import is_spec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.numerics
ATOL = 1e-4
VOCAB = 256
TOKENS_BT = np.random.default_rng(1).integers(0, VOCAB, size=(2, 10)).astype(np.int32)
_stack = jax.jit(decoder.decoder_stack, static_argnums=0, static_argnames=("scan_layers",))

# name: (layers, experts, top_k, norm_topk_prob, decoder_sparse_step, mlp_only_layers, tied, max_shard_size)
CHECKPOINTS = {
    "all-moe-norm-topk": (2, 4, 2, True, 1, [], False, None),
    "mixed-mlp-only": (3, 4, 2, False, 1, [1], True, None),
    "sparse-step-2": (4, 8, 3, True, 2, [], False, None),
    "all-moe-sharded": (2, 4, 1, False, 1, [], False, "60KB"),
}


def _hf_moe(layers, experts, top_k, norm, step, mlp_only, tie, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=norm, decoder_sparse_step=step, mlp_only_layers=mlp_only, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=128,
    )
    m = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
    return m


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """A transformers-written MoE checkpoint, its torch logits and hidden states for TOKENS_BT."""
    *arch, shard = CHECKPOINTS[request.param]
    m = _hf_moe(*arch)
    folder = tmp_path_factory.mktemp(request.param)
    m.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    with torch.no_grad():
        out = m(torch.from_numpy(TOKENS_BT.astype(np.int64)), output_hidden_states=True)
    return folder, out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def _positions(tokens_BT):
    return jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_logits_and_every_layer_match_transformers(checkpoint, scan_layers):
    folder, want_logits, want_hidden = checkpoint
    cfg, params = hf.load_hf(folder)
    assert cfg.is_moe and cfg.moe_layers
    tokens = jnp.asarray(TOKENS_BT)
    x_BTD, _, layers_LBTD = _stack(cfg, params, tokens, _positions(tokens), scan_layers=scan_layers)
    # transformers' hidden_states: the embeddings, each layer's output, the last one after the final norm
    for i in range(cfg.num_layers - 1):
        np.testing.assert_allclose(np.asarray(layers_LBTD[i]), want_hidden[i + 1], atol=ATOL, rtol=0)
    hidden_BTD = blocks.rms_norm(x_BTD, params["final_norm"], cfg.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(hidden_BTD), want_hidden[-1], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(decoder.logits(params, hidden_BTD)), want_logits, atol=ATOL, rtol=0)


def test_round_trip_through_save_hf(checkpoint, tmp_path):
    folder, want_logits, _ = checkpoint
    cfg, params = hf.load_hf(folder)
    hf.save_hf(tmp_path, cfg, params, max_shard_bytes=50_000)
    m, info = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        got = m.eval()(torch.from_numpy(TOKENS_BT.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(got, want_logits, atol=ATOL, rtol=0)
    cfg2, params2 = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, params2))


def _random_experts(e=8, d=16, i=12, r=4, seed=0):
    ks = jax.random.split(jax.random.key(seed), 8)
    we = {"w_gate": 0.2 * jax.random.normal(ks[0], (e, d, i)), "w_up": 0.2 * jax.random.normal(ks[1], (e, d, i)),
          "w_down": 0.2 * jax.random.normal(ks[2], (e, i, d))}
    # LoRA `a` rank-major [E, R, in] (modules.LoRA)
    lwe = {"w_gate": {"a": 0.2 * jax.random.normal(ks[3], (e, r, d)), "b": 0.2 * jax.random.normal(ks[4], (e, r, i))},
           "w_down": {"a": 0.2 * jax.random.normal(ks[5], (e, r, i)), "b": 0.2 * jax.random.normal(ks[6], (e, r, d))}}
    return we, lwe, jax.random.normal(ks[7], (d, e))


def test_dense_and_grouped_dispatch_agree_with_lora_and_gradients():
    we, lwe, router = _random_experts()
    h_MD = jax.random.normal(jax.random.key(3), (24, 16))

    def out(dispatch, lwe):
        return moe.moe_block(h_MD[None], router, we, lwe, top_k=3, norm_topk_prob=True, lora_scale=0.5,
                             dispatch=dispatch)[0]

    np.testing.assert_allclose(out("dense", lwe), out("grouped", lwe), atol=1e-5, rtol=0)
    # a reference written out token by token
    idx, w = moe.route(h_MD, router, 3, True)
    ref = []
    for m in range(h_MD.shape[0]):
        acc = 0.0
        for k in range(3):
            e = int(idx[m, k])
            g = h_MD[m] @ we["w_gate"][e] + 0.5 * (h_MD[m] @ lwe["w_gate"]["a"][e].T) @ lwe["w_gate"]["b"][e]
            a = jax.nn.silu(g) * (h_MD[m] @ we["w_up"][e])
            acc = acc + w[m, k] * (a @ we["w_down"][e] + 0.5 * (a @ lwe["w_down"]["a"][e].T) @ lwe["w_down"]["b"][e])
        ref.append(acc)
    np.testing.assert_allclose(out("grouped", lwe), jnp.stack(ref), atol=1e-5, rtol=0)
    g_dense, g_grouped = (jax.grad(lambda lw, d=d: jnp.sum(out(d, lw) ** 2))(lwe) for d in ("dense", "grouped"))
    for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_grouped), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_chunk_count():
    """The fewest power-of-two chunks that divide the tokens and leave at most the asked assignments each."""
    assert moe.chunk_count(24, 3, 72) == 1 and moe.chunk_count(24, 3, 71) == 2
    assert moe.chunk_count(24, 3, 8) == 8  # 9 assignments a chunk: 16 chunks would not divide 24 tokens
    assert moe.chunk_count(8 * 4096, 8, moe.ASSIGNMENTS_PER_CHUNK) == 16  # Qwen3-235B-A22B's expert group


@pytest.mark.numerics
@pytest.mark.parametrize("mesh_shape", [None, {"data": 2, "expert": 4}], ids=["one-device", "expert-parallel"])
def test_chunked_dispatch_gives_the_same_outputs_and_gradients(mesh_shape):
    """The grouped dispatch in 8 chunks of tokens (`experts_chunked`) against one chunk: the same outputs and
    LoRA and input gradients, on one device and expert parallel (the expert group's gathered tokens chunked)."""
    we, lwe, router = _random_experts()
    h_BTD = jax.random.normal(jax.random.key(3), (4, 6, 16))
    mesh = make_mesh(mesh_shape) if mesh_shape else None

    def loss(h, lwe, per_chunk):
        out = moe.moe_block(h, router, we, lwe, top_k=3, norm_topk_prob=True, lora_scale=0.5, mesh=mesh,
                            dispatch="grouped", assignments_per_chunk=per_chunk)
        return jnp.sum(out ** 2), out

    # one device: all 24 tokens; expert parallel: an expert group gathers its 4 devices' 3 tokens each
    tokens = 24 if mesh_shape is None else 24 // 8 * 4
    assert moe.chunk_count(tokens, 3, 9) == (8 if mesh_shape is None else 4)
    results = [jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)(h_BTD, lwe, n)
               for n in (10**6, 9)]
    (_, one), grads_one = results[0]
    (_, chunked), grads_chunked = results[1]
    np.testing.assert_allclose(chunked, one, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(grads_chunked), jax.tree.leaves(grads_one), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _tiny_cfg(moe_model: bool) -> ModelConfig:
    extra = {} if not moe_model else dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                          norm_topk_prob=True)
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, tie_word_embeddings=False, **extra)


def _loss_and_grads(cfg, params, lora, tokens_BT, mesh):
    def loss(lora):
        hidden, _ = decoder.forward(cfg, params, tokens_BT, _positions(tokens_BT), lora=lora, lora_scale=2.0, mesh=mesh)
        logits = decoder.logits(params, hidden)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1)), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(lora)
    return float(value), np.asarray(logits), jax.tree.map(np.asarray, grads)


MESHES = [{"fsdp": 8}, {"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 2, "tensor": 2},
          {"fsdp": 2, "tensor": 2, "expert": 2}, {"data": 2, "expert": 4}]


@pytest.mark.parametrize("moe_model", [False, True], ids=["dense", "moe"])
def test_same_logits_and_gradients_on_every_mesh(moe_model):
    """LoRA on every projection (experts included); expert parallelism where the mesh has an expert axis, by
    either dispatcher (the model's own choice: all-gather on expert 2, all-to-all on expert 4)."""
    cfg = _tiny_cfg(moe_model)
    chosen = {moe.choose_dispatch(make_mesh(s), 2, tokens_split=True) for s in MESHES if "expert" in s}
    assert chosen == set(moe.Dispatch)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    params = modules.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 5 if x.ndim == 3 and x.shape[-1] == cfg.num_experts else x, params)
    lora = modules.init_lora(cfg, 4, targets, jax.random.key(1))
    lora = jax.tree.map(lambda x: x + 0.05, lora)  # b = 0 would hide a wrong LoRA path
    tokens = jax.random.randint(jax.random.key(2), (8, 12), 0, cfg.vocab_size)
    want = _loss_and_grads(cfg, params, lora, tokens, None)
    for shape in MESHES:
        if "expert" in shape and not moe_model:
            continue
        mesh = make_mesh(shape)
        p = jax.device_put(params, spec_shardings(modules.param_specs(cfg), cfg.dims(), mesh))
        lr = jax.device_put(lora, spec_shardings(modules.lora_specs(cfg, 4, targets), {**cfg.dims(), "R": 4}, mesh))
        got = _loss_and_grads(cfg, p, lr, tokens, mesh)
        assert abs(got[0] - want[0]) <= 1e-5, shape
        np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=0, err_msg=str(shape))
        for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=str(shape))


def test_expert_parallel_needs_divisible_experts():
    cfg = _tiny_cfg(True)
    params = modules.init_params(cfg, jax.random.key(0))
    tokens = jnp.zeros((8, 4), jnp.int32)
    with pytest.raises(ValueError, match="4 experts cannot be split over an expert mesh axis of size 8"):
        decoder.forward(cfg, params, tokens, _positions(tokens), mesh=make_mesh({"expert": 8}))


def test_lora_specs_cover_experts_and_dense_layers():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, mlp_only_layers=(1,))
    specs = modules.lora_specs(cfg, 4, ("q_proj", "down_proj"))
    dims = {**cfg.dims(), "R": 4}
    shapes = jax.tree.map(lambda s: s.shape(dims), specs, is_leaf=is_spec)
    assert shapes == {
        "layers": {"wq": {"a": (3, 4, 32), "b": (3, 4, 4, 8)}},  # `a` rank-major [stack..., R, in...]
        "mlp": {"w_down": {"a": (1, 4, 48), "b": (1, 4, 32)}},
        "moe": {"w_down": {"a": (2, 4, 4, 16), "b": (2, 4, 4, 32)}},
    }
    assert cfg.mlp_layers == (1,) and cfg.moe_layers == (0, 2)


def test_from_hf_reads_moe_fields(tmp_path: Path):
    m = _hf_moe(2, 4, 2, True, 1, [], False)
    m.save_pretrained(tmp_path)
    cfg = hf.load_config(tmp_path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (4, 2, 24, True)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_emulated_ragged_all_to_all_gives_the_documented_example():
    """`moe_all_to_all.ragged_all_to_all` on a CPU mesh (XLA:CPU has no ragged all-to-all: a dense all-to-all of
    padded slices) against the worked example of `jax.lax.ragged_all_to_all`'s docstring (an axis of 2), with
    rows of two values; and its gradient: each sent row gets the cotangent of the row it landed on, an unsent
    row none."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("expert",))
    operand = jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32)[..., None] * jnp.array([[[1.0, 10.0]]])  # [device, 3, 2]
    offsets = {"input": [[0, 1], [0, 1]], "send": [[1, 2], [1, 1]], "output": [[0, 0], [1, 2]],
               "recv": [[1, 1], [2, 1]]}
    ints = [jnp.array(offsets[k], jnp.int32) for k in ("input", "send", "output", "recv")]
    cotangent = jnp.arange(16, dtype=jnp.float32).reshape(2, 4, 2)

    def one(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
        got = moe_all_to_all.ragged_all_to_all(operand[0], jnp.zeros((4, 2)), input_offsets[0], send_sizes[0],
                                               output_offsets[0], recv_sizes[0], axis_name="expert", emulate=True)
        return got[None]

    spec = jax.sharding.PartitionSpec("expert")
    exchange = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=spec, out_specs=spec))
    got = exchange(operand, *ints)
    want = jnp.array([[1, 3, 0, 0], [2, 2, 4, 0]], jnp.float32)[..., None] * jnp.array([[[1.0, 10.0]]])
    np.testing.assert_array_equal(got, want)
    grad = jax.grad(lambda x: jnp.sum(exchange(x, *ints) * cotangent))(operand)
    # device 0 sent its row 0 to device 0's row 0, rows 1-2 to device 1's rows 0-1; device 1 its row 0 to
    # device 0's row 1 and its row 1 to device 1's row 2; device 1's row 2 stayed home
    np.testing.assert_array_equal(grad, jnp.stack([cotangent[0, 0], cotangent[1, 0], cotangent[1, 1], cotangent[0, 1],
                                                   cotangent[1, 2], jnp.zeros(2)]).reshape(2, 3, 2))


@pytest.mark.parametrize("mesh_shape", [{"data": 2, "expert": 4}, {"fsdp": 2, "tensor": 2, "expert": 2},
                                        {"expert": 8}], ids=["data2-expert4", "fsdp2-tensor2-expert2", "expert8"])
def test_all_to_all_dispatch_gives_the_all_gather_outputs_and_gradients(mesh_shape):
    """The ragged all-to-all dispatcher against the all-gather one on the same expert mesh: outputs and the LoRA
    and input gradients, in one chunk and in several (each chunk its own exchange)."""
    we, lwe, router = _random_experts()
    h_BTD = jax.random.normal(jax.random.key(3), (8, 8, 16))
    mesh = make_mesh(mesh_shape)

    def loss(h, lwe, dispatch, per_chunk):
        out = moe.moe_block(h, router, we, lwe, top_k=3, norm_topk_prob=True, lora_scale=0.5, mesh=mesh,
                            assignments_per_chunk=per_chunk, expert_dispatch=dispatch)
        return jnp.sum(out ** 2), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=(2, 3))
    (_, want), want_grads = step(h_BTD, lwe, moe.Dispatch.ALL_GATHER, 10**6)
    ep, tokens = mesh_shape["expert"], 64 // (mesh.size // mesh.shape["tensor"])  # a device's tokens
    assert moe.chunk_count(tokens, ep * min(8 // ep, 3), 16) > 1
    for per_chunk in (10**6, 16):
        (_, got), grads = step(h_BTD, lwe, moe.Dispatch.ALL_TO_ALL, per_chunk)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_choose_dispatch():
    """The all-to-all where a token's X rows cost less than the all-gather's ep - 1 copies (X < ep), only for
    tokens split over the expert axis, and only where XLA compiles it (not on v5e slices over 16 chips)."""
    from jaxrl.compile import slices

    def mesh(slice_name, **shape):
        return make_mesh(shape, slices.topology_devices(slices.parse_slice(slice_name)))

    v5p_8, v5e_16, v5e_32 = mesh("v5p-8", expert=4), mesh("v5litepod-16", expert=16), mesh("v5litepod-32", expert=32)
    assert moe.choose_dispatch(v5p_8, 8, tokens_split=True) is moe.Dispatch.ALL_GATHER  # Qwen3-30B-A3B
    assert moe.choose_dispatch(v5p_8, 2, tokens_split=True) is moe.Dispatch.ALL_TO_ALL
    assert moe.choose_dispatch(v5e_16, 8, tokens_split=True) is moe.Dispatch.ALL_TO_ALL
    assert moe.choose_dispatch(v5e_16, 8, tokens_split=False) is moe.Dispatch.ALL_GATHER
    assert moe.choose_dispatch(v5e_32, 8, tokens_split=True) is moe.Dispatch.ALL_GATHER  # refused by XLA there
    assert moe.choose_dispatch(make_mesh({"data": 2, "expert": 4}), 2, tokens_split=True) is moe.Dispatch.ALL_TO_ALL
