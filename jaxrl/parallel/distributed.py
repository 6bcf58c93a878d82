"""Multi-host runtime: `jax.distributed` initialisation, process-0-only output, host-local data in and
global arrays out.

JAX on several hosts is multi-controller: every host runs the same program on its own devices, and
`jax.devices()` lists the devices of all of them. One process per host calls `initialize` before any
other JAX call; after that a mesh built from `jax.devices()` spans every host, and jitted steps over it
run collectives across hosts (ICI within a TPU slice, DCN or the network between hosts).

Where the coordinates come from (`from_env`, first match wins):
1. `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`: set them
   by hand, or let a launcher do it (`tpu/` and the GCP Batch template do).
2. GCP Batch: `BATCH_TASK_COUNT`, `BATCH_TASK_INDEX` and the first line of `BATCH_HOSTS_FILE`
   (a job whose task group sets `requireHostsFile`), with the port `JAXRL_COORDINATOR_PORT`
   (default 8476).
3. A Cloud TPU VM (a TPU chip on the PCI bus): JAX's own detection reads the worker list and id from the
   TPU metadata server, so a pod slice needs no settings at all.
4. Nothing: one process, and `initialize` does nothing.

How `jaxrl run` uses the hosts (`jaxrl.run.runner`): the trainer's weights and train step live on one mesh
over every device of every host. Each host also runs its own rollout engine, server and environments on
a copy of the weights placed on its own devices (`local_mesh`), so rollouts never wait on another host,
and plays its `share` of each step's example groups. The step's rollouts are then gathered to every host
(`all_gather_objects`: token ids, logprobs and rewards, kilobytes to a few megabytes a step), so every
process holds exactly what one process would have played and derives the same metrics, failure verdict,
advantages and train batch from it, with no further agreement needed; the train batch goes onto the
global mesh as the same numpy array on every host. Decisions taken on one host only (a SIGTERM) are
agreed with `any_process` before anything collective depends on them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

DEFAULT_PORT = 8476  # JAX's own default coordinator port on Cloud TPU


@dataclasses.dataclass(frozen=True)
class Setup:
    """How this process joins a multi-process run.

    `coordinator_address` is "host:port" of process 0's coordination service; `num_processes` >= 1 and
    `0 <= process_id < num_processes`. `auto_detect` leaves all three to JAX's cluster detection (Cloud
    TPU VMs and pod slices), in which case the other fields are None. `source` names where the values
    came from, for the startup line.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto_detect: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        if self.auto_detect:
            return
        if self.coordinator_address is None or self.num_processes is None or self.process_id is None:
            raise ValueError(f"{self.source or 'setup'}: coordinator address, process count and process id "
                             "are all needed")
        if ":" not in self.coordinator_address:
            raise ValueError(f"{self.source}: coordinator address {self.coordinator_address!r} is not host:port")
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"{self.source}: process id {self.process_id} is not in [0, {self.num_processes})")


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None


# Google's PCI vendor id and the device ids of Cloud TPU chips (v3, v4, v5p, v5e, v6e, TPU7x), as JAX's own
# hardware check reads them; other Google devices (gVNIC) share the vendor id.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = frozenset({"0x0027", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})


def on_tpu_vm(sys_root: str = "/sys") -> bool:
    """True when a Cloud TPU chip is attached to this host over PCI (read from `sys_root`)."""
    for vendor in Path(sys_root).glob("bus/pci/devices/*/vendor"):
        if vendor.read_text().strip() == _GOOGLE_PCI_VENDOR and \
                (vendor.parent / "device").read_text().strip() in _TPU_PCI_DEVICES:
            return True
    return False


