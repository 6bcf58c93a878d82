"""`scripts/device_check.py --smoke`: every kind of row the GPU check runs (train LoRA and full, decode over
the dense cache, the paged pool read by the gather and by the Pallas kernel (the GPU's Triton kernel, here in
interpret mode), attention, an RL run end to end with a shipped environment), each once at a tiny shape on
CPU, so the script a device session runs cannot rot while no device is at hand. No figure is judged (CPU
timings)."""

import json
import subprocess
import sys

from helpers import REPO, subprocess_env


def test_device_check_smoke_runs_every_kind_of_row(tmp_path):
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "device_check.py"), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=1800, env=subprocess_env(1))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())
    assert not [r for r in rows if "failed" in r or "skipped" in r], done.stdout + done.stderr
    kinds = {(r["section"], r.get("kind") or r.get("cache") or r.get("impl")) for r in rows[1:]}
    assert kinds == {("train", "lora r16"), ("train", "full"), ("decode", "dense"), ("decode", "paged"),
                     ("decode", "paged-kernel"), ("attention", "xla"), ("attention", "einsum"), ("rl", None)}
    assert {r["cache"]: r["kv"] for r in rows[1:] if r["section"] == "decode"} == \
        {"dense": "Dense", "paged": "Paged", "paged-kernel": "PagedTriton"}
    for r in rows[1:]:
        if r["section"] == "decode":
            assert r["tokens_per_s"] > 0 and r["hbm_share"] > 0 and r["bytes_per_step"] > 0
        elif r["section"] == "rl":
            assert len(r["steps"]) == 2
            s = r["summary"]
            assert s["time/rollout"] > 0 and s["time/train"] > 0 and 0 < s["generation_share"] < 1
        else:
            assert r["step_s"] > 0
