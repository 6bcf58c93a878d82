"""Orbax checkpoints of a run: the trainer state (LoRA, optimizer, step) plus JSON metadata (data
position, RNG seeds, metrics), in a local folder or on `gs://` through the same code."""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxrl.train import TrainState


class Checkpointer:
    """Saves and restores `TrainState` + metadata under `directory/<step>`.

    Args:
        directory: a local path or a `gs://bucket/path` URL.
        keep: number of most recent checkpoints kept; -1 keeps all.
    A checkpoint is only visible (to `latest_step`, `restore`) once Orbax has finalised it, so a run
    killed mid-write resumes from the previous complete one.
    """

    def __init__(self, directory: str, keep: int = 5) -> None:
        policy = policies.LatestN(n=None if keep < 0 else keep)
        options = ocp.CheckpointManagerOptions(preservation_policy=policy, create=True)
        self.directory = directory
        self._mngr = ocp.CheckpointManager(directory, options=options)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(self, step: int, state: TrainState, meta: dict[str, Any]) -> None:
        """Start saving `state` and `meta` (JSON-serialisable) as checkpoint `step` (asynchronously)."""
        tree = {"lora": state.lora, "opt_state": state.opt_state, "step": state.step}
        args = ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta))
        self._mngr.save(step, args=args, force=True)

    def restore(self, step: int, like: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """Restore checkpoint `step` into arrays shaped and sharded like `like`.

        Raises:
            FileNotFoundError: no checkpoint `step` exists.
        """
        if step not in self._mngr.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}")
        target = {"lora": like.lora, "opt_state": like.opt_state, "step": like.step}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                               meta=ocp.args.JsonRestore()))
        tree = out["state"]
        return TrainState(tree["lora"], tree["opt_state"], tree["step"]), dict(out["meta"])

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
