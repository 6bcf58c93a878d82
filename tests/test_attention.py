"""The attention implementations (`jaxrl.model.attention`) against the einsum reference, on CPU: splash in
Pallas interpret mode (forward and gradient, grouped-query heads of 128, packed segments, bf16 and fp32,
T = 256 in blocks of 128, on one device and inside `shard_map` on a 2 x 2 mesh), and the model's loss
and LoRA gradient with each implementation that runs on a CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.model import attention, blocks, decoder, kernels, modules
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import make_mesh

B, T, N, K, H = 2, 256, 4, 2, 128


def _qkv(dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (B, T, N, H), dtype), jax.random.normal(keys[1], (B, T, K, H), dtype),
            jax.random.normal(keys[2], (B, T, K, H), dtype))


def _packed(t=T):
    """Row 0: samples of 100 and t - 100 tokens; row 1: t - 56 tokens then 56 of padding (segment 0,
    position 0, as `jaxrl.rl.sft.pack` writes it). Returns (positions, segment ids), int32 [B, t]."""
    seg = np.zeros((B, t), np.int32)
    pos = np.zeros((B, t), np.int32)
    seg[0, :100], pos[0, :100] = 1, np.arange(100)
    seg[0, 100:], pos[0, 100:] = 2, np.arange(t - 100)
    seg[1, :t - 56], pos[1, :t - 56] = 1, np.arange(t - 56)
    return jnp.asarray(pos), jnp.asarray(seg)


def _relative(a, b, where=None):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if where is not None:
        a, b = a[where], b[where]
    return float(np.abs(a - b).max() / np.abs(a).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_splash_matches_the_einsum_forward_and_gradient(dtype, packed):
    """Splash (interpret mode, blocks of 128) against the einsum: outputs and the gradients of q, k and v
    of a loss that reads the real tokens (fp32 to 1e-5 relative, bf16 to 3e-2); packed rows keep their
    samples apart and padding (segment 0) out of every real token's attention."""
    q, k, v = _qkv(dtype)
    if packed:
        positions, segments = _packed()
        real = np.asarray(segments) > 0
    else:
        positions, segments = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), None
        real = np.ones((B, T), bool)
    weight = jnp.asarray(real, jnp.float32)[:, :, None, None]

    def loss(q, k, v, impl):
        out = attention.attention(q, k, v, positions_BT=positions, segment_ids_BT=segments, impl=impl)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)) * weight), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (gq_e, gk_e, gv_e), out_e = grad(q, k, v, "einsum")
    (gq_s, gk_s, gv_s), out_s = grad(q, k, v, "splash")
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    assert out_s.dtype == dtype
    assert _relative(out_e, out_s, real) < tol
    for ge, gs in ((gq_e, gq_s), (gk_e, gk_s), (gv_e, gv_s)):
        assert _relative(ge, gs) < tol
    if packed:  # the second sample of row 0 attends to nothing of the first: its output is the one-row answer
        alone = attention.attention(q[:1, 100:], k[:1, 100:], v[:1, 100:], impl="einsum",
                                    positions_BT=positions[:1, 100:])
        assert _relative(alone, out_s[:1, 100:]) < tol


def test_splash_inside_shard_map_matches_the_einsum():
    """On a mesh of fsdp 2 x tensor 2 (batch and heads split, kv heads 2 over tensor 2) and of tensor 4
    (2 kv heads repeated to 4), at T = 200 (run padded to 256), splash gives the einsum's output and
    gradients."""
    q, k, v = (x[:, :200] for x in _qkv(jnp.float32))
    positions, segments = _packed(200)
    real = np.asarray(segments) > 0
    weight = jnp.asarray(real, jnp.float32)[:, :, None, None]
    for shape in ({"fsdp": 2, "tensor": 2}, {"tensor": 4}):
        mesh = make_mesh(shape, jax.devices()[:4])

        def loss(q, k, v, impl, mesh=mesh):
            out = attention.attention(q, k, v, positions_BT=positions, segment_ids_BT=segments, mesh=mesh, impl=impl)
            return jnp.sum(jnp.sin(out) * weight), out

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
        (gq_e, gk_e, _), out_e = grad(q, k, v, "einsum")
        (gq_s, gk_s, _), out_s = grad(q, k, v, "splash")
        assert _relative(out_e, out_s, real) < 1e-5, shape
        assert _relative(gq_e, gq_s) < 1e-5 and _relative(gk_e, gk_s) < 1e-5, shape


