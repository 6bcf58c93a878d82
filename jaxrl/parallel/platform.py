"""Keep libtpu from probing for a TPU that is not there. With libtpu installed (the `test` extra, for
`jaxrl compile`), JAX's TPU backend loads it on any host when the backends start; on a machine without TPU
chips it prints "Failed to find host bounds for accelerator type ..." and "E0000 ... unexpected worker
hostname ..." (it asks GCE metadata for this host's place in a slice), and it takes libtpu's one-process
lock (/tmp/libtpu_lockfile). Standard library only: called before JAX is imported.

The TPU chips are found as JAX finds them (`jax._src.hardware_utils`): PCI devices of Google's vendor
id 0x1ae0 with a TPU device id.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}  # v3 ... TPU7x
_GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")  # NVIDIA, WSL2, AMD (KFD)


def tpu_chips() -> int:
    """TPU chips attached to this host through PCI (0 on a CPU or GPU machine)."""
    count = 0
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
                count += (Path(vendor).parent / "device").read_text().strip() in _TPU_PCI_DEVICES
        except OSError:
            continue
    return count


def skip_absent_tpu() -> None:
    """On a host with neither TPU chips nor a GPU, set `JAX_PLATFORMS=cpu` so that JAX never loads libtpu as
    a backend (the CPU backend is the one it would pick anyway). Nothing changes where `JAX_PLATFORMS` or
    `JAX_FORCE_TPU_INIT` is set, on a TPU VM, or where a GPU device file exists (JAX picks the GPU there).
    `jaxrl compile` still loads libtpu for its topologies (`tpu_compile_environment`). Call before JAX
    initialises its backends."""
    if "JAX_PLATFORMS" in os.environ or "JAX_FORCE_TPU_INIT" in os.environ:
        return
    if tpu_chips() == 0 and not any(os.path.exists(f) for f in _GPU_DEVICE_FILES):
        os.environ["JAX_PLATFORMS"] = "cpu"
        try:  # JAX already imported (a test session, an embedding program): its config read the variable then
            import sys

            if "jax" in sys.modules:
                sys.modules["jax"].config.update("jax_platforms", "cpu")
        except Exception:  # noqa: BLE001 - backends already started: then there is nothing left to skip
            pass


def tpu_compile_environment() -> None:
    """Before libtpu is loaded to describe a TPU topology on a host without TPU chips (`jaxrl compile`):
    say that this host is one host on its own (`TPU_HOST_BOUNDS=1,1,1`, `TPU_WORKER_HOSTNAMES=localhost`),
    which is true of a compiling machine, so that libtpu does not ask GCE metadata and print that it
    could not. The topology described is the one asked for either way (the devices, their coordinates
    and hosts are the same: checked for v4-32, v5p-64, v5litepod-8 and v6e-16). A variable already set wins;
    nothing is set on a TPU VM."""
    if tpu_chips() == 0:
        os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
