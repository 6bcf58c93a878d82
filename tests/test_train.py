import asyncio
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import random_batch, tiny_model_config, tiny_trainer

from jaxrl.config.algorithms import LossConfig
from jaxrl.inference.engine import Engine
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.model import decoder, modules
from jaxrl.model.blocks import LORA_TARGETS
from jaxrl.parallel.sharding import batch_shards, make_mesh, spec_shardings
from jaxrl.rl import cpu
from jaxrl.rl.train import Trainer, detached, learning_rate, loss_width, make_batch, make_optimizer, sampled_logprobs
from jaxrl.run.checkpoint import Checkpointer

CFG = tiny_model_config()
TARGETS = tuple(LORA_TARGETS)
LR = 1e-2


def _setup(mesh, tx=None, **trainer_args):
    return tiny_trainer(CFG, mesh, tx=tx or make_optimizer(LR), **trainer_args)


def test_make_batch_shifts_and_masks():
    """Width `pad_to` (its alignment kept: one padding column past the n - 1 positions a full sample fills)."""
    b = make_batch([([1, 2, 3, 4], [False, False, True, True], [0, 0, -1.0, -2.0])], np.array([0.5]), 0.7, 6)
    assert b.inputs.tolist() == [[1, 2, 3, 0, 0, 0]]
    assert b.targets.tolist() == [[2, 3, 4, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[False, True, True, False, False, False]]
    assert b.inference_logprobs.tolist() == [[0, -1.0, -2.0, 0, 0, 0]]
    full = make_batch([([5, 6, 7], [False, True, True], [0, -0.5, -0.25])], np.array([0.5]), 0.7, 3)
    assert full.inputs.tolist() == [[5, 6, 0]] and full.loss_mask.tolist() == [[True, True, False]]
    tight = make_batch([([5, 6, 7], [False, True, True], [0, -0.5, -0.25])], np.array([0.5]), 0.7, 2)
    assert tight.inputs.tolist() == [[5, 6]] and tight.targets.tolist() == [[6, 7]]
    with pytest.raises(ValueError, match="sample 0 has 3 tokens: more than 1 positions"):
        make_batch([([5, 6, 7], [False, True, True], [0, -0.5, -0.25])], np.array([0.5]), 0.7, 1)


def test_base_weights_bit_identical_and_stateless_in_optimizer():
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = _setup(mesh)
    before = jax.tree.map(np.array, base)
    lora0 = jax.tree.map(np.array, state.lora)
    for i in range(3):
        state, metrics = trainer.step(state, base, random_batch(i))
    assert int(state.step) == 3 and float(metrics["optim/skipped"]) == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), before, base)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), lora0, state.lora)
    assert all(jax.tree.leaves(changed))
    # optimizer state: Adam moments for every LoRA leaf, nothing for base weights
    n_lora = len(jax.tree.leaves(state.lora))
    frozen_state = state.opt_state.inner_states["frozen"]
    assert jax.tree.leaves(frozen_state) == []
    assert len(jax.tree.leaves(state.opt_state.inner_states["lora"])) == 2 * n_lora + 1  # mu, nu, count


@pytest.mark.numerics
def test_sampled_logprobs_match_full_softmax_at_loss_positions_only():
    base = modules.init_params(CFG, jax.random.key(0))
    h = jax.random.normal(jax.random.key(2), (3, 100, 32))
    y = jax.random.randint(jax.random.key(3), (3, 100), 0, 128)
    temp = jnp.array([1.0, 0.5, 0.0])
    rng = np.random.default_rng(0)
    mask = rng.random((3, 100)) < 0.4
    mask[2] = False  # a row without loss tokens
    positions = np.full((3, loss_width(mask.sum(1).max())), 100, np.int32)
    for i in range(3):
        positions[i, : mask[i].sum()] = np.flatnonzero(mask[i])
    lp, ent = sampled_logprobs(base, h, y, jnp.asarray(positions), temp)
    logits = jnp.einsum("BTD,DV->BTV", h, base["embed"].T) / jnp.array([1.0, 0.5, 1.0])[:, None, None]
    full = jax.nn.log_softmax(logits, axis=-1)
    want_lp = jnp.take_along_axis(full, y[..., None], -1)[..., 0]
    want_ent = -(jnp.exp(full) * full).sum(-1)
    np.testing.assert_allclose(lp, np.where(mask, want_lp, 0.0), atol=1e-5)
    np.testing.assert_allclose(ent, np.where(mask, want_ent, 0.0), atol=1e-4)


