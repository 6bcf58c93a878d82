"""`python tpu/tpu_vm.py`: run `jaxrl run` on a Cloud TPU VM or pod slice, through `gcloud`.

    create   make the TPU VM (`tpu-vm create`) or queue it (`queued-resources create`, then wait for ACTIVE)
    install  ship the committed jaxrl tree to every worker and install it with uv (`jaxrl[tpu]`)
    copy     put the run config, its env files and (optionally) the model folder on every worker
    launch   start `jaxrl run` on every worker in the background (the same command everywhere: JAX finds
             the other workers through the TPU metadata server)
    logs     follow a worker's log;  stop  SIGTERM the run on every worker (jaxrl checkpoints and exits)
    delete   delete the TPU VM or the queued resource with its VM;  status  describe it
    up       create, install, copy and launch

Remote layout (home directory of the ssh user on each worker): `jaxrl/src` (the code), `jaxrl/venv`,
`jaxrl-run/` (the config, env files, `jaxrl.log`, `jaxrl.pid`; relative paths in the config resolve here).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxrl.launch.common import LaunchError, RunFiles, archive_line, execute, gcloud_flags, install_script, sh

PREFIX = "$HOME/jaxrl"
RUN_DIR = "jaxrl-run"  # relative to the remote home, as `tpu-vm scp` destinations are


@dataclasses.dataclass(frozen=True)
class Generation:
    """One Cloud TPU generation: how its accelerator-type suffix counts chips, chips per host, HBM per
    chip (GiB), peak bf16 TFLOP/s per chip, and the default TPU VM software version."""

    prefix: str
    cores_per_chip: int
    chips_per_host: int
    hbm_gib: float
    bf16_tflops: float
    runtime_version: str


# The accelerator-type suffix counts TensorCores on v4 and v5p (2 per chip) and chips on v5e and v6e.
GENERATIONS = {g.prefix: g for g in (
    Generation("v4", 2, 4, 32, 275, "tpu-ubuntu2204-base"),
    Generation("v5p", 2, 4, 95, 459, "v2-alpha-tpuv5"),
    Generation("v5litepod", 1, 8, 16, 197, "v2-alpha-tpuv5-lite"),
    Generation("v6e", 1, 8, 32, 918, "v2-alpha-tpuv6e"),
)}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU VM (one host) or pod slice (several) and how to obtain it.

    `accelerator_type`: e.g. "v5litepod-8", "v5p-64", "v6e-16"; `runtime_version`: the TPU VM image,
    default that of the generation; `queued`: request it as a queued resource (waits for capacity)
    instead of creating it at once; `spot`: preemptible capacity; `valid_until`: how long a queued request
    may wait, e.g. "6h".

    Raises:
        LaunchError: an accelerator type of an unknown generation or chip count.
    """

    name: str
    zone: str
    accelerator_type: str
    project: str | None = None
    runtime_version: str | None = None
    queued: bool = False
    spot: bool = False
    valid_until: str | None = None

    def __post_init__(self) -> None:
        m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", self.accelerator_type)
        if not m or m[1] not in GENERATIONS:
            raise LaunchError(f"accelerator type {self.accelerator_type!r}: expected <generation>-<size> with a "
                              f"generation in {sorted(GENERATIONS)}")
        if int(m[2]) % self.generation.cores_per_chip:
            raise LaunchError(f"accelerator type {self.accelerator_type!r}: the size counts TensorCores, "
                              f"{self.generation.cores_per_chip} per chip")

    @property
    def generation(self) -> Generation:
        return GENERATIONS[self.accelerator_type.rsplit("-", 1)[0]]

    @property
    def chips(self) -> int:
        return int(self.accelerator_type.rsplit("-", 1)[1]) // self.generation.cores_per_chip

    @property
    def multi_host(self) -> bool:
        """More chips than one host holds: a pod slice with one JAX process per worker."""
        return self.chips > self.generation.chips_per_host

    def _where(self) -> list[str]:
        return gcloud_flags(zone=self.zone, project=self.project)

    def _ssh(self, command: str, worker: str = "all") -> str:
        return sh("gcloud", "compute", "tpus", "tpu-vm", "ssh", self.name, *self._where(), f"--worker={worker}",
                  f"--command={command}")

    def _scp(self, local: str, remote: str, recurse: bool = False) -> str:
        return sh("gcloud", "compute", "tpus", "tpu-vm", "scp", *(["--recurse"] if recurse else []), local,
                  f"{self.name}:{remote}", *self._where(), "--worker=all")

    def create(self) -> list[str]:
        """Make the VM(s); a queued request is then polled until ACTIVE (FAILED or SUSPENDED end the script)."""
        version = self.runtime_version or self.generation.runtime_version
        if not self.queued:
            return [sh("gcloud", "compute", "tpus", "tpu-vm", "create", self.name, *self._where(),
                       f"--accelerator-type={self.accelerator_type}", f"--version={version}",
                       *gcloud_flags(spot=self.spot))]
        describe = sh("gcloud", "compute", "tpus", "queued-resources", "describe", self.name, *self._where(),
                      "--format=value(state.state)")
        return [
            sh("gcloud", "compute", "tpus", "queued-resources", "create", self.name, f"--node-id={self.name}",
               *self._where(), f"--accelerator-type={self.accelerator_type}", f"--runtime-version={version}",
               *gcloud_flags(spot=self.spot, valid_until_duration=self.valid_until)),
            "while true; do",
            f"  state=$({describe})",
            f'  echo "queued resource {self.name}: $state"',
            '  case "$state" in ACTIVE) break ;; FAILED|SUSPENDED) exit 1 ;; esac',
            "  sleep 30",
            "done",
        ]

    def install(self, ref: str = "HEAD") -> list[str]:
        """Ship the committed tree at `ref` to every worker and install `jaxrl[tpu]` and the shipped
        environments there."""
        archive = f"/tmp/jaxrl-src-{self.name}.tar.gz"
        return [archive_line(archive, ref), self._scp(archive, "jaxrl-src.tar.gz"),
                self._ssh(install_script("$HOME/jaxrl-src.tar.gz", PREFIX, "tpu"))]

    def copy(self, run: RunFiles, model: str | None = None) -> list[str]:
        """Put the config and its env files in `~/jaxrl-run/` on every worker (same relative layout), and
        the model folder `model` (a local folder or a `gs://` URL) where the config's `model_path` points.

        Raises:
            LaunchError: a multi-host slice whose checkpoints would not go to `gs://`, or a `model` to
                stage but a `gs://` or absolute `model_path` to put it at.
        """
        if self.multi_host:
            run.check_multi_host(f"accelerator type {self.accelerator_type}")
        dirs = sorted({str(Path(RUN_DIR, p).parent) for p in run.env_files} | {RUN_DIR})
        lines = [self._ssh(sh("mkdir", "-p", *dirs)), self._scp(str(run.config), f"{RUN_DIR}/{run.config.name}")]
        lines += [self._scp(str(run.config.parent / p), f"{RUN_DIR}/{p}") for p in run.env_files]
        if model:
            dest = run.model_path
            if dest.startswith("gs://") or Path(dest).is_absolute() or not dest:
                raise LaunchError(f"{run.config}: to stage --model, set [jax] model_path to a folder relative to "
                                  f"the config (e.g. \"models/name\"), not {dest!r}")
            dest = os.path.normpath(Path(RUN_DIR, dest))
            if model.startswith("gs://"):
                lines.append(self._ssh(sh("mkdir", "-p", dest) + " && " +
                                       sh("gcloud", "storage", "rsync", "--recursive", model, dest)))
            else:
                lines += [self._ssh(sh("mkdir", "-p", str(Path(dest).parent))),
                          self._scp(model.rstrip("/"), dest, recurse=True)]
        return lines

    def launch(self, config_name: str, env: Sequence[str] = ()) -> list[str]:
        """Start `jaxrl run <config>` on every worker, detached (setsid, so `stop` can signal its whole
        process group), logging to `~/jaxrl-run/jaxrl.log`. `env`: extra `KEY=VALUE` settings."""
        run = " ".join([*env, "setsid", "nohup", f"{PREFIX}/venv/bin/jaxrl", "run", sh(config_name)])
        return [self._ssh(f"cd {RUN_DIR} && {{ {run} > jaxrl.log 2>&1 < /dev/null & "
                          "echo $! > jaxrl.pid; }")]

    def logs(self, worker: str = "0") -> list[str]:
        """Follow the log of `worker` ("all": every worker, interleaved)."""
        return [self._ssh(f"tail -n +1 -F {RUN_DIR}/jaxrl.log", worker)]

    def stop(self) -> list[str]:
        """SIGTERM the run's process group on every worker: jaxrl saves a checkpoint and exits."""
        return [self._ssh(f"kill -TERM -- -$(cat {RUN_DIR}/jaxrl.pid)")]

    def status(self) -> list[str]:
        kind = ["queued-resources"] if self.queued else ["tpu-vm"]
        return [sh("gcloud", "compute", "tpus", *kind, "describe", self.name, *self._where())]

    def delete(self) -> list[str]:
        """Delete the VM(s); a queued resource is deleted with its VM (`--force`)."""
        if self.queued:
            return [sh("gcloud", "compute", "tpus", "queued-resources", "delete", self.name, *self._where(),
                       "--force", "--quiet")]
        return [sh("gcloud", "compute", "tpus", "tpu-vm", "delete", self.name, *self._where(), "--quiet")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpu_vm.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["create", "install", "copy", "launch", "logs", "stop", "status", "delete",
                                       "up"])
    p.add_argument("config", nargs="?", help="run config (TOML): needed by copy, launch and up")
    p.add_argument("--name", required=True, help="TPU VM (and queued resource) name")
    p.add_argument("--zone", required=True, help="e.g. us-east5-b, europe-west4-a")
    p.add_argument("--accelerator-type", default="v5litepod-8", help="e.g. v5litepod-8, v5p-64, v6e-16")
    p.add_argument("--project", help="GCP project (default: gcloud's)")
    p.add_argument("--runtime-version", help="TPU VM image (default: the generation's)")
    p.add_argument("--queued", action="store_true", help="request a queued resource and wait for it")
    p.add_argument("--spot", action="store_true", help="spot (preemptible) capacity")
    p.add_argument("--valid-until", help="queued: give up waiting after this long, e.g. 6h")
    p.add_argument("--ref", default="HEAD", help="git ref of the jaxrl tree to install (default HEAD)")
    p.add_argument("--model", help="stage this model folder (local or gs://) at the config's model_path")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra variable for jaxrl run")
    p.add_argument("--worker", default="0", help="logs: worker number, or all")
    p.add_argument("--dry-run", action="store_true", help="print the script instead of running it")
    return p


