"""The Flax NNX modules (`jaxrl.model.modules`) as the one declaration of the weights: shapes, logical
axes, shardings and initial values all read from the same variables; the LoRA filter selects exactly the
LoRA factors; a bound module reads the given arrays, not copies."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.model import decoder, modules
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import logical_spec, make_mesh, spec_shardings
from jaxrl.parallel.spec import is_spec
from jaxrl.rl.train import trainable_labels

# a mixed stack (a dense layer, an MoE layer) with an untied unembedding: every group is declared
CFG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=(0,))
TARGETS = ("q_proj", "o_proj", "down_proj")
RANK = 2


def _abstract():
    return nnx.state(nnx.eval_shape(lambda: modules.Model(CFG, key=jax.random.key(0), lora_rank=RANK,
                                                          lora_targets=TARGETS)))


def test_specs_shardings_and_init_read_one_declaration():
    state = _abstract()
    specs = {"base": modules.param_specs(CFG), "lora": modules.lora_specs(CFG, RANK, TARGETS)}
    dims = {**CFG.dims(), "R": RANK}
    assert set(specs["base"]) == {"embed", "layers", "final_norm", "mlp", "moe", "unembed"}
    shapes = jax.tree.map(lambda s: s.shape(dims), specs, is_leaf=is_spec)
    assert jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(state)) == shapes
    # the logical axes nnx reports (`nnx.get_partition_spec`) are the specs' axes ...
    axes = jax.tree.map(lambda s: tuple(s.axes), specs, is_leaf=is_spec)
    partition = nnx.to_pure_dict(nnx.get_partition_spec(state))
    assert jax.tree.map(tuple, partition, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) == axes
    # ... and the shardings the runs place weights with are those axes through the one rules table
    mesh = make_mesh({"fsdp": 2, "tensor": 2, "expert": 2}, jax.devices()[:8])
    placed = spec_shardings(specs["base"], CFG.dims(), mesh)
    assert placed["moe"]["w_up"].spec == logical_spec(partition["base"]["moe"]["w_up"],
                                                      shapes["base"]["moe"]["w_up"], mesh)
    assert placed["moe"]["w_up"].spec != jax.sharding.PartitionSpec()  # really sharded on this mesh
    # initial values follow the declared initialiser
    base = modules.init_params(CFG, jax.random.key(0))
    lora = modules.init_lora(CFG, RANK, TARGETS, jax.random.key(1))
    assert jax.tree.map(lambda x: x.shape, {"base": base, "lora": lora}) == shapes
    np.testing.assert_array_equal(base["layers"]["q_norm"], np.ones((2, 8)))
    np.testing.assert_array_equal(lora["moe"]["w_down"]["b"], np.zeros((1, 4, RANK, 16)))
    assert 0.01 < float(jnp.std(base["embed"])) < 0.03


def test_lora_filter_selects_the_factors_and_bind_copies_nothing():
    base = modules.init_params(CFG, jax.random.key(0))
    lora = modules.init_lora(CFG, RANK, TARGETS, jax.random.key(1))
    model = modules.bind(CFG, base, lora, lora_scale=0.5)
    _, trained, frozen = nnx.split(model, modules.trained_filter(full=False), ...)
    assert nnx.to_pure_dict(trained) == {"lora": lora}
    assert nnx.to_pure_dict(frozen) == {"base": base}
    _, every, rest = nnx.split(model, modules.trained_filter(full=True), ...)
    assert len(jax.tree.leaves(every)) == len(jax.tree.leaves(base)) + len(jax.tree.leaves(lora))
    assert not jax.tree.leaves(rest)
    # the optimizer's mask is that filter: "lora" on the factors, "frozen" on every base weight
    labels = trainable_labels({"base": base, "lora": lora})
    assert set(jax.tree.leaves(labels["base"])) == {"frozen"} and set(jax.tree.leaves(labels["lora"])) == {"lora"}
    # one set of arrays: the bound module's weights are the given arrays themselves
    got_base, got_lora = model.weights()
    assert got_base["layers"]["wq"] is base["layers"]["wq"] and got_lora["moe"]["w_down"]["a"] is lora["moe"][
        "w_down"]["a"]
    tokens, positions = jnp.array([[3, 5, 7]]), jnp.arange(3)[None]
    hidden, _ = model(tokens, positions)
    want, _ = decoder.forward(CFG, base, tokens, positions, lora=lora, lora_scale=0.5)
    np.testing.assert_array_equal(hidden, want)
    off, _ = model(tokens, positions, lora=False)
    np.testing.assert_array_equal(off, decoder.forward(CFG, base, tokens, positions)[0])
