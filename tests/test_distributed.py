"""Multi-host runtime: `jaxrl.parallel.distributed` settings from the environment, and a real two-process run
(2 processes x 4 emulated CPU devices on 127.0.0.1, gloo collectives) whose sharded train steps give the
same loss and LoRA as one process with 8 devices, and whose rollout engine spanning both processes
(`jaxrl.inference.lockstep`) samples the same greedy tokens as one process's engine over 8 devices."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import subprocess_env

from jaxrl.inference.engine import Engine
from jaxrl.inference.lockstep import GroupScheduler
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.model import modules
from jaxrl.model.blocks import LORA_TARGETS
from jaxrl.model.config import ModelConfig
from jaxrl.parallel import distributed
from jaxrl.parallel.sharding import array_sharding, make_mesh, spec_shardings
from jaxrl.rl.train import Batch, Trainer, make_batch, make_optimizer

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
TARGETS = tuple(LORA_TARGETS)
MESH = {"data": 2, "fsdp": 2, "tensor": 2}  # data spans the two hosts; fsdp x tensor lies within one
STEPS = 2


def _batch(seed: int, b: int = 8, t: int = 24) -> Batch:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(b):
        n = int(rng.integers(8, t))
        prompt = int(rng.integers(2, n - 2))
        mask = [i >= prompt for i in range(n)]
        samples.append((rng.integers(0, 128, n).tolist(), mask, [-4.0 if m else 0.0 for m in mask]))
    return make_batch(samples, rng.normal(size=b).astype(np.float32), temperature=1.0, pad_to=32)


def _train() -> dict:
    """STEPS train steps of the tiny model on a MESH over every device of every process, twice from the same
    start: "replicated" gives every process the whole of each batch; "host_local" gives each process only
    its rows, as a host that ran its own rollouts has. Each: the last step's metrics and the final LoRA."""
    mesh = make_mesh(MESH)
    # Weights are born sharded (one jitted init) rather than put leaf by leaf from one device: across
    # processes each such transfer is a collective, and it took 20 s here.
    base = jax.jit(lambda k: modules.init_params(CFG, k),
                   out_shardings=spec_shardings(modules.param_specs(CFG), CFG.dims(), mesh))(jax.random.key(0))
    lora_sh = spec_shardings(modules.lora_specs(CFG, 4, TARGETS), {**CFG.dims(), "R": 4}, mesh)
    lora = jax.jit(lambda k: modules.init_lora(CFG, 4, TARGETS, k), out_shardings=lora_sh)(jax.random.key(1))
    trainer = Trainer(CFG, mesh, make_optimizer(1e-2), lora_scale=2.0)
    out = {}
    for mode in ("replicated", "host_local"):
        state = trainer.init_state(base, lora)
        for i in range(STEPS):
            batch = _batch(i)
            if mode == "host_local":
                n, p = batch.inputs.shape[0] // jax.process_count(), jax.process_index()
                batch = Batch(**{
                    name: distributed.global_batch(
                        arr[p * n:(p + 1) * n], array_sharding(("batch",) + (None,) * (arr.ndim - 1), arr.shape, mesh))
                    for name, arr in vars(batch).items() if arr is not None})
            state, metrics = trainer.step(state, base, batch)
        out[mode] = {"metrics": {k: float(v) for k, v in metrics.items()},
                     "lora": [x.tolist() for x in jax.tree.leaves(distributed.to_host(state.lora))],
                     "lora_devices": len(jax.tree.leaves(state.lora)[0].sharding.device_set)}
    return out


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14], [3, 3, 3, 3, 3, 3], [7, 1]]
MAX_TOKENS = [8, 8, 8, 8, 8, 16]  # process 1's last request outlives process 0's: process 0 asks to stop first
LAG_S = 2.0  # how much later process 1 hands over the new weights: far longer than a round of the group


