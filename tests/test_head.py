"""The fused output head: values and gradients equal to the plain log-softmax formulation (fp32, tiny
shapes), and the gradients it refuses to give."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.model import head

pytestmark = pytest.mark.numerics

N, D, V = 37, 16, 50  # 37 tokens: five chunks of 8, the last one padded
# vocabulary blocks: three and a remainder of 2 (the default below), two exactly, one (block > V)
BLOCKS = [(False, 16), (True, 16), (True, 25), (True, 64)]
W = jax.random.normal(jax.random.key(0), (D, V)) * 0.5
H = jax.random.normal(jax.random.key(1), (N, D))
Y = jax.random.randint(jax.random.key(2), (N,), 0, V)
S = jax.random.uniform(jax.random.key(3), (N,), minval=0.5, maxval=2.0)
G_LOGP = jax.random.normal(jax.random.key(4), (N,))
G_ENT = jax.random.normal(jax.random.key(5), (N,))


def _plain(h):
    logp_NV = jax.nn.log_softmax((h @ W) * S[:, None], axis=-1)
    return jnp.take_along_axis(logp_NV, Y[:, None], axis=-1)[:, 0], -(jnp.exp(logp_NV) * logp_NV).sum(-1)


def _fused(h, entropy_grad=False, block=16):
    return head.token_logprobs(W, h, Y, S, entropy_grad=entropy_grad, chunk=8, block=block)


@pytest.mark.parametrize(("entropy_grad", "block"), BLOCKS)
def test_values_equal_the_plain_log_softmax(entropy_grad, block):
    want, got = _plain(H), jax.jit(_fused, static_argnums=(1, 2))(H, entropy_grad, block)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_gradient_of_the_logprobs_equals_jax_grad_of_the_plain_formulation():
    want = jax.grad(lambda h: jnp.sum(_plain(h)[0] * G_LOGP))(H)
    got = jax.jit(jax.grad(lambda h: jnp.sum(_fused(h)[0] * G_LOGP)))(H)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_gradient_through_logprobs_and_entropy_with_entropy_grad():
    def loss(fn):
        return lambda h: jnp.sum(fn(h)[0] * G_LOGP + fn(h)[1] * G_ENT)

    want = jax.grad(loss(_plain))(H)
    got = jax.jit(jax.grad(loss(lambda h: _fused(h, True))))(H)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_large_logits_whose_max_moves_between_blocks():
    """Logits in the hundreds, the largest in the last block for some tokens and the first for others: the
    online rescaling (exp of the old max minus the new) neither overflows nor loses the earlier blocks."""
    h = H * 40.0
    want = _plain(h)
    got = jax.jit(_fused, static_argnums=(1, 2))(h, True, 16)
    assert np.ptp(np.argmax(np.asarray((h @ W) * S[:, None]), axis=-1) // 16) > 0
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)
    g_want = jax.grad(lambda x: jnp.sum(_plain(x)[0] * G_LOGP + _plain(x)[1] * G_ENT))(h)
    g_got = jax.jit(jax.grad(lambda x: jnp.sum(_fused(x, True)[0] * G_LOGP + _fused(x, True)[1] * G_ENT)))(h)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-4, atol=1e-4)


def test_entropy_only_as_a_metric_without_entropy_grad():
    # the train step's use: the entropy leaves as an aux output, its gradient never asked
    (_, ent), g = jax.value_and_grad(lambda h: (jnp.sum(_fused(h)[0]), _fused(h)[1]), has_aux=True)(H)
    np.testing.assert_allclose(ent, _plain(H)[1], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="entropy_grad=True"):
        jax.grad(lambda h: jnp.sum(_fused(h)[1]))(H)


def test_projection_and_temperature_are_not_differentiable():
    with pytest.raises(ValueError, match="output projection"):
        jax.grad(lambda w: jnp.sum(head.token_logprobs(w, H, Y, S)[0]))(W)
    with pytest.raises(ValueError, match="inverse temperature"):
        jax.grad(lambda s: jnp.sum(head.token_logprobs(W, H, Y, s)[0]))(S)


def test_bf16_weights_keep_float32_outputs():
    lp, ent = head.token_logprobs(W.astype(jnp.bfloat16), H.astype(jnp.bfloat16), Y, S, chunk=8, block=16)
    assert lp.dtype == ent.dtype == jnp.float32
    np.testing.assert_allclose(lp, _plain(H)[0], atol=0.1)
    g = jax.grad(lambda h: jnp.sum(head.token_logprobs(W.astype(jnp.bfloat16), h, Y, S, block=16)[0]))(
        H.astype(jnp.bfloat16))
    assert g.dtype == jnp.bfloat16


def test_w_grad_differentiates_projection_and_hidden_states_as_the_plain_formulation():
    """Full fine-tuning's path (`w_grad`): values, and gradients of W and h through logprobs and entropy
    together, equal jax.grad of the plain log-softmax (the projection is a variable here)."""
    def plain(w, h):
        logp_NV = jax.nn.log_softmax((h @ w) * S[:, None], axis=-1)
        ent = -(jnp.exp(logp_NV) * logp_NV).sum(-1)
        return jnp.sum(jnp.take_along_axis(logp_NV, Y[:, None], axis=-1)[:, 0] * G_LOGP + ent * G_ENT)

    def fused(w, h):
        logp, ent = head.token_logprobs(w, h, Y, S, w_grad=True, chunk=8)
        return jnp.sum(logp * G_LOGP + ent * G_ENT)

    np.testing.assert_allclose(jax.jit(fused)(W, H), plain(W, H), rtol=1e-5)
    want, got = jax.grad(plain, argnums=(0, 1))(W, H), jax.jit(jax.grad(fused, argnums=(0, 1)))(W, H)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
