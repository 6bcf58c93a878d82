"""The trainer computes the same step however the work is split: one device against a data x fsdp x tensor mesh
(gradients, the sharded optimizer, a whole step) and one pass against micro-batches (gradient accumulation),
within float32 bounds derived from the sums involved. (The trainer's other tests: tests/test_train.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import random_batch, tiny_model_config, tiny_trainer

from jaxrl.parallel.sharding import make_mesh
from jaxrl.rl.train import Trainer, detached, make_optimizer

CFG = tiny_model_config()
LR = 1e-2


def _setup(mesh, tx=None, **trainer_args):
    return tiny_trainer(CFG, mesh, tx=tx or make_optimizer(LR), **trainer_args)


# float32 unit roundoff (half the machine epsilon) and the accumulation lengths of the sharded-parity tests below.
U32 = float(np.finfo(np.float32).eps) / 2
PARITY_BATCH, PARITY_WIDTH = 8, 32  # random_batch(): 8 samples, pad_to 32 -> 32 positions
ADAM_EPS = 1e-8  # optax.adamw's default, which make_optimizer keeps
# Terms summed along the longest reduction path from the loss to a LoRA gradient: the loss and each weight
# gradient over the batch's tokens (twice), the logsumexp over the vocabulary, and per layer the contractions over
# the hidden size, the attention span, the heads x head_dim, the MLP width and the LoRA rank (forward and backward).
N_ACC = 2 * PARITY_BATCH * PARITY_WIDTH + CFG.vocab_size + 2 * CFG.num_layers * (
    CFG.hidden_size + PARITY_WIDTH + CFG.num_heads * CFG.head_dim + CFG.intermediate_size + 4)
# Two float32 evaluations of the same sums in different orders differ by at most 2 gamma_n relative to the terms'
# magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.4: gamma_n = n u / (1 - n u)).
GRAD_RTOL = 2 * N_ACC * U32 / (1 - N_ACC * U32)


def _lora_grads(trainer, base, lora, batch):
    """The LoRA gradient of the trainer's loss (what the step's optimizer receives) and the loss's metrics."""
    return jax.jit(jax.grad(lambda factors: trainer.loss({"base": base, "lora": factors}, trainer.shard_batch(batch)),
                            has_aux=True))(lora)


def _with_random_b(lora):
    """`lora` with 0.05 x N(0, 1) added to every b (fresh LoRA has b = 0, so a would get no gradient), placed alike."""
    noise = jax.tree.map(lambda x: np.random.default_rng(3).standard_normal(x.shape).astype(np.float32), lora)
    return jax.tree_util.tree_map_with_path(
        lambda p, x, e: jax.device_put(x + 0.05 * e, x.sharding) if p[-1].key == "b" else x, lora, noise)