def test_implementation_is_chosen_from_platform_shape_and_dtype():
    """One table: splash on TPU from 128 tokens (T padded to a multiple of 128) with heads a multiple of
    128; cuDNN on GPU for unsegmented
    bf16/fp16 rows, XLA's otherwise; the einsum on CPU and for short or odd rows."""
    choose = kernels.attention_kernel
    assert choose("tpu", 32768, jnp.bfloat16, 128, True) == "splash"
    assert attention.kernel_block(32768) == 512 and attention.kernel_block(384) == 128
    assert attention.kernel_block(32767) == 512 and attention.kernel_block(3968) == 128  # T padded to 128s
    assert choose("tpu", 64, jnp.bfloat16, 128, False) == "einsum"
    assert choose("tpu", 4095, jnp.bfloat16, 128, False) == "splash"
    assert choose("tpu", 4096, jnp.bfloat16, 64, False) == "einsum"
    assert choose("gpu", 4096, jnp.bfloat16, 128, False) == "cudnn"
    assert choose("gpu", 4096, jnp.float32, 128, False) == "xla"
    assert choose("gpu", 4096, jnp.bfloat16, 128, True) == "xla"
    assert choose("gpu", 4096, jnp.bfloat16, 256, False) == "xla"
    assert choose("cpu", 4096, jnp.bfloat16, 128, False) == "einsum"
    with pytest.raises(ValueError, match="unknown attention implementation"):
        attention.attention(*_qkv(jnp.float32), positions_BT=jnp.zeros((B, T), jnp.int32), impl="flash")


def test_model_loss_and_lora_gradient_with_each_implementation():
    """A 1-layer Qwen3 with heads of 128 (4 q, 2 kv) and LoRA r4 on every target, packed rows of 128 on a
    fsdp 2 x tensor 2 mesh, remat on: the loss and the LoRA gradient with splash (interpret mode) and with
    `jax.nn.dot_product_attention`'s XLA path equal the einsum's (fp32, 1e-5 relative)."""
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=N,
                      num_kv_heads=K, head_dim=H)
    targets = tuple(blocks.LORA_TARGETS)
    base = modules.init_params(cfg, jax.random.key(0))
    lora = modules.init_lora(cfg, 4, targets, jax.random.key(1))
    lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), lora)  # b != 0
    tokens = jax.random.randint(jax.random.key(3), (B, 128), 0, cfg.vocab_size)
    positions, segments = _packed(128)
    real = jnp.asarray(np.asarray(segments) > 0, jnp.float32)
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])

    def loss(lora, impl):
        hidden, _ = decoder.forward(cfg, base, tokens, positions, lora=lora, lora_scale=2.0, remat=True, mesh=mesh,
                                    segment_ids=segments, attention_impl=impl)
        logp = jax.nn.log_softmax(decoder.logits(base, hidden))
        nll = -jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * real[:, 1:]) / real[:, 1:].sum()

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    loss_e, grad_e = value_and_grad(lora, "einsum")
    for impl in ("splash", "xla"):
        loss_i, grad_i = value_and_grad(lora, impl)
        assert abs(float(loss_i) - float(loss_e)) < 1e-5 * abs(float(loss_e)), impl
        flat_e, flat_i = jax.tree.leaves(grad_e), jax.tree.leaves(grad_i)
        assert max(_relative(a, b) for a, b in zip(flat_e, flat_i, strict=True)) < 1e-4, impl
