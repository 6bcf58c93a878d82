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
over every device of every host. Each host also runs its own server and environments, and its own
rollout engine on a copy of the weights placed on its own devices (`local_mesh`), so rollouts never wait
on another host; where the model does not fit one host, a group of hosts shares one engine over their
devices (`group_mesh`, `engine_hosts`, `jaxrl.inference.lockstep`). Each host plays the example groups
it owns (`jaxrl.rl.producer`). The step's rollouts are then gathered to every host
(`all_gather_objects`: token ids, logprobs and rewards, kilobytes to a few megabytes a step), so every
process holds exactly what one process would have played and derives the same metrics, failure verdict,
advantages and train batch from it, with no further agreement needed; the train batch goes onto the
global mesh as the same numpy array on every host. Decisions taken on one host only (a SIGTERM) are
agreed with `any_process` before anything collective depends on them.

Decisions that must be agreed while devices are busy (which finished rollout groups a step takes, when a
group of engines admits a request) travel as small JSON messages over the key-value store of JAX's
coordination service (`Exchange`), which runs no device program: a device collective issued from a
second thread could interleave differently on two hosts with the programs of the first, and hang both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
from collections.abc import Callable, Mapping, Sequence
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
    with fenced():
        return jax.tree.map(lambda x: np.asarray(x) if x.is_fully_addressable else
                            np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


_fence: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def set_fence(fence: Callable[[], contextlib.AbstractContextManager] | None) -> None:
    """Make `fenced` enter `fence()` (None: nothing): a rollout engine that spans hosts registers its
    `paused` (`jaxrl.inference.lockstep`), so that no device program spanning hosts runs between its own."""
    global _fence
    _fence = fence or contextlib.nullcontext


def fenced() -> contextlib.AbstractContextManager:
    """A stretch in which this process may issue device programs that span hosts (collectives, a train
    step): enter it at the same point of the program on every process. The gathers below enter it
    themselves; it nests."""
    return _fence()


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (no-op with one process)."""
    if jax.process_count() > 1:
        with fenced():
            multihost_utils.sync_global_devices(name)


def local_mesh(mesh: Mesh) -> Mesh:
    """The part of `mesh` on this process's devices, with the same axis names (`mesh` itself with one
    process): where this host's rollout engine runs.

    Raises:
        ValueError: this process's devices do not form a block of `mesh` (a mesh not built by
            `jaxrl.parallel.sharding.make_mesh` from `jax.devices()`, which lists them host by host).
    """
    return mesh if jax.process_count() == 1 else mesh.local_mesh


def group_mesh(mesh: Mesh, processes: Sequence[int]) -> Mesh:
    """The part of `mesh` on the devices of `processes`, with the same axis names: where the rollout engine
    of an engine group runs (`local_mesh` for one process; `mesh` itself for all of them).

    Raises:
        ValueError: those processes' devices do not form a block of `mesh` (e.g. a group that the mesh's
            first axis does not split at a host boundary).
    """
    if len(processes) == jax.process_count():
        return mesh
    if list(processes) == [jax.process_index()]:
        return local_mesh(mesh)
    inside = np.vectorize(lambda d: d.process_index in processes)(mesh.devices)
    box = tuple(slice(int(ix.min()), int(ix.max()) + 1) for ix in np.nonzero(inside))
    if not inside[box].all() or inside.sum() != inside[box].size:
        raise ValueError(f"the devices of processes {list(processes)} are not a block of mesh {dict(mesh.shape)}")
    return Mesh(mesh.devices[box], mesh.axis_names)


def engine_hosts(setting: int, processes: int, chip_bytes: int | None, fit: Callable[[int], int]) -> int:
    """Processes per rollout engine (`[jax] engine_hosts`): `setting` when it is not 0; else 1 with one
    process or where the runtime reports no accelerator memory (`chip_bytes` None, as on CPU: an engine per
    host); else `fit(chip_bytes)`, the fewest hosts whose engine fits beside the compiled train step
    (`jaxrl.compile.report.run_engine_hosts`, the rule `jaxrl compile` applies).

    Raises:
        ValueError: `setting` does not divide `processes`.
    """
    if setting:
        if processes % setting:
            raise ValueError(f"engine_hosts = {setting} does not divide the {processes} processes")
        return setting
    if processes == 1 or chip_bytes is None:
        return 1
    return fit(chip_bytes)


def chip_memory() -> int | None:
    """Bytes of accelerator memory of one of this process's devices, the smallest (None where the runtime
    does not report it, as on CPU)."""
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
    return None if None in limits else int(min(limits))


def memory_in_use() -> int:
    """Bytes allocated now on this process's devices, the most on any one (`memory_stats()`'s
    `bytes_in_use`; 0 where the runtime does not report it, as on CPU)."""
    return max(int((d.memory_stats() or {}).get("bytes_in_use", 0)) for d in jax.local_devices())


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
    with fenced():
        sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
        # padded to a power of two: each distinct length compiles another gather program
        padded = np.zeros(1 << int(sizes.max() - 1).bit_length(), np.uint8)
        padded[:data.size] = data
        rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(rows[i, :size].tobytes()) for i, size in enumerate(sizes)]


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (a collective; `flag` itself with one process)."""
    if jax.process_count() == 1:
        return bool(flag)
    with fenced():
        return bool(np.asarray(multihost_utils.process_allgather(np.array([flag], bool))).any())


