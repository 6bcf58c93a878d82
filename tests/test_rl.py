import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config.algorithms import AdvantageConfig, LossConfig
from jaxrl.rl import losses


@pytest.mark.numerics
def test_group_advantages_subtract_group_mean():
    adv = losses.group_advantages(np.array([1.0, 0.0, 0.5, 0.5, 0.0, 1.0]), rollouts_per_example=3)
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.0, 0.0, -0.5, 0.5], rtol=1e-6)


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        losses.group_advantages(np.ones(6), rollouts_per_example=4)


@pytest.mark.numerics
def test_policy_loss_hand_computed():
    # two samples, three positions; the last position of sample 1 is not a sampled token
    logp = jnp.log(jnp.array([[0.5, 0.25, 0.1], [0.2, 0.9, 0.3]]))
    inf = jnp.log(jnp.array([[0.5, 0.5, 0.1], [0.2, 0.05, 0.3]]))  # token (1,1): ratio 18 > 8 -> masked
    adv = jnp.array([1.0, -2.0])
    mask = jnp.array([[True, True, True], [True, True, False]])
    cfg = LossConfig(mismatch_kl_coef=0.1)
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


@pytest.mark.numerics
def test_policy_gradient_raises_logprob_of_positive_advantage():
    mask = jnp.ones((1, 2), bool)
    inf = jnp.log(jnp.array([[0.3, 0.3]]))

    def f(logp):
        return losses.policy_loss(logp, inf, jnp.array([1.0]), mask)[0]

    g = jax.grad(f)(inf)
    assert (np.asarray(g) < 0).all()  # descending the loss raises logp where A > 0
    g_neg = jax.grad(lambda lp: losses.policy_loss(lp, inf, jnp.array([-1.0]), mask)[0])(inf)
    assert (np.asarray(g_neg) > 0).all()


@pytest.mark.numerics
def test_group_advantages_std_and_rloo():
    rewards = np.array([1.0, 0.0, 0.5, 0.2, 0.2, 0.2])
    # group 1: centred [0.5, -0.5, 0], population std sqrt(1/6); group 2: all equal, so 0 whatever the estimator
    std = losses.group_advantages(rewards, 3, "std")
    np.testing.assert_allclose(std, [0.5 / np.sqrt(1 / 6), -0.5 / np.sqrt(1 / 6), 0, 0, 0, 0], rtol=1e-5, atol=1e-6)
    # leave-one-out: 1 - mean(0, 0.5) = 0.75, 0 - mean(1, 0.5) = -0.75, 0.5 - mean(1, 0) = 0
    np.testing.assert_allclose(losses.group_advantages(rewards, 3, "rloo"), [0.75, -0.75, 0, 0, 0, 0], atol=1e-6)
    np.testing.assert_array_equal(losses.group_advantages(np.array([3.0]), 1, "rloo"), [0.0])


@pytest.mark.numerics
def test_advantages_clip_rewards_then_normalise_the_batch():
    groups = [np.array([2.0, 0.0]), np.array([0.5, 0.5, -1.0])]
    # clipped to [0, 1]: [1, 0] and [0.5, 0.5, 0]; centred: [0.5, -0.5] and [1/6, 1/6, -1/3]
    clipped = losses.advantages(groups, AdvantageConfig(reward_min=0.0, reward_max=1.0))
    centred = np.array([0.5, -0.5, 1 / 6, 1 / 6, -1 / 3])
    np.testing.assert_allclose(clipped, centred, atol=1e-6)
    np.testing.assert_allclose(losses.advantages(groups), [1, -1, 0.5, 0.5, -1], atol=1e-6)  # unclipped
    normed = losses.advantages(groups, AdvantageConfig(reward_min=0.0, reward_max=1.0, batch_normalize=True))
    np.testing.assert_allclose(normed, centred / np.sqrt(np.mean(centred**2)), rtol=1e-5)  # batch mean is 0
    assert losses.advantages([]).shape == (0,)