def test_make_batch_lists_each_rows_loss_positions():
    b = make_batch([([1, 2, 3, 4, 5], [False, True, False, True, True], [0.0] * 5), ([1, 2], [False, False], [0, 0])],
                   np.zeros(2), 1.0, 8)
    assert b.loss_mask[0].tolist() == [True, False, True, True, False, False, False, False]
    assert b.loss_positions.shape == (2, 8)  # loss_width(3) = 16, capped at T = 8
    assert b.loss_positions.tolist() == [[0, 2, 3, 8, 8, 8, 8, 8], [8] * 8]
    assert [loss_width(n) for n in (0, 16, 17, 25, 33, 49, 65, 97)] == [16, 16, 24, 32, 48, 64, 96, 128]


def test_non_finite_loss_skips_the_step():
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = _setup(mesh)
    bad = random_batch(0)
    bad.inference_logprobs[bad.loss_mask] = np.nan
    lora0 = jax.tree.map(np.array, state.lora)
    state, metrics = trainer.step(state, base, bad)
    assert float(metrics["optim/skipped"]) == 1.0 and int(state.step) == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), lora0, state.lora)


def test_checkpoint_round_trip_and_retention(tmp_path):
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = _setup(mesh)
    ckpt = Checkpointer(str(tmp_path / "ck"), keep=2)
    for step in range(1, 4):
        state, _ = trainer.step(state, base, random_batch(step))
        ckpt.save(step, state, {"step": step, "examples_drawn": [step]})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    fresh = trainer.init_state(base, modules.init_lora(CFG, 4, TARGETS, jax.random.key(9)))
    restored, meta = ckpt.restore(3, fresh)
    assert meta == {"step": 3, "examples_drawn": [3]} and int(restored.step) == 3
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state.lora, restored.lora)
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), state.opt_state,
                        restored.opt_state)
    assert all(jax.tree.leaves(same))

    # a checkpoint of the LoRA A factors' old layout ([stack..., in..., R], before 2026-11-26), as Orbax wrote it
    # then (no layout in its metadata), restores transposed, here onto a sharded mesh's state
    def old(path, x):
        keys = [getattr(k, "key", None) for k in path]
        return np.moveaxis(np.asarray(x), 2 if keys[-3] == "moe" else 1, -1) if keys[-1] == "a" else np.asarray(x)

    tree = jax.tree_util.tree_map_with_path(old, {"lora": state.lora, "opt_state": state.opt_state, "step": state.step})
    assert tree["lora"]["layers"]["wq"]["a"].shape == (CFG.num_layers, CFG.hidden_size, 4)
    with ocp.CheckpointManager(str(tmp_path / "old")) as mngr:
        mngr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave({"step": 3})))
    _, _, like = _setup(make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4]))
    restored, meta = Checkpointer(str(tmp_path / "old"), read_only=True).restore(3, like)
    assert meta == {"step": 3}
    for a, b, c in zip(*(jax.tree.leaves((s.lora, s.opt_state)) for s in (state, restored, like)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.is_equivalent_to(c.sharding, b.ndim), (b.sharding, c.sharding)
    ckpt.close()
    keep_all = Checkpointer(str(tmp_path / "all"), keep=-1)
    for step in range(1, 5):
        keep_all.save(step, state, {"step": step})
    keep_all.close()
    assert Checkpointer(str(tmp_path / "all"), keep=-1).all_steps() == [1, 2, 3, 4]


@pytest.mark.numerics
@pytest.mark.parametrize("plain", [False, True], ids=["cpu-tuning", "plain-tuning"])
def test_step_metrics_are_those_of_the_batch(plain):
    """`policy/entropy` is the mean full-vocabulary entropy over sampled tokens, `optim/grad_norm` the
    global norm of the LoRA gradient (before clipping), `policy/kl` the k3 mean, each recomputed here
    from a plain forward pass and `jax.grad`; with the CPU's tuning (the default here: the 2 layers
    unrolled, the head in vocabulary blocks) and with the plain one a TPU or GPU runs (scanned, one block)."""
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = _setup(mesh, tuning=cpu.Tuning.plain(CFG) if plain else None)
    assert trainer.tuning.scan_layers == plain
    batch = random_batch(1)
    _, metrics = trainer.step(detached(state), base, batch)  # the step donates its state: `state` is read below
    b, t = batch.inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def logprobs(lora):
        hidden, _ = decoder.forward(CFG, base, batch.inputs, positions, lora=lora, lora_scale=2.0)
        logits = jnp.einsum("BTD,DV->BTV", hidden, decoder.unembed_matrix(base))
        return jax.nn.log_softmax(logits, axis=-1)

    full = logprobs(state.lora)
    mask = batch.loss_mask
    entropy = -(jnp.exp(full) * full).sum(-1)
    np.testing.assert_allclose(metrics["policy/entropy"], entropy[mask].mean(), rtol=1e-4)
    lp = np.asarray(jnp.take_along_axis(full, batch.targets[..., None], -1)[..., 0])
    log_ratio = lp - batch.inference_logprobs
    k3 = np.exp(log_ratio) - 1 - log_ratio
    np.testing.assert_allclose(metrics["policy/kl"], k3[mask].mean(), rtol=1e-4)
    # jitted: an eager jax.grad compiles each operation of the forward and backward pass on its own
    grads = jax.jit(jax.grad(lambda lora, w, b: trainer.loss({"base": w, "lora": lora}, b)[0]))(
        state.lora, base, trainer.shard_batch(batch))
    np.testing.assert_allclose(metrics["optim/grad_norm"], optax.tree.norm(grads), rtol=1e-4)
    assert float(metrics["optim/grad_norm"]) > 0


def test_default_micro_batch_rule():
    from jaxrl.rl.train import default_micro_batch

    assert default_micro_batch(4096, 64) == 64  # one 4096-token sequence on each of 64 shards
    assert default_micro_batch(32_768, 8) == 8  # at least one sequence per shard
    assert default_micro_batch(256, 1) == 16


@pytest.mark.parametrize(("shape", "rows", "micro", "k", "per"),
                         [({}, 32, 25, 2, 16), ({}, 8, 3, 3, 3), ({}, 8, 8, 1, 8), ({"data": 2, "fsdp": 2}, 8, 4, 2, 4),
                          ({"data": 2, "fsdp": 2}, 10, 8, 2, 8), ({"data": 4}, 12, 8, 2, 8)])
def test_micro_batches_spread_the_rows(shape, rows, micro, k, per):
    """A batch is cut into k = ceil(rows / micro_batch_size) micro-batches of equal size, a multiple of the batch
    shards: 32 rows at most 25 per pass are 2 x 16 (2 x 25 trained 18 padding rows), 10 rows on 4 shards 2 x 8."""
    mesh = make_mesh(shape, jax.devices()[:math.prod(shape.values())])
    trainer = Trainer(CFG, mesh, make_optimizer(LR), lora_scale=2.0, micro_batch_size=micro)
    assert (trainer.micro_batches(rows), trainer.micro_rows(rows)) == (k, per)
    assert rows <= k * per < rows + k * batch_shards(mesh)


@pytest.mark.numerics
def test_engine_and_trainer_agree_at_step_one():
    """`policy/kl` between the engine's logprobs and the trainer's, same weights, fp32: below 1e-5 (the
    trainer's fused head and loss-position gather against the engine's decode step and sampler), with
    each sample at its own temperature (`[sampling.temp_scheduler]` mixes them in a batch; 0 is greedy),
    which the batch carries per row: scored all at one temperature, they disagree. Again at temperatures
    1e-4 to 2, every engine logprob <= 0."""
    base = jax.tree.map(lambda x: x * 10 if x.ndim > 1 else x, modules.init_params(CFG, jax.random.key(0)))
    lora = jax.tree.map(lambda x: x + 0.3, modules.init_lora(CFG, 4, TARGETS, jax.random.key(1)))
    mesh = make_mesh({}, jax.devices()[:1])
    engine = Engine(CFG, mesh, max_concurrent_decodes=4, max_seq_len=48, lora_scale=0.5)
    sched = Scheduler(engine, {"base": base, "lora": lora}, "tiny")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, size=int(rng.integers(3, 12))).tolist() for _ in range(6)]

    temperatures = np.array([0.7, 1.3, 0.7, 1.3, 0.0, 1.0], np.float32)
    low = np.array([1e-4, 1e-3, 1e-2, 0.1, 2.0, 0.5], np.float32)  # issue 35: logprobs once above 0 at 1e-4

    async def play(temps):
        return await asyncio.gather(*[sched.generate(p, SamplingParams(temperature=float(t), max_tokens=20, seed=i))
                                      for i, (p, t) in enumerate(zip(prompts, temps, strict=True))])

    try:
        outs = asyncio.run(play(temperatures))
        low_outs = asyncio.run(play(low))
    finally:
        sched.stop()
    samples = [(p + o.token_ids, [False] * len(p) + [True] * len(o.token_ids), [0.0] * len(p) + o.logprobs)
               for p, o in zip(prompts, outs, strict=True)]
    trainer = Trainer(CFG, mesh, make_optimizer(1e-2), lora_scale=0.5)
    advantages = rng.normal(size=6)
    batch = make_batch(samples, advantages, temperatures, pad_to=48)
    assert batch.temperature.tolist() == temperatures.tolist()
    _, metrics = trainer.step(trainer.init_state(base, lora), base, batch)
    assert 0 <= float(metrics["policy/kl"]) < 1e-5
    assert float(metrics["policy/clip_fraction"]) == 0
    _, one = trainer.step(trainer.init_state(base, lora), base, make_batch(samples, advantages, 0.7, pad_to=48))
    assert float(one["policy/kl"]) > 1e-3
    assert max(lp for o in low_outs for lp in o.logprobs) <= 0.0
    cold = [(p + o.token_ids, [False] * len(p) + [True] * len(o.token_ids), [0.0] * len(p) + o.logprobs)
            for p, o in zip(prompts, low_outs, strict=True)]
    _, cold_metrics = trainer.step(trainer.init_state(base, lora), base, make_batch(cold, advantages, low, pad_to=48))
    assert 0 <= float(cold_metrics["policy/kl"]) < 1e-5, float(cold_metrics["policy/kl"])