def _coordination_client() -> Any:
    """The client of JAX's coordination service, which `jax.distributed.initialize` starts (Orbax's
    multihost module reads it from the same place; JAX has no public accessor)."""
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: an Exchange needs several processes")
    return client


_exchanges = itertools.count()


class Exchange:
    """All-gather of small JSON objects among `processes` (default: every process) through the
    coordination service's key-value store: no device program runs, so it may be called from any thread
    while devices execute other programs.

    Round k: every process posts its object under `jaxrl/x<n>/<k>/<process>`; the first process of
    `processes` (the leader) reads them all and posts the list under `.../<k>/all`, which the others read.
    So every process gets the same list in the order of `processes`, and what the leader decides from it
    (`gather(obj, decide=...)`) is decided in one place and shared. Keys of round k - 1 are deleted in
    round k, when every process has read them. Instances are numbered in creation order, so every
    process must create its exchanges in the same order, and call `gather` on each in lockstep (a
    collective). Small messages only: the store moved about 6 MB/s between two local processes.

    Raises (from `gather`):
        RuntimeError: another process did not post within `timeout_s` seconds.
    """

    def __init__(self, processes: Sequence[int] | None = None, timeout_s: float = 1800.0) -> None:
        self.processes = tuple(range(jax.process_count()) if processes is None else processes)
        self.me = jax.process_index() if len(self.processes) > 1 else self.processes[0]
        self.timeout_ms = int(timeout_s * 1000)
        self.prefix = f"jaxrl/x{next(_exchanges)}"
        self.round = 0

    @property
    def leader(self) -> bool:
        return self.me == self.processes[0]

    def _get(self, client: Any, key: str, who: int) -> Any:
        try:
            return json.loads(client.blocking_key_value_get(key, self.timeout_ms))
        except Exception as exc:  # noqa: BLE001 - the runtime's own error types are not public
            raise RuntimeError(f"{key}: no answer from process {who} within {self.timeout_ms / 1000:.0f}s "
                               f"({type(exc).__name__}: {exc})") from None

    def gather(self, obj: Any, decide: Any = None) -> Any:
        """Every process's `obj`, in the order of `processes`; with `decide`, `decide(objs)` as computed
        by the leader (`decide` must return a JSON-serialisable value). One process: no store at all."""
        if len(self.processes) == 1:
            return decide([obj]) if decide else [obj]
        client, key = _coordination_client(), f"{self.prefix}/{self.round}"
        if self.leader:
            posts = [obj if p == self.me else self._get(client, f"{key}/{p}", p) for p in self.processes]
            out = decide(posts) if decide else posts
            client.key_value_set(f"{key}/all", json.dumps(out))
            if self.round:
                client.key_value_delete(f"{self.prefix}/{self.round - 1}/all")
        else:
            client.key_value_set(f"{key}/{self.me}", json.dumps(obj))
            out = self._get(client, f"{key}/all", self.processes[0])
            client.key_value_delete(f"{key}/{self.me}")  # the leader has read it
        self.round += 1
        return out
