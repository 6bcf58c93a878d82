"""The Cloud launchers, through their dry-run output: the exact gcloud commands of a TPU VM, a queued pod
slice and a GCP Batch job; every printed script is valid bash, and the Batch job JSON builds the real
`google.cloud.batch_v1` request."""

from __future__ import annotations

import dataclasses
import io
import json
import shlex
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from jaxrl.launch import batch, tpu
from jaxrl.launch.common import LaunchError, RunFiles, execute

REPO = Path(__file__).resolve().parents[1]


def _config(tmp_path: Path, checkpoint_dir: str | None = "gs://bkt/ckpt") -> Path:
    (tmp_path / "secrets").mkdir(exist_ok=True)
    (tmp_path / "secrets" / "wandb.env").write_text("WANDB_API_KEY=x\n")
    ckpt = f'checkpoint_dir = "{checkpoint_dir}"' if checkpoint_dir else ""
    path = tmp_path / "moe.toml"
    path.write_text(f"""
model = "Qwen/Qwen3-30B-A3B"
max_steps = 10
batch_size = 64
rollouts_per_example = 8
env_file = ["secrets/wandb.env"]

[[env]]
id = "jaxrl/lowercase"

[jax]
model_path = "models/Qwen3-30B-A3B"
{ckpt}
mesh = {{ data = 1, fsdp = 4, tensor = 1, expert = 4 }}
""")
    return path


