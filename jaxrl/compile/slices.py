"""TPU chips (published peaks) and slice names (as gcloud spells them) mapped to topologies.

A slice name is `<version>-<count>`: v4 and v5p count TensorCores (2 per chip), v5litepod (v5e) and v6e
count chips. The topology is the chips' ICI shape, as `jax.experimental.topologies.get_topology_desc`
takes it (`"v5p:4x4x4"`), and gives the slice's devices and hosts without a TPU attached (libtpu).
"""

from __future__ import annotations

import dataclasses
import math
import os

from jaxrl.parallel.platform import tpu_compile_environment

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip generation: peak bf16 FLOP/s, HBM bytes/s and HBM bytes per chip, as published."""

    name: str  # the topology prefix: "v4", "v5e", "v5p", "v6e"
    gcloud: str  # the accelerator-type prefix: "v4", "v5litepod", "v5p", "v6e"
    flops: float  # peak bf16 FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    hbm_bytes: int  # per chip
    cores_per_chip_in_name: int  # 2 where the slice name counts TensorCores
    source: str


# Google Cloud's TPU system architecture pages (read 2026-11-23). HBM sizes published as "GB" are
# taken as GiB, what the chips hold (v5e's 16 GB chip shows 16 GiB to XLA).
CHIPS = {
    c.name: c for c in (
        Chip("v4", "v4", 275e12, 1200e9, 32 * GIB, 2, "https://cloud.google.com/tpu/docs/v4: 275 TFLOPs bf16, "
             "HBM2 32 GiB, 1200 GBps"),
        Chip("v5e", "v5litepod", 197e12, 819e9, 16 * GIB, 1, "https://cloud.google.com/tpu/docs/v5e: 197 TFLOPs "
             "bf16, HBM2 16 GB, 819 GBps"),
        Chip("v5p", "v5p", 459e12, 2765e9, 95 * GIB, 2, "https://cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, "
             "HBM2e 95 GB, 2765 GBps"),
        Chip("v6e", "v6e", 918e12, 1638e9, 32 * GIB, 1, "https://cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, "
             "HBM 32 GB, 1638 GBps"),
    )
}

# chips -> ICI shape: 3D tori (v4, v5p) and 2D (v5e, v6e), the shapes Google's pages list per slice size
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
              512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: its chip, chip count and ICI shape; `name` as gcloud spells it."""

    chip: Chip
    chips: int
    shape: str

    @property
    def name(self) -> str:
        return f"{self.chip.gcloud}-{self.chips * self.chip.cores_per_chip_in_name}"

    @property
    def topology(self) -> str:
        """The name `get_topology_desc` takes, e.g. "v5p:4x4x4"."""
        return f"{self.chip.name}:{self.shape}"


def _shapes(chip: Chip) -> dict[int, str]:
    return _SHAPES_3D if chip.name in ("v4", "v5p") else _SHAPES_2D


def parse_slice(text: str) -> Slice:
    """A slice from a gcloud accelerator type (`v4-32`, `v5litepod-16`, `v5p-128`, `v6e-64`) or a topology
    (`v5p:4x4x4`, `v6e:8x8`).

    Raises:
        ValueError: an unknown chip, a count gcloud does not offer, or a malformed name (the message lists
            the valid names).
    """
    if ":" in text:
        prefix, shape = text.split(":", 1)
        chip = CHIPS.get(prefix)
        dims = shape.split("x")
        if chip is None or not all(d.isdigit() for d in dims) or len(dims) != (3 if prefix in ("v4", "v5p") else 2):
            raise ValueError(f"topology {text!r}: expected e.g. v5p:4x4x4 or v6e:8x8 ({', '.join(CHIPS)})")
        return Slice(chip, math.prod(int(d) for d in dims), shape)
    prefix, _, count = text.rpartition("-")
    chip = next((c for c in CHIPS.values() if c.gcloud == prefix), None)
    if chip is None or not count.isdigit() or int(count) % chip.cores_per_chip_in_name:
        raise ValueError(f"slice {text!r}: expected one of {slice_names()}")
    chips = int(count) // chip.cores_per_chip_in_name
    if chips not in _shapes(chip):
        raise ValueError(f"slice {text!r}: expected one of {slice_names()}")
    return Slice(chip, chips, _shapes(chip)[chips])


def slice_names() -> str:
    """Every slice name `parse_slice` knows, one line per chip (for `--help` and errors)."""
    lines = []
    for chip in CHIPS.values():
        names = [f"{chip.gcloud}-{n * chip.cores_per_chip_in_name}" for n in _shapes(chip)]
        lines.append(f"{', '.join(names)}")
    return "; ".join(lines)


def _host_layout(s: Slice) -> dict:
    """What libtpu's default description gets wrong about a slice's devices and hosts: v4 runs its two
    TensorCores per chip as one device (megacore; libtpu's default lists a device per core), and an
    8-chip v5e or v6e slice is one host of 8 chips (ct5lp-hightpu-8t, ct6e-standard-8t; libtpu's default
    is 2 hosts of 4, the hosts of the larger slices)."""
    if s.chip.name == "v4":
        return {"chip_config_name": "megacore"}
    if s.chip.name in ("v5e", "v6e") and s.chips == 8:
        return {"chips_per_host_bounds": (2, 4, 1)}
    return {}


def topology_devices(s: Slice) -> list:
    """The slice's TPU devices (process-major, as `jax.devices()` lists them on the slice), from libtpu's
    topology description; no TPU needed.

    Raises:
        RuntimeError: libtpu is not installed (`pip install "jax[tpu]==<jax's version>"`).
    """
    from jax.experimental import topologies

    # Compiling touches no chip, so this need not hold libtpu's one-process lock (/tmp/libtpu_lockfile),
    # which would stop a second compile, or a test session beside a run, from starting.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    tpu_compile_environment()
    try:
        desc = topologies.get_topology_desc(topology_name=s.topology, platform="tpu", **_host_layout(s))
    except Exception as exc:  # noqa: BLE001 - libtpu missing or refusing the shape: both end here
        raise RuntimeError(f"cannot describe TPU topology {s.topology} ({type(exc).__name__}: {exc}); "
                           f"is libtpu installed? pip install \"jax[tpu]==<jax's version>\"") from None
    return sorted(desc.devices, key=lambda d: (d.process_index, d.id))