@pytest.mark.numerics
def test_reference_kl_is_the_base_with_lora_off():
    """`policy/ref_kl` is the k3 mean between the LoRA policy and the same base with LoRA off (0 before any
    update: LoRA's b starts at 0), and the penalty adds kl_coef times it to the loss."""
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = _setup(mesh, loss_cfg=LossConfig(kl_coef=0.5))
    batch = random_batch(3)
    state, metrics = trainer.step(state, base, batch)
    assert float(metrics["policy/ref_kl"]) == 0.0
    for i in range(2):
        state, metrics = trainer.step(state, base, random_batch(i))
    b, t = batch.inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def logprobs(lora):
        hidden, _ = decoder.forward(CFG, base, batch.inputs, positions, lora=lora, lora_scale=2.0)
        full = jax.nn.log_softmax(jnp.einsum("BTD,DV->BTV", hidden, decoder.unembed_matrix(base)), axis=-1)
        return np.asarray(jnp.take_along_axis(full, batch.targets[..., None], -1)[..., 0])

    log_r = logprobs(None) - logprobs(state.lora)
    k3 = (np.exp(log_r) - 1 - log_r)[batch.loss_mask].mean()
    assert k3 > 1e-6
    sharded = trainer.shard_batch(batch)
    params = {"base": base, "lora": state.lora}
    with_kl, m = trainer.loss(params, sharded)
    np.testing.assert_allclose(m["policy/ref_kl"], k3, rtol=1e-3)
    without = Trainer(CFG, mesh, make_optimizer(1e-2), lora_scale=2.0).loss(params, sharded)[0]
    np.testing.assert_allclose(with_kl - without, 0.5 * k3, rtol=2e-2)
    # The two losses are about 0.41 each: their difference is known to a few dozen float32 steps (5e-7 of
    # the 8.5e-5 penalty on an AVX-512 host). A 100x larger coefficient checks the factor to 1e-3.
    heavy = Trainer(CFG, mesh, make_optimizer(1e-2), lora_scale=2.0, loss_cfg=LossConfig(kl_coef=50.0))
    np.testing.assert_allclose(heavy.loss(params, sharded)[0] - without, 50.0 * k3, rtol=1e-3)


