"""Where a run's arrays live: the trainer's mesh, this host's rollout engine's mesh and the processes that
engine spans, made once from the config, the model and the devices (`Placement.of`), read by the run.

One process, or an engine over every process (`[jax] engine_hosts` = the process count): the engine runs
on the trainer's mesh and shares its arrays (`shared`: the base weights are the trainer's, the LoRA is the
trainer's). Otherwise each engine group (`engine_hosts` consecutive processes, `engine_group`) steps its
own engine on its own devices (`engine_mesh`, a block of the trainer's mesh): the base weights are loaded
a second time onto them and the LoRA (or, in full fine-tuning, the weights) copied over after each step
(`to_engine`, a collective with several processes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from jaxrl.compile import report
from jaxrl.compile.programs import ProgramTooLarge
from jaxrl.config.schema import ConfigError, RunConfig
from jaxrl.model.config import ModelConfig
from jaxrl.parallel import distributed
from jaxrl.parallel.sharding import make_mesh


def trainer_mesh(cfg: RunConfig) -> Mesh:
    """The trainer's mesh over every process's devices (`[jax.mesh]`). Raises ConfigError (key `jax.mesh`)
    when its axes do not multiply to the device count."""
    try:
        return make_mesh(cfg.jax.mesh.model_dump())
    except ValueError as exc:  # a mesh of another device count: only the devices here tell
        raise ConfigError(cfg.source, [("jax.mesh", str(exc))]) from None


def engine_group(cfg: RunConfig, mcfg: ModelConfig, mesh: Mesh, console: Any, micro: int | None = None) -> range:
    """The processes whose devices this process's rollout engine spans: `[jax] engine_hosts` consecutive
    ones, or by the fit rule (`jaxrl.parallel.distributed.engine_hosts`): one on CPU or with one process,
    else the fewest whose engine fits beside the train step compiled for `mesh`
    (`jaxrl.compile.report.run_engine_hosts`). `micro`: the train step's sequences per micro-batch
    (`Placement.micro_batch`).

    Raises:
        ConfigError: key `jax.mesh` when the compiler refuses the train step (it needs more than a chip's
            HBM); key `jax.engine_hosts` when compiling it fails otherwise, or the value does not divide
            the process count.
    """
    def fit(chip_bytes: int) -> int:
        console.print("engine_hosts = 0: compiling the train step to choose the rollout engine's hosts "
                      "(set [jax] engine_hosts to skip this; jaxrl compile prints the value)")
        try:
            return report.run_engine_hosts(cfg, mcfg, mesh, chip_bytes, micro)
        except ProgramTooLarge as exc:
            raise ConfigError(cfg.source, [("jax.mesh", f"the train step does not fit: {exc}; "
                                                        f"`jaxrl compile` names the term to shrink")]) from None
        except Exception as exc:  # noqa: BLE001 - not the checkpoint's fault: say which step failed
            raise ConfigError(cfg.source, [("jax.engine_hosts", f"compiling the train step to choose the engine "
                                                                f"hosts failed ({type(exc).__name__}: {exc}); "
                                                                f"set engine_hosts to skip it")]) from None

    try:
        hosts = distributed.engine_hosts(cfg.jax.engine_hosts, jax.process_count(), distributed.chip_memory(), fit)
    except ValueError as exc:
        raise ConfigError(cfg.source, [("jax.engine_hosts", str(exc))]) from None
    first = jax.process_index() // hosts * hosts
    return range(first, first + hosts)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The trainer's `mesh`, this process's rollout engine's `engine_mesh` (`mesh` itself when `shared`),
    `engine_group`, the processes that engine spans (consecutive; one per host unless `[jax] engine_hosts`
    > 1), and `micro_batch`, the train step's sequences per micro-batch chosen at startup
    (`jaxrl.compile.report.startup_micro_batch`; None: `jaxrl.rl.train.default_micro_batch`)."""

    mesh: Mesh
    engine_mesh: Mesh
    engine_group: range
    micro_batch: int | None = None

    @classmethod
    def of(cls, cfg: RunConfig, mcfg: ModelConfig, mesh: Mesh, console: Any) -> Placement:
        """The placement of `cfg`'s run of model `mcfg` with the trainer on `mesh`. Raises ConfigError
        (`engine_group`'s keys); ValueError when the group's devices are not a block of `mesh`
        (`jaxrl.parallel.distributed.group_mesh`)."""
        micro = report.startup_micro_batch(cfg, mcfg, mesh, console.print)
        group = engine_group(cfg, mcfg, mesh, console, micro)
        return cls(mesh, distributed.group_mesh(mesh, group), group, micro)

    @property
    def shared(self) -> bool:
        """Whether the engine runs on the trainer's mesh, on the trainer's arrays (no copies)."""
        return self.engine_mesh is self.mesh

    @property
    def engine_hosts(self) -> int:
        """Processes this process's engine spans (> 1: one engine stepped in lockstep over them)."""
        return len(self.engine_group)

    def to_engine(self, tree: Any, shardings: Any) -> Any:
        """`tree` (on the trainer's mesh) for the engine: itself when `shared`, else a copy placed with
        `shardings` on the engine's mesh (through each host's memory: a collective with several processes)."""
        return tree if self.shared else jax.device_put(distributed.to_host(tree), shardings)