def _dry_run(main, *argv: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()


def _assert_bash(script: str) -> None:
    """`script` parses as bash, and so does every remote command passed with --command=."""
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    for line in script.splitlines():
        if "gcloud compute tpus tpu-vm ssh" in line:
            words = shlex.split(script[script.index(line):].split("\ngcloud ")[0])
            remote = next(w for w in words if w.startswith("--command="))
            subprocess.run(["bash", "-n"], input=remote.removeprefix("--command="), text=True, check=True)


@pytest.mark.parametrize(("accel", "chips", "multi"), [
    ("v4-8", 4, False), ("v4-16", 8, True), ("v5p-8", 4, False), ("v5p-64", 32, True),
    ("v5litepod-8", 8, False), ("v5litepod-16", 16, True), ("v6e-8", 8, False), ("v6e-64", 64, True),
])
def test_slice_sizes(accel, chips, multi):
    s = tpu.Slice("n", "z", accel)
    assert (s.chips, s.multi_host) == (chips, multi)


@pytest.mark.parametrize("accel", ["v3-8", "v5e-8", "v5p-7", "v6e"])
def test_slice_rejects_unknown_types(accel):
    with pytest.raises(LaunchError, match="accelerator type"):
        tpu.Slice("n", "z", accel)


def test_single_host_tpu_vm_commands(tmp_path):
    s = tpu.Slice("rl-dev", "us-east5-b", "v5litepod-8", project="my-proj")
    where = "--zone=us-east5-b --project=my-proj"
    assert s.create() == [f"gcloud compute tpus tpu-vm create rl-dev {where} --accelerator-type=v5litepod-8 "
                          "--version=v2-alpha-tpuv5-lite"]
    archive, scp, install = s.install("v0.1")
    assert archive == f"git -C {REPO} archive --format=tar.gz --output=/tmp/jaxrl-src-rl-dev.tar.gz v0.1"
    assert scp == f"gcloud compute tpus tpu-vm scp /tmp/jaxrl-src-rl-dev.tar.gz rl-dev:jaxrl-src.tar.gz {where} " \
                  "--worker=all"
    assert install.startswith(f"gcloud compute tpus tpu-vm ssh rl-dev {where} --worker=all '--command=set -euo")
    assert 'uv pip install --python $HOME/jaxrl/venv/bin/python "$HOME/jaxrl/src[tpu]" ' \
           "$HOME/jaxrl/src/environments/*/" in install
    assert s.launch("moe.toml", ["WANDB_MODE=offline"]) == [
        f"gcloud compute tpus tpu-vm ssh rl-dev {where} --worker=all '--command=cd jaxrl-run && "
        "{ WANDB_MODE=offline setsid nohup $HOME/jaxrl/venv/bin/jaxrl run moe.toml > jaxrl.log 2>&1 < /dev/null & "
        "echo $! > jaxrl.pid; }'"]
    assert s.logs() == [f"gcloud compute tpus tpu-vm ssh rl-dev {where} --worker=0 "
                        "'--command=tail -n +1 -F jaxrl-run/jaxrl.log'"]
    assert s.stop() == [f"gcloud compute tpus tpu-vm ssh rl-dev {where} --worker=all "
                        "'--command=kill -TERM -- -$(cat jaxrl-run/jaxrl.pid)'"]
    assert s.status() == [f"gcloud compute tpus tpu-vm describe rl-dev {where}"]
    assert s.delete() == [f"gcloud compute tpus tpu-vm delete rl-dev {where} --quiet"]
    # one host: checkpoints may stay on the VM's disk
    assert len(s.copy(RunFiles.read(_config(tmp_path, checkpoint_dir=None)))) == 3


def test_queued_pod_slice_commands(tmp_path):
    s = tpu.Slice("rl-pod", "us-east5-a", "v5p-64", queued=True, spot=True, valid_until="6h")
    assert s.multi_host and s.chips == 32
    create = s.create()
    assert create[0] == ("gcloud compute tpus queued-resources create rl-pod --node-id=rl-pod --zone=us-east5-a "
                         "--accelerator-type=v5p-64 --runtime-version=v2-alpha-tpuv5 --spot "
                         "--valid-until-duration=6h")
    assert create[2] == ("  state=$(gcloud compute tpus queued-resources describe rl-pod --zone=us-east5-a "
                         "'--format=value(state.state)')")
    assert s.delete() == ["gcloud compute tpus queued-resources delete rl-pod --zone=us-east5-a --force --quiet"]
    assert s.status() == ["gcloud compute tpus queued-resources describe rl-pod --zone=us-east5-a"]

    with pytest.raises(LaunchError, match="checkpoint_dir to a gs:// URL"):
        s.copy(RunFiles.read(_config(tmp_path, checkpoint_dir=None)))
    cfg = _config(tmp_path)
    lines = s.copy(RunFiles.read(cfg), model="gs://bkt/models/Qwen3-30B-A3B")
    ssh = "gcloud compute tpus tpu-vm ssh rl-pod --zone=us-east5-a --worker=all"
    scp_tail = "--zone=us-east5-a --worker=all"
    assert lines == [
        f"{ssh} '--command=mkdir -p jaxrl-run jaxrl-run/secrets'",
        f"gcloud compute tpus tpu-vm scp {cfg} rl-pod:jaxrl-run/moe.toml {scp_tail}",
        f"gcloud compute tpus tpu-vm scp {tmp_path}/secrets/wandb.env rl-pod:jaxrl-run/secrets/wandb.env {scp_tail}",
        f"{ssh} '--command=mkdir -p jaxrl-run/models/Qwen3-30B-A3B && gcloud storage rsync --recursive "
        "gs://bkt/models/Qwen3-30B-A3B jaxrl-run/models/Qwen3-30B-A3B'",
    ]
    local = s.copy(RunFiles.read(cfg), model=str(tmp_path / "weights/"))
    assert local[-1] == (f"gcloud compute tpus tpu-vm scp --recurse {tmp_path}/weights "
                         f"rl-pod:jaxrl-run/models/Qwen3-30B-A3B {scp_tail}")


def test_model_staging_needs_a_relative_model_path(tmp_path):
    cfg = _config(tmp_path)
    cfg.write_text(cfg.read_text().replace('"models/Qwen3-30B-A3B"', '"gs://bkt/models/q"'))
    with pytest.raises(LaunchError, match="model_path to a folder relative"):
        tpu.Slice("n", "z", "v6e-8").copy(RunFiles.read(cfg), model="gs://bkt/models/q")


def test_tpu_up_dry_run_is_one_valid_bash_script(tmp_path):
    cfg = _config(tmp_path)
    script = _dry_run(tpu.main, "up", str(cfg), "--name", "rl-pod", "--zone", "us-east5-a", "--accelerator-type",
                      "v6e-64", "--queued", "--model", "gs://bkt/m", "--env", "WANDB_MODE=offline", "--dry-run")
    _assert_bash(script)
    lines = script.splitlines()
    assert lines[0].startswith("# tpu_vm.py up ")
    order = ["queued-resources create", "archive", "tpu-vm scp /tmp/jaxrl-src", "uv venv", "run moe.toml"]
    positions = [next(i for i, line in enumerate(lines) if key in line) for key in order]
    assert positions == sorted(positions)
    assert "--runtime-version=v2-alpha-tpuv6e" in script


def test_tpu_cli_errors(tmp_path, capsys):
    assert tpu.main(["copy", "--name", "n", "--zone", "z", "--dry-run"]) == 2
    assert "copy needs the run config" in capsys.readouterr().err
    cfg = _config(tmp_path, checkpoint_dir=None)
    assert tpu.main(["up", str(cfg), "--name", "n", "--zone", "z", "--accelerator-type", "v5litepod-32",
                     "--dry-run"]) == 2
    assert "set [jax] checkpoint_dir to a gs:// URL" in capsys.readouterr().err
    assert tpu.main(["launch", str(cfg), "--name", "n", "--zone", "z", "--env", "1X=2", "--dry-run"]) == 2
    assert "is not KEY=VALUE" in capsys.readouterr().err
    cfg.write_text(cfg.read_text().replace('"secrets/wandb.env"', '"/etc/wandb.env"'))
    with pytest.raises(LaunchError, match="absolute"):
        RunFiles.read(cfg)


def test_thin_scripts_run_without_jaxrl_installed(tmp_path):
    """`python tpu/*.py` works with the standard library only: the launcher never imports JAX."""
    for script, args in (("tpu_vm.py", ["delete", "--name", "n", "--zone", "z"]),
                         ("gcp_batch.py", ["delete", "--name", "n", "--region", "r"])):
        out = subprocess.run([sys.executable, "-S", "-c",
                              "import runpy, sys; sys.argv = sys.argv[1:]; "
                              "runpy.run_path(sys.argv[0], run_name='__main__')",
                              str(REPO / "tpu" / script), *args, "--dry-run"],
                             capture_output=True, text=True, cwd=tmp_path, check=False)
        assert out.returncode == 0, out.stderr
        assert "delete n" in out.stdout


def test_batch_job_body_builds_the_real_request(tmp_path):
    batch_v1 = pytest.importorskip("google.cloud.batch_v1")
    job = batch.GpuJob("rl-gpu", "us-central1", "gs://bkt/jaxrl/rl-gpu/", project="my-proj", hosts=2, spot=True)
    body = job.body("moe.toml")
    request = batch_v1.CreateJobRequest(parent="projects/my-proj/locations/us-central1", job_id=job.name,
                                        job=batch_v1.Job.from_json(json.dumps(body)))  # unknown fields raise
    group = request.job.task_groups[0]
    assert (group.task_count, group.parallelism, group.require_hosts_file) == (2, 2, True)
    assert group.task_spec.volumes[0].gcs.remote_path == "bkt/jaxrl/rl-gpu"
    assert group.task_spec.environment.variables["JAXRL_COORDINATOR_PORT"] == "8476"
    policy = request.job.allocation_policy.instances[0]
    assert policy.install_gpu_drivers and policy.policy.machine_type == "a3-highgpu-8g"
    assert (policy.policy.accelerators[0].type_, policy.policy.accelerators[0].count) == ("nvidia-h100-80gb", 8)
    assert policy.policy.provisioning_model == batch_v1.AllocationPolicy.ProvisioningModel.SPOT
    assert request.job.logs_policy.destination == batch_v1.LogsPolicy.Destination.CLOUD_LOGGING
    text = group.task_spec.runnables[0].script.text
    assert text.startswith("#!/bin/bash\n") and text.endswith("exec /opt/jaxrl/venv/bin/jaxrl run moe.toml")
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    assert "requireHostsFile" not in batch.GpuJob("one", "r", "gs://bkt").body("c.toml")["taskGroups"][0]


def test_batch_submit_dry_run(tmp_path):
    cfg = _config(tmp_path)
    script = _dry_run(batch.main, "submit", str(cfg), "--name", "rl-gpu", "--region", "us-central1", "--staging",
                      "gs://bkt/stage", "--hosts", "2", "--machine-type", "g2-standard-48", "--accelerator",
                      "nvidia-l4", "--gpus-per-host", "4", "--dry-run")
    _assert_bash(script)
    lines = script.splitlines()
    assert lines[1:5] == [
        f"git -C {REPO} archive --format=tar.gz --output=/tmp/jaxrl-src-rl-gpu.tar.gz HEAD",
        "gcloud storage cp /tmp/jaxrl-src-rl-gpu.tar.gz gs://bkt/stage/jaxrl-src.tar.gz",
        f"gcloud storage cp {cfg} gs://bkt/stage/run/moe.toml",
        f"gcloud storage cp {tmp_path}/secrets/wandb.env gs://bkt/stage/run/secrets/wandb.env",
    ]
    assert lines[-1] == "gcloud batch jobs submit rl-gpu --location=us-central1 --config=rl-gpu.job.json"
    body = json.loads("\n".join(lines[lines.index("cat > rl-gpu.job.json <<'JOB'") + 1:lines.index("JOB")]))
    expected = batch.GpuJob("rl-gpu", "us-central1", "gs://bkt/stage", machine_type="g2-standard-48",
                            accelerator="nvidia-l4", gpus_per_host=4, hosts=2).body("moe.toml")
    assert body == expected


def test_batch_other_commands_and_errors(tmp_path, capsys):
    job = batch.GpuJob("rl-gpu", "us-central1", "gs://bkt", project="p")
    assert job.status() == ["gcloud batch jobs describe rl-gpu --location=us-central1 --project=p"]
    assert job.delete() == ["gcloud batch jobs delete rl-gpu --location=us-central1 --project=p --quiet"]
    logs = job.logs()
    assert logs[0] == "uid=$(gcloud batch jobs describe rl-gpu --location=us-central1 --project=p " \
                      "'--format=value(uid)')"
    assert logs[2] == ('gcloud logging read "logName=projects/$project/logs/batch_task_logs AND '
                       'labels.job_uid=$uid" --project=p --order=asc \'--format=value(textPayload)\'')
    _assert_bash("\n".join(logs))
    with pytest.raises(LaunchError, match="checkpoint_dir to a gs:// URL"):
        batch.GpuJob("x", "r", "gs://bkt", hosts=2).submit(RunFiles.read(_config(tmp_path, checkpoint_dir=None)))
    for bad in ({"name": "Bad_Name"}, {"staging": "/local"}, {"hosts": 0}):
        with pytest.raises(LaunchError):
            batch.GpuJob(**({"name": "ok", "region": "r", "staging": "gs://bkt"} | bad))
    assert batch.main(["submit", "--name", "x", "--region", "r", "--dry-run"]) == 2
    assert "submit needs the run config and --staging" in capsys.readouterr().err


def test_execute_runs_the_script_with_bash(tmp_path):
    assert execute([f"echo ok > {tmp_path}/out", "x=$(cat " + f"{tmp_path}/out)", '[ "$x" = ok ]'], False) == 0
    assert execute(["false", f"touch {tmp_path}/never"], False) != 0  # -e: the first failure stops it
    assert not (tmp_path / "never").exists()


def test_memory_arithmetic():
    from jaxrl.launch import memory as mem

    for arch, total, active in ((mem.QWEN3_4B, 4.02e9, 4.02e9), (mem.QWEN3_30B_A3B, 30.53e9, 3.35e9),
                                (mem.QWEN3_235B_A22B, 235.09e9, 22.19e9), (mem.INTELLECT_3, 106.85e9, 13.42e9)):
        got = mem.param_count(arch)
        assert got == pytest.approx((total, active), rel=2e-3), arch.name
    b = mem.per_chip(mem.QWEN3_30B_A3B, mem.Mesh(fsdp=2, expert=8), decode_slots=256, seq_len=4096, train_seqs=256)
    # KV: 2 x 48 layers x 256 slots x 4096 positions x 4 heads x 128 x 2 bytes, slots over the 16 chips
    assert b.kv_cache == 2 * 48 * 256 * 4096 * 4 * 128 * 2 / 16 / 2**30 == 6.0
    # one micro-batch: a 4096-token sequence per batch shard
    assert b.activations == 48 * 4096 * 2048 * 2 / 2**30 == 0.75
    dense = mem.per_chip(mem.QWEN3_4B, mem.Mesh(fsdp=8))
    assert dense.weights == pytest.approx(4.02e9 * 2 / 8 / 2**30, rel=2e-3)
    # K=4 kv heads do not split 8 ways: the cache is replicated over tensor then
    t8 = mem.per_chip(mem.QWEN3_30B_A3B, mem.Mesh(tensor=8, expert=2))
    t4 = mem.per_chip(mem.QWEN3_30B_A3B, mem.Mesh(tensor=4, expert=2))
    assert t8.kv_cache == 4 * t4.kv_cache
    assert "| Qwen3-30B-A3B | v5litepod-32 | 32 | 1, 4, 1, 8 | 256 x 256 |" in mem.table()


def test_per_chip_reads_a_model_config_and_scales_its_terms():
    """The table's Qwen3-235B-A22B is the catalogue's (`Arch.of` a ModelConfig); a micro-batch's activations
    scale with its sequences per batch shard; full fine-tuning keeps float32 master weights and 16 bytes
    of state per weight."""
    from jaxrl.launch import memory as mem
    from jaxrl.model import catalog
    from jaxrl.model.config import ModelConfig

    model = ModelConfig.from_hf(catalog.HOSTED_MODELS["Qwen/Qwen3-235B-A22B-Instruct-2507"])
    assert mem.Arch.of(model) == dataclasses.replace(mem.QWEN3_235B_A22B, name="")
    glm = ModelConfig.from_hf(catalog.HOSTED_MODELS["PrimeIntellect/INTELLECT-3"])  # a dense layer, a shared expert
    assert mem.Arch.of(glm) == dataclasses.replace(mem.INTELLECT_3, name="")
    mesh = {"fsdp": 2, "tensor": 2, "expert": 8}
    b = mem.per_chip(mem.QWEN3_235B_A22B, mem.Mesh(**mesh), seq_len=4096, train_seqs=256)
    # a micro-batch of 64 sequences keeps 64 / 16 per batch shard where the default keeps one
    assert mem.per_chip(mem.QWEN3_235B_A22B, mem.Mesh(**mesh), micro_seqs=64).activations == 4 * b.activations
    full = mem.per_chip(mem.QWEN3_235B_A22B, mem.Mesh(**mesh), full=True)
    assert (full.weights, full.lora) == (2 * b.weights, 8 * b.weights)