@pytest.mark.parametrize("cfg", [  # "is", the default, trains in every other test; "gspo" in the next one
    LossConfig(type="ppo", clip_high=1.28, dual_clip=3.0, kl_coef=0.1, kl_estimator="k2"),
    LossConfig(type="cispo", aggregation="sequence_sum", aggregation_length=32, clip_high=5.0, kl_coef=0.1,
               entropy_coef=0.01),
], ids=["ppo", "cispo"])
def test_each_loss_trains_two_steps(cfg):
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = _setup(mesh, loss_cfg=cfg)
    lora0 = jax.tree.map(np.array, state.lora)
    for i in range(2):
        state, metrics = trainer.step(state, base, random_batch(i))
    assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))
    assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), lora0, state.lora)))
    assert ("policy/ref_kl" in metrics) == (cfg.kl_coef > 0)


@pytest.mark.numerics
def test_sequence_aggregation_accumulates_as_one_pass():
    """GSPO with "sequence_mean" in micro-batches of 3 rows (the last padded) gives the one-pass loss and
    update: a micro-batch weighs its number of sequences, not its tokens."""
    mesh = make_mesh({}, jax.devices()[:1])
    cfg = LossConfig(type="gspo", aggregation="sequence_mean", clip_low=0.999, clip_high=1.001)
    results = []
    for micro in (None, 3):
        base, trainer, state = _setup(mesh, loss_cfg=cfg, micro_batch_size=micro)
        for i in range(2):
            state, metrics = trainer.step(state, base, random_batch(i))
        results.append((jax.tree.map(np.asarray, state.lora), float(metrics["loss"])))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), results[0][0], results[1][0])
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)