def from_env(env: Mapping[str, str] | None = None, *, tpu_vm: bool | None = None) -> Setup | None:
    """The `Setup` described by environment variables `env` (default `os.environ`), or None for a plain
    single-process run. See the module docstring for the order. `tpu_vm` overrides TPU detection.

    Raises:
        ValueError: some but not all of the `JAX_*` variables are set, or one is malformed.
    """
    env = os.environ if env is None else env
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    if any(n in env for n in names):
        if missing := [n for n in names if n not in env]:
            raise ValueError(f"{', '.join(missing)} must be set with {', '.join(n for n in names if n in env)}")
        return Setup(env["JAX_COORDINATOR_ADDRESS"], _int(env, "JAX_NUM_PROCESSES"), _int(env, "JAX_PROCESS_ID"),
                     source="JAX_* variables")
    if "BATCH_TASK_INDEX" in env and "BATCH_TASK_COUNT" in env:
        count = _int(env, "BATCH_TASK_COUNT")
        if count == 1:
            return None
        hosts_file = env.get("BATCH_HOSTS_FILE")
        if not hosts_file:
            raise ValueError("GCP Batch job with several tasks but no BATCH_HOSTS_FILE: set requireHostsFile")
        first = Path(hosts_file).read_text().split()[0]
        port = _int(env, "JAXRL_COORDINATOR_PORT") if "JAXRL_COORDINATOR_PORT" in env else DEFAULT_PORT
        return Setup(f"{first}:{port}", count, _int(env, "BATCH_TASK_INDEX"), source="GCP Batch")
    if on_tpu_vm() if tpu_vm is None else tpu_vm:
        return Setup(auto_detect=True, source="Cloud TPU metadata")
    return None


def initialize(setup: Setup | None) -> None:
    """Join the run described by `setup` (no-op for None). Call once, before any other JAX call that
    touches devices. CPU processes exchange data through gloo (JAX's default CPU collectives)."""
    if setup is None:
        return
    if setup.auto_detect:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=setup.coordinator_address,
                                   num_processes=setup.num_processes, process_id=setup.process_id)


def is_primary() -> bool:
    """True on process 0, the one that writes logs, metrics, W&B and adapter files."""
    return jax.process_index() == 0


def global_batch(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The global array whose rows are every process's `local` rows in process order.

    Each process passes the rows it produced (its rollouts), all of the same shape; the global leading
    dimension is `local.shape[0] * jax.process_count()`. The sharding's leading mesh axes must place
    process p's devices on rows `[p * n, (p + 1) * n)`: true for a mesh from `jaxrl.parallel.sharding.make_mesh`
    whose `batch` axes start with one that spans the hosts (e.g. `data` = number of hosts).
    """
    shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    return jax.make_array_from_process_local_data(sharding, local, shape)


def to_host(tree: Any) -> Any:
    """Numpy copies of every leaf of `tree`, gathered from all processes (every process gets them all).
    Needed for arrays sharded over devices of other hosts, which `np.asarray` refuses."""
    return jax.tree.map(lambda x: np.asarray(x) if x.is_fully_addressable else
                        np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def local_mesh(mesh: Mesh) -> Mesh:
    """The part of `mesh` on this process's devices, with the same axis names (`mesh` itself with one
    process): where this host's rollout engine runs.

    Raises:
        ValueError: this process's devices do not form a block of `mesh` (a mesh not built by
            `jaxrl.parallel.sharding.make_mesh` from `jax.devices()`, which lists them host by host).
    """
    return mesh if jax.process_count() == 1 else mesh.local_mesh


def share(n: int) -> range:
    """This process's contiguous share of `n` items: process p of P gets `[p * n // P, (p + 1) * n // P)`,
    shares differing in size by at most one, so every process's share in process order is `range(n)`."""
    count, index = jax.process_count(), jax.process_index()
    return range(index * n // count, (index + 1) * n // count)


def all_gather_objects(obj: Any) -> list[Any]:
    """`obj` of every process, in process order (`[obj]` with one process). A collective: every process
    must call it at the same point. `obj` must be JSON-serialisable (floats round-trip exactly, NaN
    included); it travels as JSON text over JAX's own collectives."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(rows[i, :size].tobytes()) for i, size in enumerate(sizes)]


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (a collective; `flag` itself with one process)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.asarray(multihost_utils.process_allgather(np.array([flag], bool))).any())
