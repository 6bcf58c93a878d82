"""Checkpoints on `gs://` through the same Orbax code as local folders, against a real GCS emulator
(fake-gcs-server on 127.0.0.1, see conftest.py): save, list, restore, retention, delete, and what
happens when the storage answers errors or goes away."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.parallel.sharding import make_mesh
from jaxrl.rl.train import TrainState
from jaxrl.run import gcs as gcs_lib
from jaxrl.run.checkpoint import Checkpointer, CheckpointError


def _state(seed: int, mesh=None) -> TrainState:
    rng = np.random.default_rng(seed)
    lora = {"q": {"a": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
                  "b": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)}}
    opt = {"mu": jax.tree.map(jnp.zeros_like, lora), "count": jnp.asarray(seed, jnp.int32)}
    state = TrainState(lora, opt, jnp.asarray(seed, jnp.int32))
    if mesh is not None:
        state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    return state


def _equal(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


def test_save_list_restore_and_delete_on_gcs(gcs):
    url = "gs://jaxrl-test/ckpt-basic"
    ckpt = Checkpointer(url, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), {"step": step, "examples_drawn": [step]})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3  # retention deleted step 1
    objects = gcs.list_objects(prefix="ckpt-basic/")
    assert {name.split("/")[1] for name in objects} == {"2", "3"}
    ckpt.close()

    fresh = Checkpointer(url, keep=2)  # a new process would see the same
    assert fresh.all_steps() == [2, 3] and fresh.read_meta(3) == {"step": 3, "examples_drawn": [3]}
    mesh = make_mesh({"fsdp": 2}, jax.devices()[:2])
    restored, meta = fresh.restore(3, _state(0, mesh))  # restored into another placement
    assert _equal(restored, _state(3)) and meta["step"] == 3
    assert restored.lora["q"]["a"].sharding == NamedSharding(mesh, PartitionSpec())
    with pytest.raises(CheckpointError, match="no checkpoint for step 1 in gs://jaxrl-test/ckpt-basic"):
        fresh.restore(1, _state(0))
    fresh.delete(2)
    assert fresh.all_steps() == [3]
    assert {name.split("/")[1] for name in gcs.list_objects(prefix="ckpt-basic/")} == {"3"}
    fresh.close()


def test_keep_all_on_gcs(gcs):
    ckpt = Checkpointer("gs://jaxrl-test/ckpt-all", keep=-1)
    for step in range(1, 5):
        ckpt.save(step, _state(step), {"step": step})
    ckpt.close()
    assert Checkpointer("gs://jaxrl-test/ckpt-all", keep=-1, read_only=True).all_steps() == [1, 2, 3, 4]


def test_gcs_answering_errors_fails_fast_and_clearly_then_recovers(gcs, gcs_proxy):
    url = "gs://jaxrl-test/ckpt-errors"
    ckpt = Checkpointer(url, keep=-1, attempts=3, backoff_s=0.1)
    ckpt.save(1, _state(1), {"step": 1})
    ckpt.wait()
    gcs_proxy.set_mode("error")  # every request answered 503
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError) as err:
        ckpt.save(2, _state(2), {"step": 2})
    assert time.perf_counter() - t0 < 20  # our probe's retries, not every layer's 35 s of backoff
    message = str(err.value)
    assert "save step 2 to gs://jaxrl-test/ckpt-errors" in message and "not writable after 3 attempts" in message
    assert "503" in message and "last complete checkpoint: step 1" in message
    gcs_proxy.set_mode("pass")
    ckpt.save(2, _state(2), {"step": 2})  # the same checkpointer goes on once the storage is back
    ckpt.close()
    assert Checkpointer(url, read_only=True).all_steps() == [1, 2]


def test_unreachable_gcs_is_refused_when_opened(gcs, gcs_proxy):
    gcs_proxy.set_mode("drop")  # connections closed at once: the server is gone
    with pytest.raises(CheckpointError, match=r"open gs://jaxrl-test/ckpt-down: GCSUnavailable: .*after 2 attempts"):
        Checkpointer("gs://jaxrl-test/ckpt-down", attempts=2, backoff_s=0.1)


def test_gcs_paths():
    assert gcs_lib.split("gs://b/x/y/") == ("b", "x/y") and gcs_lib.split("gs://b") == ("b", "")
    assert gcs_lib.join("gs://b/x/", "run", "/3") == "gs://b/x/run/3"
    with pytest.raises(ValueError, match="not a gs://bucket"):
        gcs_lib.split("gs:///x")
