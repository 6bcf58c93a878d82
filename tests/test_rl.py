import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl import losses


def test_group_advantages_subtract_group_mean():
    adv = losses.group_advantages(np.array([1.0, 0.0, 0.5, 0.5, 0.0, 1.0]), group_size=3)
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.0, 0.0, -0.5, 0.5], rtol=1e-6)


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        losses.group_advantages(np.ones(6), group_size=4)


def test_policy_loss_hand_computed():
    # two samples, three positions; the last position of sample 1 is not a sampled token
    logp = jnp.log(jnp.array([[0.5, 0.25, 0.1], [0.2, 0.9, 0.3]]))
    inf = jnp.log(jnp.array([[0.5, 0.5, 0.1], [0.2, 0.05, 0.3]]))  # token (1,1): ratio 18 > 8 -> masked
    adv = jnp.array([1.0, -2.0])
    mask = jnp.array([[True, True, True], [True, True, False]])
    cfg = losses.LossConfig(kl_coef=0.1)
    loss, m = losses.policy_loss(logp, inf, adv, mask, cfg)
    lr = np.log([[1.0, 0.5, 1.0], [1.0, 18.0, 1.0]])
    keep = np.array([[1, 1, 1], [1, 0, 0]])
    ratio = np.exp(lr)
    per_tok = keep * (-ratio * np.array([[1.0], [-2.0]]) * np.asarray(logp) + 0.1 * lr**2)
    np.testing.assert_allclose(loss, per_tok.sum() / 5, rtol=1e-5)
    np.testing.assert_allclose(m["policy/clip_fraction"], 1 / 5, rtol=1e-6)
    # k3 per token: (ratio - 1) - log ratio = 0.5 - 1 - log 0.5 = 0.19315 and 18 - 1 - log 18 = 14.10963
    np.testing.assert_allclose(m["policy/kl"], (0.5 - 1 - np.log(0.5) + 17 - np.log(18)) / 5, rtol=1e-5)
    np.testing.assert_allclose(m["policy/ratio"], (1 + 0.5 + 1 + 1 + 18) / 5, rtol=1e-6)


def test_policy_gradient_raises_logprob_of_positive_advantage():
    mask = jnp.ones((1, 2), bool)
    inf = jnp.log(jnp.array([[0.3, 0.3]]))

    def f(logp):
        return losses.policy_loss(logp, inf, jnp.array([1.0]), mask)[0]

    g = jax.grad(f)(inf)
    assert (np.asarray(g) < 0).all()  # descending the loss raises logp where A > 0
    g_neg = jax.grad(lambda lp: losses.policy_loss(lp, inf, jnp.array([-1.0]), mask)[0])(inf)
    assert (np.asarray(g_neg) > 0).all()