# ratios [0.5, 1, 1.5] in both rows; the advantage is +1 in row 0 and -1 in row 1
RATIOS = np.array([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
INF = np.log(np.array([[0.2, 0.3, 0.4], [0.2, 0.3, 0.4]]))
LOGP = jnp.asarray(INF + np.log(RATIOS), jnp.float32)
ADV = jnp.array([1.0, -1.0])
MASK = jnp.ones((2, 3), bool)


def _loss_and_grad(cfg):
    def f(logp):
        return losses.policy_loss(logp, jnp.asarray(INF, jnp.float32), ADV, MASK, cfg)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(LOGP)
    return float(loss), metrics, np.asarray(grad)


@pytest.mark.numerics
def test_ppo_clipped_surrogate_hand_computed():
    # A = +1: max(-r, -clip(r, 0.8, 1.2)) = -0.5, -1, -1.2 (clipped); A = -1: max(r, clip(r)) = 0.8 (clipped), 1, 1.5
    loss, m, grad = _loss_and_grad(LossConfig(type="ppo"))
    np.testing.assert_allclose(loss, (-0.5 - 1 - 1.2 + 0.8 + 1 + 1.5) / 6, rtol=1e-5)
    np.testing.assert_allclose(m["policy/clip_fraction"], 2 / 6, rtol=1e-6)
    # d/dlogp of -r*A is -r*A where unclipped, 0 where clipped (token mean over 6)
    np.testing.assert_allclose(grad, np.array([[-0.5, -1, 0], [0, 1, 1.5]]) / 6, rtol=1e-5, atol=1e-7)
    # DAPO clip-higher: with clip_high = 1.6, ratio 1.5 with A = +1 is no longer clipped
    loss, _, grad = _loss_and_grad(LossConfig(type="ppo", clip_high=1.6))
    np.testing.assert_allclose(loss, (-0.5 - 1 - 1.5 + 0.8 + 1 + 1.5) / 6, rtol=1e-5)
    np.testing.assert_allclose(grad[0], np.array([-0.5, -1, -1.5]) / 6, rtol=1e-5)
    # clip_low = 0.4: ratio 0.5 with A = -1 is inside the range, loss 0.5 and a gradient
    loss, _, grad = _loss_and_grad(LossConfig(type="ppo", clip_low=0.4))
    np.testing.assert_allclose(loss, (-0.5 - 1 - 1.2 + 0.5 + 1 + 1.5) / 6, rtol=1e-5)
    np.testing.assert_allclose(grad[1, 0], 0.5 / 6, rtol=1e-5)
    # dual clip c = 1.4: A = -1 caps the loss at -c * A = 1.4 (ratio 1.5), with no gradient there
    loss, m, grad = _loss_and_grad(LossConfig(type="ppo", dual_clip=1.4))
    np.testing.assert_allclose(loss, (-0.5 - 1 - 1.2 + 0.8 + 1 + 1.4) / 6, rtol=1e-5)
    np.testing.assert_allclose(grad[1], [0, 1 / 6, 0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["policy/clip_fraction"], 3 / 6, rtol=1e-6)


@pytest.mark.numerics
def test_gspo_sequence_ratio_hand_computed():
    inf = jnp.log(jnp.array([[0.2, 0.3], [0.2, 0.3]]))
    logp = inf + jnp.log(jnp.array([[2.0, 1.0], [0.9, 1.0]]))
    adv = jnp.array([1.0, 1.0])
    cfg = LossConfig(type="gspo", aggregation="sequence_mean")

    def f(lp):
        return losses.policy_loss(lp, inf, adv, jnp.ones((2, 2), bool), cfg)

    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
    # s = geometric mean of the ratios: sqrt(2) = 1.414 -> clipped to 1.2; sqrt(0.9) = 0.9487 inside
    np.testing.assert_allclose(loss, (-1.2 - np.sqrt(0.9)) / 2, rtol=1e-5)
    np.testing.assert_allclose(m["policy/clip_fraction"], 0.5, rtol=1e-6)
    # row 1: d(-s)/dlogp_t = -s / 2 per token, halved by the mean over two sequences; row 0: clipped, 0
    np.testing.assert_allclose(grad, [[0, 0], [-np.sqrt(0.9) / 4] * 2], rtol=1e-5, atol=1e-7)
    # token-level PPO on the same tokens differs: its ratio 2 token is clipped but ratio 1 is not
    assert not np.isclose(float(losses.policy_loss(logp, inf, adv, jnp.ones((2, 2), bool),
                                                   LossConfig(type="ppo", aggregation="sequence_mean"))[0]), loss)


@pytest.mark.numerics
def test_cispo_keeps_clipped_tokens_gradient():
    ratios = jnp.array([[0.5, 1.0, 2.0]])
    inf = jnp.log(jnp.array([[0.2, 0.3, 0.4]]))
    logp = inf + jnp.log(ratios)

    def f(lp):
        return losses.policy_loss(lp, inf, jnp.array([1.0]), jnp.ones((1, 3), bool), LossConfig(type="cispo"))

    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
    w = np.array([0.8, 1.0, 1.2])  # clip(ratio, 0.8, 1.2), a constant
    np.testing.assert_allclose(loss, np.sum(-w * np.asarray(logp[0])) / 3, rtol=1e-5)
    np.testing.assert_allclose(grad[0], -w / 3, rtol=1e-5)  # every token keeps a gradient (PPO's would be 0)
    np.testing.assert_allclose(m["policy/clip_fraction"], 2 / 3, rtol=1e-6)


@pytest.mark.numerics
def test_aggregations_hand_computed():
    values = jnp.array([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = jnp.array([[True, True, True], [True, False, False], [False, False, False]])  # row 2: no token
    assert float(losses.aggregate(values, mask, "token_mean")) == pytest.approx(10 / 4)
    assert float(losses.aggregate(values, mask, "sequence_mean")) == pytest.approx((2 + 4) / 2)
    assert float(losses.aggregate(values, mask, "sequence_sum", 10)) == pytest.approx((6 + 4) / (10 * 2))
    with pytest.raises(ValueError, match="length"):
        losses.aggregate(values, mask, "sequence_sum")
    # the loss follows the aggregation: "is" with A = 1 everywhere, ratio 1, one long and one short row
    inf = jnp.log(jnp.full((2, 3), 0.5))
    m2 = jnp.array([[True, True, True], [True, False, False]])
    adv = jnp.array([1.0, 1.0])
    tok = losses.policy_loss(inf, inf, adv, m2, LossConfig())[0]
    seq = losses.policy_loss(inf, inf, adv, m2, LossConfig(aggregation="sequence_sum", aggregation_length=4))[0]
    np.testing.assert_allclose(tok, -np.log(0.5) * 4 / 4, rtol=1e-6)
    np.testing.assert_allclose(seq, -np.log(0.5) * (3 + 1) / (4 * 2), rtol=1e-6)


@pytest.mark.parametrize(("estimator", "value", "dvalue"), [
    ("k1", np.log(2), 1.0),                      # -log r, r = 0.25 / 0.5
    ("k2", 0.5 * np.log(2) ** 2, np.log(2)),     # (log r)^2 / 2; d/dlogp = -log r
    ("k3", 0.5 - 1 + np.log(2), 0.5),            # r - 1 - log r; d/dlogp = 1 - r
])
@pytest.mark.numerics
def test_reference_kl_penalty_hand_computed(estimator, value, dvalue):
    logp, ref = jnp.log(jnp.full((1, 2), 0.5)), jnp.log(jnp.full((1, 2), 0.25))
    np.testing.assert_allclose(losses.kl_penalty(logp, ref, estimator), [[value, value]], rtol=1e-5)
    cfg = LossConfig(type="cispo", kl_coef=0.1, kl_estimator=estimator)
    mask = jnp.ones((1, 2), bool)

    def f(lp):
        return losses.policy_loss(lp, logp, jnp.array([0.0]), mask, cfg, ref_logp_BT=ref)  # A = 0: only the KL

    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
    np.testing.assert_allclose(loss, 0.1 * value, rtol=1e-5)
    np.testing.assert_allclose(m["policy/ref_kl"], value, rtol=1e-5)
    np.testing.assert_allclose(grad, [[0.1 * dvalue / 2] * 2], rtol=1e-5)
    with pytest.raises(ValueError, match="reference"):
        losses.policy_loss(logp, logp, jnp.array([0.0]), mask, cfg)
    assert "policy/ref_kl" not in losses.policy_loss(logp, logp, jnp.array([0.0]), mask, LossConfig())[1]


@pytest.mark.numerics
def test_entropy_bonus_lowers_the_loss_by_its_coefficient():
    logp = jnp.log(jnp.full((1, 2), 0.5))
    entropy = jnp.array([[2.0, 4.0]])
    mask = jnp.ones((1, 2), bool)
    base, _ = losses.policy_loss(logp, logp, jnp.array([1.0]), mask, LossConfig())
    cfg = LossConfig(entropy_coef=0.01)
    with_bonus, _ = losses.policy_loss(logp, logp, jnp.array([1.0]), mask, cfg, entropy_BT=entropy)
    np.testing.assert_allclose(base - with_bonus, 0.01 * 3.0, rtol=1e-5)
    grad = jax.grad(lambda e: losses.policy_loss(logp, logp, jnp.array([1.0]), mask, cfg, entropy_BT=e)[0])(entropy)
    np.testing.assert_allclose(grad, [[-0.005, -0.005]], rtol=1e-6)