def _generate() -> dict:
    """Greedy completions of PROMPTS (MAX_TOKENS tokens, 4 decode slots: two requests queue) by one engine over
    every device of every process, each process asking for its own prompts (process p: every P-th from p);
    then, after gathers, an update to a LoRA of version 1 that process 1 makes LAG_S seconds after process 0 and
    one more prompt per process, each sent as soon as its process's update returned (process 0's must wait for
    process 1's update, as a request sent after `update_params` on one host never samples an older policy), and
    a stop that process 0 asks for while process 1's request is still decoding.
    Prompt index -> (tokens, policy versions)."""
    mesh = make_mesh(MESH)
    base = jax.jit(lambda k: modules.init_params(CFG, k),
                   out_shardings=spec_shardings(modules.param_specs(CFG), CFG.dims(), mesh))(jax.random.key(0))
    lora_sh = spec_shardings(modules.lora_specs(CFG, 4, TARGETS), {**CFG.dims(), "R": 4}, mesh)
    lora = jax.jit(lambda k: jax.tree.map(lambda x: x + 0.05, modules.init_lora(CFG, 4, TARGETS, k)),
                   out_shardings=lora_sh)(jax.random.key(1))
    engine = Engine(CFG, mesh, max_concurrent_decodes=4, max_seq_len=32, lora_scale=2.0)
    params = {"base": base, "lora": None}
    count, index = jax.process_count(), jax.process_index()
    sched = GroupScheduler(engine, params, "tiny", distributed.Exchange()) if count > 1 else \
        Scheduler(engine, params, "tiny")

    async def ask(indices):
        greedy = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i]) for i in indices]
        done = await asyncio.gather(*[sched.generate(PROMPTS[i], p) for i, p in zip(indices, greedy, strict=True)])
        return {i: (c.token_ids, c.policy_versions) for i, c in zip(indices, done, strict=True)}

    try:
        out = asyncio.run(ask(range(index, 4, count)))
        for _ in range(3):  # device collectives while the group's engine is parked, back to back
            with sched.paused():
                distributed.any_process(False)
        time.sleep(LAG_S * index)  # processes hand a step's weights over at different moments (a run's train step)
        sched.update_params({"base": base, "lora": lora}, version=1)
        out |= asyncio.run(ask(range(4 + index, 6, count)))
    finally:
        sched.stop()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, list[dict]]:
    """(this process's result on 8 devices with one controller, the results of this file run as a worker in
    2 processes x 4 CPU devices). The workers compile while this process does, to save wall time; a worker
    that fails ends the other at once (it would wait for its peer until the coordination service's
    timeout), and the failure shows both workers' logs."""
    out = tmp_path_factory.mktemp("dist")
    port = _free_port()
    procs = []
    for pid in range(2):
        env = {k: v for k, v in subprocess_env(4).items() if not k.startswith("JAX_")}
        env |= {"JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(pid)}
        with open(out / f"{pid}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, __file__, str(out / f"{pid}.json")], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    try:
        single = _train()["replicated"] | {"generated": _generate()}
        deadline = time.monotonic() + 600  # about 60 s on an idle 2-core machine
        while time.monotonic() < deadline and any(p.poll() is None for p in procs) \
                and all(p.poll() in (None, 0) for p in procs):
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    logs = "\n".join(f"--- worker {pid} (exit {p.returncode}):\n" + (out / f"{pid}.log").read_text()[-5000:]
                     for pid, p in enumerate(procs))
    assert all(p.returncode == 0 for p in procs), logs
    return single, [json.loads((out / f"{pid}.json").read_text()) for pid in range(2)]


@pytest.mark.numerics
def test_an_engine_spanning_two_processes_samples_what_one_process_does(results):
    single, pair = results
    want = {str(i): v for i, v in single["generated"].items()}  # JSON keys
    assert sorted(want) == [str(i) for i in range(len(PROMPTS))]
    got = pair[0]["generated"] | pair[1]["generated"]
    assert sorted(pair[0]["generated"]) == ["0", "2", "4"] and sorted(pair[1]["generated"]) == ["1", "3", "5"]
    assert got == {i: [list(tokens), list(versions)] for i, (tokens, versions) in want.items()}
    assert [len(got[str(i)][0]) for i in range(len(PROMPTS))] == MAX_TOKENS
    assert [got[i][1] for i in "0145"] == [[0] * 8, [0] * 8, [1] * 8, [1] * 16]  # after the update: version 1


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["replicated", "host_local"])
def test_two_processes_match_one_process(results, mode):
    single, pair = results
    assert single["lora_devices"] == 8
    for r in pair:
        got = r[mode]
        assert got["lora_devices"] == 8 and r["process_count"] == 2 and r["local_devices"] == 4
        for k, v in single["metrics"].items():
            np.testing.assert_allclose(got["metrics"][k], v, rtol=1e-5, atol=1e-6, err_msg=k)
        for a, b in zip(got["lora"], single["lora"], strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6)
    assert [r["primary"] for r in pair] == [True, False]


@pytest.mark.parametrize(("count", "n"), [(1, 5), (2, 2), (3, 8), (4, 2)])
def test_share_splits_items_into_contiguous_blocks_in_process_order(monkeypatch, count, n):
    monkeypatch.setattr(jax, "process_count", lambda: count)
    shares = []
    for index in range(count):
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        shares.append(distributed.share(n))
    assert [i for s in shares for i in s] == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_objects_and_flags_are_gathered_from_every_process(results):
    _, pair = results
    for r in pair:  # unequal sizes: process 1's object is the longer one
        assert r["gathered"] == [{"rows": []}, {"rows": [0, 1, 2]}]
        assert r["any"] == [True, False]
        # the key-value store's all-gather, round after round, and a decision taken by process 0 only
        assert r["exchanged"] == [[[0, k], [1, k]] for k in range(3)] + [["decided on 0", [0, 1]]]
    assert distributed.all_gather_objects("only") == ["only"] and distributed.any_process(True)


def test_engine_hosts_setting_or_fit_rule():
    """The setting when not 0; else an engine per host with one process or no accelerator memory figure
    (CPU), where nothing is compiled; else the compiled fit rule's answer for one chip's memory
    (tests/test_compile.py compiles it)."""
    asked = []

    def fit(chip_bytes: int) -> int:
        asked.append(chip_bytes)
        return 4

    assert distributed.engine_hosts(2, 4, 95 << 30, fit) == 2
    with pytest.raises(ValueError, match="does not divide the 6 processes"):
        distributed.engine_hosts(4, 6, None, fit)
    assert distributed.engine_hosts(0, 8, None, fit) == distributed.engine_hosts(0, 1, 95 << 30, fit) == 1
    assert asked == []
    assert distributed.engine_hosts(0, 8, 95 << 30, fit) == 4 and asked == [95 << 30]


def test_from_env_jax_variables():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed.from_env(env, tpu_vm=False) == distributed.Setup("10.0.0.2:1234", 4, 3,
                                                                         source="JAX_* variables")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID must be set"):
        distributed.from_env({k: v for k, v in env.items() if k != "JAX_PROCESS_ID"}, tpu_vm=False)
    with pytest.raises(ValueError, match="not in \\[0, 4\\)"):
        distributed.from_env(env | {"JAX_PROCESS_ID": "4"}, tpu_vm=False)
    with pytest.raises(ValueError, match="not an integer"):
        distributed.from_env(env | {"JAX_NUM_PROCESSES": "four"}, tpu_vm=False)
    with pytest.raises(ValueError, match="host:port"):
        distributed.from_env(env | {"JAX_COORDINATOR_ADDRESS": "10.0.0.2"}, tpu_vm=False)


def test_from_env_gcp_batch(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("10.128.0.7 job-0\n10.128.0.9 job-1\n")
    env = {"BATCH_TASK_INDEX": "1", "BATCH_TASK_COUNT": "2", "BATCH_HOSTS_FILE": str(hosts)}
    assert distributed.from_env(env, tpu_vm=False) == distributed.Setup("10.128.0.7:8476", 2, 1,
                                                                         source="GCP Batch")
    assert distributed.from_env(env | {"JAXRL_COORDINATOR_PORT": "9000"}, tpu_vm=False).coordinator_address \
        == "10.128.0.7:9000"
    assert distributed.from_env({"BATCH_TASK_INDEX": "0", "BATCH_TASK_COUNT": "1"}, tpu_vm=False) is None
    with pytest.raises(ValueError, match="requireHostsFile"):
        distributed.from_env({"BATCH_TASK_INDEX": "0", "BATCH_TASK_COUNT": "2"}, tpu_vm=False)


def test_from_env_tpu_vm_and_plain_host(tmp_path):
    assert distributed.from_env({}, tpu_vm=True) == distributed.Setup(auto_detect=True, source="Cloud TPU metadata")
    assert distributed.from_env({}, tpu_vm=False) is None

    def pci(slot: str, vendor: str, device: str) -> None:
        folder = tmp_path / "bus" / "pci" / "devices" / slot
        folder.mkdir(parents=True)
        (folder / "vendor").write_text(vendor + "\n")
        (folder / "device").write_text(device + "\n")

    pci("0000:00:04.0", "0x1ae0", "0x0042")  # gVNIC: a Google device, not a TPU
    pci("0000:00:05.0", "0x10de", "0x2330")  # an NVIDIA H100
    assert not distributed.on_tpu_vm(str(tmp_path))
    pci("0000:00:06.0", "0x1ae0", "0x0063")  # a v5e chip
    assert distributed.on_tpu_vm(str(tmp_path))
    distributed.initialize(None)  # a plain host: nothing to join
    assert jax.process_count() == 1 and distributed.is_primary()
    distributed.barrier("single")


if __name__ == "__main__":  # a worker of `results`
    distributed.initialize(distributed.from_env())
    try:
        exchange = distributed.Exchange()
        results = {"process_count": jax.process_count(), "local_devices": jax.local_device_count(),
                   "primary": distributed.is_primary(),
                   "gathered": distributed.all_gather_objects({"rows": list(range(3 * jax.process_index()))}),
                   "any": [distributed.any_process(jax.process_index() == 1), distributed.any_process(False)],
                   "exchanged": [exchange.gather([jax.process_index(), k]) for k in range(3)] + [exchange.gather(
                       jax.process_index(), decide=lambda objs: [f"decided on {jax.process_index()}", objs])],
                   **_train(), "generated": _generate()}
        distributed.barrier("done")
    except BaseException:  # exit now: the runtime's shutdown barrier would wait minutes for the other worker
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    Path(sys.argv[1]).write_text(json.dumps(results))
