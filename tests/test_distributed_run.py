"""`jaxrl run` multi-host, for real, on 2 processes x 4 emulated CPU devices joined on 127.0.0.1 through the
JAX_* variables: the tiny quickstart synchronously with one rollout engine spanning both processes, against
1 process x 8 devices, both checkpointing to the GCS emulator. (Generation overlapping training on 2 processes:
tests/test_distributed_async.py, a file of its own so that the two runs can go to two workers.)"""

import jax
import numpy as np
import pytest
from helpers import finish, read_metrics, reproducible, start, start_pair, write_run_config

from jaxrl.export import exporter
from jaxrl.model import hf

STEPS = 2


@pytest.mark.numerics
def test_two_processes_train_like_one(tmp_path, tiny_model_dir, gcs):
    """Same metrics every step (rewards exactly; losses to float rounding, the train step's reductions
    being split over other devices), [val]'s included, and the same LoRA in the last checkpoint, with one
    rollout engine over both processes' devices (`engine_hosts = 2`, stepped in lockstep). Only process 0
    writes metrics and prints progress. The three processes run at once to save wall time. No group is dropped
    as stale: one whose requests the group admitted before the slower process had handed over the step's
    weights would have sampled the old policy and been replaced by another example (`jaxrl.inference.lockstep`
    holds them; tests/test_distributed.py provokes the lag). Step 2 samples with policies that differ by the
    train step's rounding (logprobs of its 64 sampled tokens up to 2e-6 apart, their probabilities 3e-6 apart in
    all, in two runs): a flipped token, at odds of that order a run, would fail it."""
    url = "gs://jaxrl-test/distributed"
    runs = {}
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        runs[name] = write_run_config(tmp_path / name / "rl.toml", tiny_model_dir, name=name, max_steps=STEPS,
                                      tables="[buffer]\nskip_verification = true\n\n[val]\ninterval = 1\n"
                                             "num_examples = 3\nrollouts_per_example = 2",
                                      jax_extra=f'checkpoint_dir = "{url}"\nengine_hosts = {2 if name == "two" else 0}')
    procs = {"one": start(runs["one"], tmp_path / "one.log", devices=8)}
    procs |= {f"two-{pid}": proc for pid, proc in enumerate(start_pair(runs["two"], tmp_path, "two"))}
    try:
        logs = {name: finish(proc, tmp_path / f"{name}.log") for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for name, (code, out) in logs.items():
        assert code == 0, f"{name}:\n{out}"
    assert "mesh {'data': 1, 'fsdp': 8, 'tensor': 1, 'expert': 1}" in logs["two-0"][1]
    assert "rollout engine: one over 2 processes (engine_hosts = 2)" in logs["two-0"][1]
    assert f"step    {STEPS} " in logs["two-0"][1] and "step    1 " not in logs["two-1"][1]

    one = reproducible(read_metrics(tmp_path / "one" / "runs" / "one"))
    two = reproducible(read_metrics(tmp_path / "two" / "runs" / "two"))  # both processes share this folder
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for a, b in zip(two, one, strict=True):
        assert a.keys() == b.keys()
        assert a["async/stale_dropped"] == b["async/stale_dropped"] == 0, a["step"]
        for k in ("reward/mean", "reward/std", "seq_len", "rollouts/failed", "train/samples"):
            assert a[k] == b[k], (a["step"], k)
        assert a["train/samples"] == 8  # each group played once, by one of the two processes
        assert a["val/rollouts/failed"] == 0 and a["val/seq_len"] > 0  # [val]: 3 examples split 1 + 2, gathered
        for k, v in b.items():
            np.testing.assert_allclose(a[k], v, rtol=1e-5, atol=1e-6, err_msg=f"step {a['step']} {k}")

    model_cfg = hf.load_config(tiny_model_dir)
    loras = {}
    for name, cfg in runs.items():
        source = exporter.find_source(f"{url}/{name}", config=cfg)
        assert source.step == STEPS
        loras[name] = exporter.restore_lora(source, model_cfg)
    # Adam moves every element by up to about the learning rate (1e-2) a step, whatever its gradient's
    # size, so an element whose gradient is near zero carries the float differences far (seen: 1e-5).
    # A lost, doubled or misplaced group would move elements by the order of the learning rate.
    for a, b in zip(jax.tree.leaves(loras["two"]), jax.tree.leaves(loras["one"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)

