"""`python tpu/gcp_batch.py`: run `jaxrl run` as a GCP Batch job on one or more GPU hosts.

    submit  pack the committed jaxrl tree, upload it with the run config and its env files to a `gs://`
            staging folder, write the job request (`<name>.job.json`) and submit it
    status  describe the job;  logs  print its task logs from Cloud Logging;  delete  delete the job

The job has one task per host, all running at once (`parallelism` = `taskCount`). Each task mounts the
staging folder at `/mnt/disks/jaxrl` (Cloud Storage FUSE), installs `jaxrl[cuda]` with uv and runs
`jaxrl run` from the mounted `run/` folder, so metrics land in the bucket. Several hosts get a hosts file
(`requireHostsFile`); `jaxrl.parallel.distributed` reads it with `BATCH_TASK_INDEX` and `BATCH_TASK_COUNT` and
joins the hosts into one JAX run, coordinated by task 0 on port `JAXRL_COORDINATOR_PORT`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from jaxrl.launch.common import LaunchError, RunFiles, archive_line, execute, gcloud_flags, install_script, sh

MOUNT = "/mnt/disks/jaxrl"
PREFIX = "/opt/jaxrl"


@dataclasses.dataclass(frozen=True)
class GpuJob:
    """A Batch job of `hosts` identical GPU VMs.

    `name`: the job id (lowercase letters, digits and hyphens, starting with a letter, at most 63);
    `staging`: a `gs://bucket/folder` for the code, config and run folder; `machine_type` and
    `accelerator` x `gpus_per_host` must be a valid Compute Engine pairing (a3-highgpu-8g with 8
    nvidia-h100-80gb, a2-ultragpu-8g with 8 nvidia-a100-80gb, g2-standard-48 with 4 nvidia-l4, ...);
    `max_run_duration`: seconds before Batch stops the job.

    Raises:
        LaunchError: a malformed name, staging URL or count.
    """

    name: str
    region: str
    staging: str
    project: str | None = None
    machine_type: str = "a3-highgpu-8g"
    accelerator: str = "nvidia-h100-80gb"
    gpus_per_host: int = 8
    hosts: int = 1
    spot: bool = False
    boot_disk_gb: int = 200
    max_run_duration: int = 24 * 3600
    port: int = 8476

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", self.name):
            raise LaunchError(f"job name {self.name!r}: lowercase letters, digits and hyphens, starting with a "
                              "letter, at most 63 characters")
        if not re.fullmatch(r"gs://[a-z0-9][-_.a-z0-9]*[a-z0-9](/.*)?", self.staging):
            raise LaunchError(f"staging {self.staging!r} is not a gs://bucket[/folder] URL")
        if self.hosts < 1 or self.gpus_per_host < 1:
            raise LaunchError("hosts and gpus per host must be >= 1")

    @property
    def _staging(self) -> str:
        return self.staging.rstrip("/")

    def task_script(self, config_name: str) -> str:
        """What each task runs: install, then `jaxrl run` from the mounted run folder."""
        return "\n".join([
            "#!/bin/bash",  # Batch runs a script without one with /bin/sh
            ': "${HOME:=/root}"',
            install_script(f"{MOUNT}/jaxrl-src.tar.gz", PREFIX, "cuda"),
            f"cd {MOUNT}/run",
            f"exec {PREFIX}/venv/bin/jaxrl run {sh(config_name)}",
        ])

    def body(self, config_name: str) -> dict[str, Any]:
        """The `jobs.create` request body (Batch API v1 `Job`, JSON field names), as `gcloud batch jobs
        submit --config` reads it."""
        group: dict[str, Any] = {
            "taskCount": self.hosts,
            "parallelism": self.hosts,
            "taskCountPerNode": 1,
            "taskSpec": {
                "runnables": [{"script": {"text": self.task_script(config_name)}}],
                "volumes": [{"gcs": {"remotePath": self._staging.removeprefix("gs://")}, "mountPath": MOUNT}],
                "environment": {"variables": {"JAXRL_COORDINATOR_PORT": str(self.port)}},
                "maxRunDuration": f"{self.max_run_duration}s",
                "maxRetryCount": 0,
            },
        }
        if self.hosts > 1:
            group["requireHostsFile"] = True
        return {
            "taskGroups": [group],
            "allocationPolicy": {
                "instances": [{
                    "installGpuDrivers": True,
                    "policy": {
                        "machineType": self.machine_type,
                        "accelerators": [{"type": self.accelerator, "count": self.gpus_per_host}],
                        "provisioningModel": "SPOT" if self.spot else "STANDARD",
                        "bootDisk": {"sizeGb": self.boot_disk_gb},
                    },
                }],
                "location": {"allowedLocations": [f"regions/{self.region}"]},
            },
            "labels": {"app": "jaxrl"},
            "logsPolicy": {"destination": "CLOUD_LOGGING"},
        }

    def _where(self) -> list[str]:
        return gcloud_flags(location=self.region, project=self.project)

    def submit(self, run: RunFiles, ref: str = "HEAD") -> list[str]:
        """Upload code, config and env files, write `<name>.job.json` and submit it.

        Raises:
            LaunchError: several hosts but checkpoints not on `gs://`.
        """
        if self.hosts > 1:
            run.check_multi_host(f"a job of {self.hosts} hosts")
        archive = f"/tmp/jaxrl-src-{self.name}.tar.gz"
        job_file = f"{self.name}.job.json"
        lines = [archive_line(archive, ref),
                 sh("gcloud", "storage", "cp", archive, f"{self._staging}/jaxrl-src.tar.gz"),
                 sh("gcloud", "storage", "cp", str(run.config), f"{self._staging}/run/{run.config.name}")]
        lines += [sh("gcloud", "storage", "cp", str(run.config.parent / p), f"{self._staging}/run/{p}")
                  for p in run.env_files]
        lines += [f"cat > {sh(job_file)} <<'JOB'", json.dumps(self.body(run.config.name), indent=2), "JOB",
                  sh("gcloud", "batch", "jobs", "submit", self.name, *self._where(), f"--config={job_file}")]
        return lines

    def status(self) -> list[str]:
        return [sh("gcloud", "batch", "jobs", "describe", self.name, *self._where())]

    def logs(self) -> list[str]:
        """Task logs of the job, oldest first (Batch labels each entry with the job's uid)."""
        uid = sh("gcloud", "batch", "jobs", "describe", self.name, *self._where(), "--format=value(uid)")
        project = sh(self.project) if self.project else "$(gcloud config get-value project)"
        return [f"uid=$({uid})",
                f"project={project}",
                'gcloud logging read "logName=projects/$project/logs/batch_task_logs AND labels.job_uid=$uid" '
                + sh(*gcloud_flags(project=self.project), "--order=asc", "--format=value(textPayload)")]

    def delete(self) -> list[str]:
        return [sh("gcloud", "batch", "jobs", "delete", self.name, *self._where(), "--quiet")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gcp_batch.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["submit", "status", "logs", "delete"])
    p.add_argument("config", nargs="?", help="run config (TOML): needed by submit")
    p.add_argument("--name", required=True, help="job id")
    p.add_argument("--region", required=True, help="e.g. us-central1")
    p.add_argument("--staging", help="gs://bucket/folder for code, config and run folder (submit)")
    p.add_argument("--project", help="GCP project (default: gcloud's)")
    p.add_argument("--machine-type", default="a3-highgpu-8g")
    p.add_argument("--accelerator", default="nvidia-h100-80gb", help="GPU type")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--spot", action="store_true")
    p.add_argument("--boot-disk-gb", type=int, default=200)
    p.add_argument("--max-run-hours", type=float, default=24.0)
    p.add_argument("--ref", default="HEAD", help="git ref of the jaxrl tree to ship (default HEAD)")
    p.add_argument("--dry-run", action="store_true", help="print the script instead of running it")
    return p


def script(args: argparse.Namespace) -> list[str]:
    """The bash lines for one parsed command line. Raises LaunchError."""
    if args.command == "submit" and not (args.config and args.staging):
        raise LaunchError("submit needs the run config and --staging")
    job = GpuJob(args.name, args.region, args.staging or "gs://unused", args.project, args.machine_type,
                 args.accelerator, args.gpus_per_host, args.hosts, args.spot, args.boot_disk_gb,
                 round(args.max_run_hours * 3600))
    match args.command:
        case "submit":
            return job.submit(RunFiles.read(args.config), args.ref)
        case _:
            return getattr(job, args.command)()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        lines = script(args)
    except LaunchError as exc:
        print(f"gcp_batch.py: {exc}", file=sys.stderr)
        return 2
    return execute(["# " + sh("gcp_batch.py", *(argv if argv is not None else sys.argv[1:])), *lines], args.dry_run)

