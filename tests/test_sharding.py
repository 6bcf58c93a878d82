"""Mesh construction, logical-axis rules and shard sizes."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl.model import modules
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import RULES, bytes_per_device, check_rules, logical_spec, make_mesh


def test_logical_spec_maps_drops_and_replicates():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert logical_spec(("batch", None, "heads"), (8, 3, 6), mesh) == P(("data", "fsdp"), None, "tensor")
    want = P(None, "fsdp", "tensor", None)
    assert logical_spec(("layers", "embed", "heads", "head_dim"), (2, 8, 4, 16), mesh) == want
    assert logical_spec(("vocab", "embed"), (7, 8), mesh) == P(None, "fsdp")  # 7 rows: not divisible, replicated


def test_two_dimensions_on_one_mesh_axis_are_refused():
    mesh = make_mesh({"fsdp": 8})
    with pytest.raises(ValueError, match=r"logical axes \('embed', 'embed'\) map mesh axes \['fsdp'\] twice"):
        logical_spec(("embed", "embed"), (8, 8), mesh)


def test_rules_naming_unknown_mesh_axes_are_refused():
    check_rules(RULES)
    with pytest.raises(ValueError, match="'pipeline' is not a mesh axis"):
        check_rules({**RULES, "embed": ("pipeline",)})
    with pytest.raises(ValueError, match="more than once"):
        check_rules({"batch": ("data", "data")})


def test_mesh_must_use_every_device():
    assert dict(make_mesh({}).shape) == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}
    with pytest.raises(ValueError, match="needs 4 devices, but 8 are visible"):
        make_mesh({"data": 2, "tensor": 2})


def test_bytes_per_device_matches_placed_arrays():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    shape = {"fsdp": 2, "tensor": 2, "expert": 2}
    mesh = make_mesh(shape)
    from jaxrl.parallel.sharding import spec_shardings

    params = jax.device_put(modules.init_params(cfg, jax.random.key(0)),
                            spec_shardings(modules.param_specs(cfg), cfg.dims(), mesh))
    device0 = jax.devices()[0]
    placed = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards if s.device == device0)
    assert bytes_per_device(modules.param_specs(cfg), cfg.dims(), shape, 4) == placed