def test_learning_rate_schedules_hand_computed():
    steps = np.arange(6)
    # warmup 2 of 6: (k + 1) / 2, then p = (k - 2) / 4 over the 4 steps left
    np.testing.assert_allclose(learning_rate(steps, 1.0, "constant", 2, 6), [0.5, 1, 1, 1, 1, 1])
    np.testing.assert_allclose(learning_rate(steps, 1.0, "linear", 2, 6), [0.5, 1, 1, 0.75, 0.5, 0.25])
    cos = [(1 + np.cos(np.pi * p)) / 2 for p in (0, 0.25, 0.5, 0.75)]
    np.testing.assert_allclose(learning_rate(steps, 2.0, "cosine", 2, 6), 2 * np.array([0.5, 1, *cos]), rtol=1e-6)
    np.testing.assert_allclose(learning_rate(steps, 1e-4), [1e-4] * 6)


@pytest.mark.numerics
def test_scheduled_learning_rate_scales_each_update():
    """A schedule on a rate-1 optimizer: a constant one gives bit for bit the weights of the optimizer at
    that rate (the default run's training is unchanged); `optim/lr` is the rate of each step taken."""
    mesh = make_mesh({}, jax.devices()[:1])
    runs = {}
    for name, tx, lr in (("plain", make_optimizer(1e-2), None),
                         ("scheduled", make_optimizer(1.0), lambda s: learning_rate(s, 1e-2, "linear", 1, 3))):
        base, trainer, state = _setup(mesh, tx=tx, learning_rate=lr)
        lrs = []
        for i in range(3):
            state, metrics = trainer.step(state, base, random_batch(i))
            lrs.append(float(metrics.get("optim/lr", np.nan)))
            if i == 1:  # steps 0 and 1 run at the full rate (warmup 1, then p = 0)
                runs[name] = jax.tree.map(np.asarray, state.lora)
        runs[name + " lr"] = lrs
    jax.tree.map(np.testing.assert_array_equal, runs["plain"], runs["scheduled"])
    assert runs["scheduled lr"] == pytest.approx([1e-2, 1e-2, 1e-2 / 2])
    assert np.isnan(runs["plain lr"]).all()


@pytest.mark.numerics
def test_make_optimizer_options_hand_computed():
    """Two AdamW updates of one LoRA leaf, recomputed in numpy: global-norm clipping (gradients of norm 1e-6
    clipped to 1e-7, which Adam's eps = 1e-8 makes visible), the betas and decoupled weight decay."""
    w0 = np.array([0.5, -1.0, 2.0], np.float32)
    grads = [np.array([3e-7, -4e-7, 0.0], np.float32), np.array([-1e-6, 0.0, 0.0], np.float32)]
    lr, clip, wd, b1, b2, eps = 0.1, 1e-7, 0.1, 0.5, 0.9, 1e-8
    tx = make_optimizer(lr, max_grad_norm=clip, weight_decay=wd, betas=(b1, b2))
    params = {"base": {"w": jnp.zeros(1)}, "lora": {"w": jnp.asarray(w0)}}
    state = tx.init(params)
    w, m, v = w0.astype(np.float64), 0.0, 0.0
    for k, g in enumerate(grads, 1):
        updates, state = tx.update({"base": {"w": jnp.zeros(1)}, "lora": {"w": jnp.asarray(g)}}, state, params)
        params = optax.apply_updates(params, updates)
        g = g * min(1.0, clip / np.linalg.norm(g))
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g**2
        w = w - lr * ((m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps) + wd * w)
        np.testing.assert_allclose(params["lora"]["w"], w, rtol=1e-5)