def script(args: argparse.Namespace) -> list[str]:
    """The bash lines for one parsed command line. Raises LaunchError."""
    tpu = Slice(args.name, args.zone, args.accelerator_type, args.project, args.runtime_version, args.queued,
                args.spot, args.valid_until)
    if args.command in ("copy", "launch", "up") and not args.config:
        raise LaunchError(f"{args.command} needs the run config")
    if bad := [e for e in args.env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", e)]:
        raise LaunchError(f"--env {bad[0]!r} is not KEY=VALUE")
    env = [sh(e) for e in args.env]
    match args.command:
        case "create" | "status" | "delete" | "stop":
            return getattr(tpu, args.command)()
        case "install":
            return tpu.install(args.ref)
        case "copy":
            return tpu.copy(RunFiles.read(args.config), args.model)
        case "launch":
            return tpu.launch(Path(args.config).name, env)
        case "logs":
            return tpu.logs(args.worker)
        case _:  # up
            run = RunFiles.read(args.config)
            return [*tpu.create(), *tpu.install(args.ref), *tpu.copy(run, args.model),
                    *tpu.launch(run.config.name, env)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        lines = script(args)
    except LaunchError as exc:
        print(f"tpu_vm.py: {exc}", file=sys.stderr)
        return 2
    return execute(["# " + sh("tpu_vm.py", *(argv if argv is not None else sys.argv[1:])), *lines], args.dry_run)