def _assert_close_by_norm(want, got, rtol):
    """Per leaf ||got - want|| <= rtol ||want|| (2-norms, in float64), every leaf of `want` non-zero."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a) > 0, jax.tree_util.keystr(path)
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(a), jax.tree_util.keystr(path)


def _assert_same_first_adam_step(w0, g, w_a, w_b):
    """Two first AdamW steps from the LoRA `w0` whose clipped gradients agree per leaf within GRAD_RTOL, `g` being
    one of them: each moves every element by -lr g / (|g| + eps) (after bias correction m = g, v = g^2), about lr
    whatever the gradient's size, so they are compared by sign and magnitude. Every move is at most lr; where
    |g_i| >= 2 GRAD_RTOL ||g|| (so both gradients have its sign and are within a factor 2 of each other) the two
    moves differ by at most lr eps / |g_i| plus the rounding of the update and of the add (8 u lr + 2 u |w_i|).
    Elements with a smaller gradient may move either way: float32 noise, not a difference in the math."""
    for w0_, g_, wa, wb in zip(*(jax.tree.leaves(t) for t in (w0, g, w_a, w_b)), strict=True):
        w0_, g_ = np.asarray(w0_, np.float64), np.abs(np.asarray(g_, np.float64))
        for w in (wa, wb):
            assert np.all(np.abs(np.asarray(w) - w0_) <= LR * (1 + 8 * U32) + 2 * U32 * np.abs(w0_))
        firm = g_ >= 2 * GRAD_RTOL * np.linalg.norm(g_)
        bound = LR * ADAM_EPS / np.where(firm, g_, 1.0) + 8 * U32 * LR + 2 * U32 * np.abs(w0_)
        assert np.all(np.abs(np.asarray(wb) - np.asarray(wa))[firm] <= bound[firm])
        assert firm.mean() > 0.9  # the comparison covers most elements


@pytest.fixture(scope="module")
def parity():
    """The same model, LoRA (every factor non-zero: fresh LoRA has b = 0, so a would get no gradient) and
    optimizer state on one device ("one") and on a data 2 x fsdp 2 x tensor 2 mesh ("mesh"), as
    (base, trainer, state); and the one-device LoRA gradient of `random_batch(0)` with its metrics."""
    setups = {}
    for name, shape, n in (("one", {}, 1), ("mesh", {"data": 2, "fsdp": 2, "tensor": 2}, 8)):
        base, trainer, state = _setup(make_mesh(shape, jax.devices()[:n]))
        setups[name] = (base, trainer, trainer.init_state(base, _with_random_b(state.lora)))
    assert len(jax.tree.leaves(setups["mesh"][2].lora)[0].sharding.device_set) == 8
    base, trainer, state = setups["one"]
    return setups, _lora_grads(trainer, base, state.lora, random_batch(0))


@pytest.mark.numerics
def test_sharded_gradients_match_single_device(parity):
    """Sharding the train step changes only the order of float32 sums. From the same LoRA and batch, the gradients
    before the optimizer agree per leaf as ||g8 - g1|| <= GRAD_RTOL ||g1||, and the loss's metrics within
    GRAD_RTOL: GRAD_RTOL = 2 gamma_n (about 1.5e-4 here), n = N_ACC the terms accumulated along the longest path
    from the loss to a LoRA factor, is the forward-error bound of float32 summation in any order (Higham eq. 3.4),
    twice for two orders."""
    setups, (g1, m1) = parity
    base, trainer, state = setups["mesh"]
    g8, m8 = _lora_grads(trainer, base, state.lora, random_batch(0))
    _assert_close_by_norm(g1, g8, GRAD_RTOL)
    for k in m1:
        np.testing.assert_allclose(float(m8[k]), float(m1[k]), rtol=GRAD_RTOL, atol=0, err_msg=k)


@pytest.mark.numerics
def test_sharded_optimizer_matches_single_device(parity):
    """The optimizer over sharded state: the same gradients (the one-device ones of two batches) through the
    trainer's AdamW on each mesh's optimizer state. Adam is elementwise and the clipping norm is below
    max_grad_norm, so the two updates agree to the rounding of a few elementwise operations: 16 u lr."""
    setups, (g_first, _) = parity
    base, trainer, state = setups["one"]
    grads = [g_first, _lora_grads(trainer, base, state.lora, random_batch(1))[0]]
    moves = []
    for base, trainer, state in setups.values():
        update = jax.jit(trainer.tx.update)
        params, zeros = {"base": base, "lora": state.lora}, jax.tree.map(jnp.zeros_like, base)
        opt_state, steps = state.opt_state, []
        for g in grads:
            g = jax.device_put(jax.tree.map(np.asarray, g), jax.tree.map(lambda x: x.sharding, state.lora))
            u, opt_state = update({"base": zeros, "lora": g}, opt_state, params)
            steps.append(jax.tree.map(np.asarray, u["lora"]))
        moves.append(steps)
    for s1, s8 in zip(*moves, strict=True):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=0, atol=16 * U32 * LR), s1, s8)


@pytest.mark.numerics
def test_sharded_train_step_matches_single_device(parity):
    """One whole `Trainer.step` on each mesh, from the same LoRA and batch: by the gradient test their gradients
    agree within GRAD_RTOL, so the steps agree as `_assert_same_first_adam_step` says (the clipping factor is 1:
    the gradient norm is below max_grad_norm)."""
    setups, (g1, _) = parity
    after = {}
    for name, (base, trainer, state) in setups.items():
        new, metrics = trainer.step(detached(state), base, random_batch(0))  # the step donates its state
        assert float(metrics["optim/grad_norm"]) < 1.0
        after[name] = jax.tree.map(np.asarray, new.lora)
    _assert_same_first_adam_step(setups["one"][2].lora, g1, after["one"], after["mesh"])


def _adam_state(opt_state) -> optax.ScaleByAdamState:
    """The LoRA branch's Adam state (count, mu, nu) in the trainer's optimizer state."""
    (adam,) = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
               if isinstance(x, optax.ScaleByAdamState)]
    return adam


@pytest.mark.numerics
@pytest.mark.parametrize(("shape", "n", "micro"), [({}, 1, 3), ({"data": 2, "fsdp": 2}, 4, 4)])
def test_gradient_accumulation_matches_one_pass(shape, n, micro):
    """k micro-batches (3 of 3 rows, the last padded; or 2 of 4 rows over 4 batch shards) sum the same terms as
    one pass over the 8-row batch, in another order. So after one step from the same LoRA: Adam's first moment
    (0.1 x the clipped gradient) and the square root of its second (0.0316 x |gradient|) agree per leaf within
    GRAD_RTOL (the bound of the sharded tests, the same terms), the metrics within GRAD_RTOL, and the moves of the
    LoRA as `_assert_same_first_adam_step` says."""
    mesh = make_mesh(shape, jax.devices()[:n])
    base, one_pass, state = _setup(mesh)
    state = one_pass.init_state(base, _with_random_b(state.lora))
    accumulating = Trainer(CFG, mesh, make_optimizer(LR), lora_scale=2.0, micro_batch_size=micro)
    assert accumulating.micro_batches(8) == -(-8 // micro) > 1
    (s1, m1), (sk, mk) = (trainer.step(detached(state), base, random_batch(0))  # each step donates its state
                          for trainer in (one_pass, accumulating))
    adam1, adamk = _adam_state(s1.opt_state), _adam_state(sk.opt_state)
    assert int(adam1.count) == int(adamk.count) == 1 and int(s1.step) == int(sk.step) == 1
    _assert_close_by_norm(adam1.mu, adamk.mu, GRAD_RTOL)
    _assert_close_by_norm(jax.tree.map(jnp.sqrt, adam1.nu), jax.tree.map(jnp.sqrt, adamk.nu), GRAD_RTOL)
    assert m1.keys() == mk.keys()
    for k in m1:
        np.testing.assert_allclose(float(mk[k]), float(m1[k]), rtol=GRAD_RTOL, atol=0, err_msg=k)
    assert float(m1["optim/grad_norm"]) > 0
    clipped_grads = jax.tree.map(lambda m: m / 0.1, adam1.mu)  # mu = (1 - b1) g after one step
    _assert_same_first_adam_step(state.lora, clipped_grads, jax.tree.map(np.asarray, s1.lora),
                                 jax.tree.map(np.asarray, sk.lora))
