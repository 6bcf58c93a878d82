"""`[infrastructure].compute_size`: how much of this machine's CPU the environments get.

On Hosted Training the size picks the CPU of the environment containers. Here the environments run in
the trainer's process, on the run's asyncio loop, so the size sets the two things that bound their CPU
work, scaled to `cores`, the CPUs this process may run on (`os.sched_getaffinity`):

| size | `threads`: env worker threads | `max_in_flight`: rollouts in flight at once |
|------|-------------------------------|---------------------------------------------|
| S    | max(1, cores // 4)            | 8 x cores                                   |
| M    | max(2, cores // 2)            | 32 x cores                                  |
| L    | max(4, cores)                 | no limit (every rollout of the step)        |

- `threads` is the size of the loop's default executor, which runs `asyncio.to_thread(...)` and
  `loop.run_in_executor(None, ...)`: verifiers awaits reward functions on the loop itself, so a CPU-bound
  reward (running tests, compiling code) should hand its work to a thread this way; verifiers' subprocess
  runtime does its file I/O there too. Python's own default is min(32, cores + 4).
- `max_in_flight` bounds the rollouts (episodes: harness, environment turns, scoring) that run at once;
  the others wait for a free place. Generation is bounded separately, by `[jax] decode_slots`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

ComputeSize = Literal["S", "M", "L"]


@dataclasses.dataclass(frozen=True)
class EnvResources:
    """What the environments of a run get: `threads` (default executor workers) and `max_in_flight`
    (concurrent rollouts; None = no limit)."""

    threads: int
    max_in_flight: int | None

    def describe(self, size: ComputeSize) -> str:
        """One line for the run's console."""
        limit = "no limit on rollouts in flight" if self.max_in_flight is None else \
            f"at most {self.max_in_flight} rollouts in flight"
        return f"environments: compute_size {size}, {self.threads} worker threads, {limit}"


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask, which containers and `taskset` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def env_resources(size: ComputeSize, cores: int | None = None) -> EnvResources:
    """The module docstring's table for `size` on `cores` CPUs (default: `available_cores()`).

    Raises:
        ValueError: `size` is not S, M or L, or `cores` < 1.
    """
    cores = available_cores() if cores is None else cores
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    match size:
        case "S":
            return EnvResources(max(1, cores // 4), 8 * cores)
        case "M":
            return EnvResources(max(2, cores // 2), 32 * cores)
        case "L":
            return EnvResources(max(4, cores), None)
    raise ValueError(f"compute_size {size!r} is not 'S', 'M' or 'L'")


def apply(loop: asyncio.AbstractEventLoop, resources: EnvResources) -> None:
    """Give `loop` a default executor of `resources.threads` workers; `loop.close()` shuts it down."""
    loop.set_default_executor(ThreadPoolExecutor(resources.threads, thread_name_prefix="jaxrl-env"))
