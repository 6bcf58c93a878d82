"""What the launchers share: shell quoting, the script runner, the source archive and the files a run
config needs on the remote host."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parents[2]
UV_INSTALL = "command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh"


class LaunchError(Exception):
    """A launch that cannot work as asked (a bad accelerator type, a config unfit for several hosts);
    the message says what to change."""


def sh(*argv: str) -> str:
    """One shell command line for `argv`, every word quoted as needed."""
    return shlex.join(argv)


def gcloud_flags(**flags: str | bool | None) -> list[str]:
    """`--name=value` words for the flags that are set (`True` gives a bare `--name`), `_` read as `-`."""
    out = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        out.append(flag if value is True else f"{flag}={value}")
    return out


def execute(lines: Sequence[str], dry_run: bool, out: TextIO | None = None) -> int:
    """Print the script made of `lines` (dry run) or run it with `bash -euo pipefail`; the exit status."""
    script = "\n".join(lines) + "\n"
    if dry_run:
        (out or sys.stdout).write(script)
        return 0
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], check=False).returncode


def archive_line(archive: str, ref: str = "HEAD", repo: Path = REPO) -> str:
    """Pack the committed tree at `ref` of the jaxrl checkout into a `.tar.gz` (uncommitted edits are
    not shipped: commit them first)."""
    return sh("git", "-C", str(repo), "archive", "--format=tar.gz", f"--output={archive}", ref)


def install_script(src_tar: str, prefix: str, extra: str) -> str:
    """Remote shell commands that install jaxrl (with `extra`, e.g. "tpu") and the environments shipped in
    `environments/` from the archive `src_tar` into the virtual environment `<prefix>/venv`, with uv
    (which also fetches Python 3.11 where the image has an older one)."""
    return "\n".join([
        "set -euo pipefail",
        'export PATH="$HOME/.local/bin:$PATH"',
        UV_INSTALL,
        f"rm -rf {prefix}/src && mkdir -p {prefix}/src && tar -xzf {src_tar} -C {prefix}/src",
        f"uv venv --allow-existing --python 3.11 {prefix}/venv",
        f'uv pip install --python {prefix}/venv/bin/python "{prefix}/src[{extra}]" {prefix}/src/environments/*/',
    ])


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """What a run config needs beside itself, read from the TOML with the standard library only.

    `env_files`: the `env_file` entries (relative to the config, as the config resolves them);
    `model_path`: `[jax].model_path` or else `model`; `checkpoint_dir`: `[jax].checkpoint_dir` (None when
    checkpoints go under `output_dir`); `mesh`: `[jax].mesh`.
    """

    config: Path
    env_files: tuple[str, ...]
    model_path: str
    checkpoint_dir: str | None
    mesh: dict[str, int]

    @classmethod
    def read(cls, config: str | Path) -> RunFiles:
        """Raises LaunchError: the file is missing, is not TOML, or has an absolute `env_file` path."""
        path = Path(config)
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise LaunchError(f"{path}: {exc}") from None
        jax = doc.get("jax", {})
        env_files = tuple(doc.get("env_file", []))
        if absolute := [p for p in env_files if Path(p).expanduser().is_absolute()]:
            raise LaunchError(f"{path}: env_file {absolute[0]!r} is absolute; make it relative to the config so "
                              "it can be copied next to it")
        return cls(path, env_files, jax.get("model_path") or doc.get("model", ""), jax.get("checkpoint_dir"),
                   dict(jax.get("mesh", {})))

    def check_multi_host(self, where: str) -> None:
        """Every process of a multi-host run writes its part of each checkpoint into one directory, so it
        must be shared storage.

        Raises:
            LaunchError: `[jax].checkpoint_dir` is not a `gs://` URL.
        """
        if not (self.checkpoint_dir or "").startswith("gs://"):
            raise LaunchError(f"{self.config}: {where} has several hosts; set [jax] checkpoint_dir to a gs:// URL "
                              "(every host writes its shards of each checkpoint there)")