def _full_setup(mesh, **trainer_args):
    base = modules.init_params(CFG, jax.random.key(0))
    base = jax.device_put(base, spec_shardings(modules.param_specs(CFG), CFG.dims(), mesh))
    trainer = Trainer(CFG, mesh, make_optimizer(LR, full=True), lora_scale=0.0, full=True, **trainer_args)
    return base, trainer, trainer.init_state(base, None)


@pytest.mark.numerics
def test_full_finetuning_trains_every_weight_with_state_sharded_alike():
    """`finetune = "full"`: one step is AdamW on `jax.grad` of the loss over every base weight (recomputed
    here), every weight moves, Adam's moments have the weights' shardings (fsdp x tensor mesh), the
    starting weights are untouched (they can serve as the KL reference), and the loss of a fixed batch
    goes down over a few steps (PPO's clipped surrogate, which the step minimises as it is; "is" reports
    a stop-gradient-weighted value); no LoRA factor exists."""
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])
    base, trainer, state = _full_setup(mesh, loss_cfg=LossConfig(type="ppo"))
    before = jax.tree.map(np.array, base)
    assert state.lora == {} and state.trained is state.base
    adam = state.opt_state[1][0]
    for moments in (adam.mu, adam.nu):
        jax.tree.map(lambda m, w: np.testing.assert_equal(m.sharding.is_equivalent_to(w.sharding, w.ndim), True),
                     moments, base)
    batch = random_batch(1)
    sharded = trainer.shard_batch(batch)
    # jitted: an eager jax.grad compiles each operation of the forward and backward pass on its own
    grads = jax.jit(jax.grad(lambda w, b: trainer.loss({"base": w, "lora": None}, b)[0]))(base, sharded)
    updates, _ = make_optimizer(LR, full=True).update(grads, make_optimizer(LR, full=True).init(base), base)
    expected = optax.apply_updates(base, updates)
    losses = []
    for i in range(4):
        state, metrics = trainer.step(state, None, batch)
        losses.append(float(metrics["loss"]))
        if i == 0:  # Adam's step is lr-sized where the gradient is not 0: a tiny gradient's rounding shows
            np.testing.assert_allclose(metrics["optim/grad_norm"], optax.tree.norm(grads), rtol=1e-4)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=LR / 100),
                         state.base, expected)
    assert int(state.step) == 4 and losses == sorted(losses, reverse=True) and losses[-1] < losses[0], losses
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, state.base)
    assert all(jax.tree.leaves(changed))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), before, base)
    jax.tree.map(lambda a, b: np.testing.assert_equal(a.sharding.is_equivalent_to(b.sharding, a.ndim), True),
                 state.base, base)


def test_full_finetuning_kl_reference_is_the_frozen_start():
    """In full fine-tuning `policy/ref_kl` is measured against the weights passed as `base` (the frozen
    start): 0 at the first step, > 0 once the weights moved; the step refuses a KL penalty without them."""
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = _full_setup(mesh, loss_cfg=LossConfig(kl_coef=0.5))
    with pytest.raises(ValueError, match="reference"):
        trainer.step(state, None, random_batch(0))
    state, metrics = trainer.step(state, base, random_batch(0))
    assert float(metrics["policy/ref_kl"]) == 0.0
    state, metrics = trainer.step(state, base, random_batch(0))
    assert float(metrics["policy/ref_kl"]) > 0.0


def test_full_finetuning_bfloat16_forward_keeps_float32_master_weights():
    """With `dtype` bfloat16 the forward runs in bfloat16 while the trained weights and Adam's moments stay
    float32, so an update far below bfloat16's resolution of a weight (lr 1e-6) is not rounded away."""
    mesh = make_mesh({}, jax.devices()[:1])
    base = modules.init_params(CFG, jax.random.key(0))
    trainer = Trainer(CFG, mesh, make_optimizer(1e-6, full=True), lora_scale=0.0, full=True, dtype=jnp.bfloat16)
    state = trainer.init_state(base, None)
    state, _ = trainer.step(state, None, random_batch(0))
    assert {x.dtype for x in jax.tree.leaves(state.base)} == {jnp.dtype(jnp.float32)}
    moved = jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), np.asarray(b)), base, state.base)
    assert all(jax.tree.leaves(moved))
