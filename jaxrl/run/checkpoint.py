"""Orbax checkpoints of a run: the trainer state (LoRA or, in full fine-tuning, every weight; optimizer,
step) plus JSON metadata (data
position, RNG seeds, metrics, the model it belongs to), in a local folder or on `gs://` through the
same code.

A checkpoint is visible (to `latest_step`, `restore`) only once Orbax has finalised it: locally a
temporary folder renamed at the end, on GCS a commit marker written last. A process killed mid-write
therefore resumes from the previous complete checkpoint; the leftover temporary folder is removed
when the next `Checkpointer` opens the directory. Nothing is unpickled: arrays come back through
tensorstore, metadata through JSON.
"""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxrl.rl.train import TrainState
from jaxrl.run import gcs
from jaxrl.run.errors import RunError


def _tree(state: TrainState) -> dict[str, Any]:
    """What a checkpoint stores of `state`: `lora`, `opt_state` and `step`, or in full fine-tuning `base`
    (the weights) in place of the empty `lora`."""
    trained = {"lora": state.lora} if state.base is None else {"base": state.base}
    return {**trained, "opt_state": state.opt_state, "step": state.step}


class CheckpointError(RunError):
    """A checkpoint that could not be written or read. The message names the step, the folder, the
    last complete checkpoint in it and the cause; the run's local files are left as they are."""


class Checkpointer:
    """Saves and restores `TrainState` + metadata under `directory/<step>`.

    Args:
        directory: a local path or a `gs://bucket/path` URL.
        keep: number of most recent checkpoints kept; -1 keeps all.
        read_only: open another run's checkpoints (a warm start): never write, delete or clean up.
        attempts, backoff_s: retry budget of the `gs://` probe that runs when the directory is opened
            and before every save (see `jaxrl.run.gcs.probe`).

    Raises:
        CheckpointError: a `gs://` directory that is unreachable or not writable, or leftover temporary
            checkpoints (of a process killed mid-write) that could not be removed.
    """

    def __init__(self, directory: str, keep: int = 5, *, read_only: bool = False, attempts: int = 4,
                 backoff_s: float = 0.5) -> None:
        self.directory = directory
        self._probe = (lambda: gcs.probe(directory, attempts, backoff_s)) if gcs.is_gcs(directory) else None
        if self._probe and not read_only:
            self._check_reachable("open")
        if self._probe:
            gcs.forget_listings(directory)
        policy = policies.LatestN(n=None if keep < 0 else keep)
        options = ocp.CheckpointManagerOptions(preservation_policy=policy, create=not read_only,
                                               read_only=read_only, cleanup_tmp_directories=not read_only)
        self._mngr = ocp.CheckpointManager(directory, options=options)
        self._pending: int | None = None
        self._last_complete = self._mngr.latest_step()
        if not read_only:
            self._await_cleanup()

    def _await_cleanup(self) -> None:
        # Orbax removes leftover temporary checkpoints in a thread its constructor starts, and waits for it
        # only in its first `save`. On gs:// that thread's look at the folder raced the probe object our first
        # save writes and deletes: it saw the object, then listed nothing (FileNotFoundError), failing the
        # save. So the cleanup is over when a Checkpointer has opened its folder. (No public call waits for it.)
        try:
            self._mngr._maybe_await_cleanup_tmp_directory()  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001 - any failure of the storage stack
            raise self._error("cannot remove leftover temporary checkpoints in", exc) from exc

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, None when there is none."""
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint, ascending."""
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state: TrainState, meta: dict[str, Any]) -> None:
        """Start saving `state` and `meta` (JSON-serialisable) as checkpoint `step`; the arrays are
        written in the background. Waits for the previous save first.

        Raises:
            CheckpointError: the previous save failed, the `gs://` probe failed after its retries, or
                the write could not start (full disk, permissions, ...).
        """
        self.wait()
        if self._probe:
            self._check_reachable(f"cannot save step {step} to")
        args = ocp.args.Composite(state=ocp.args.StandardSave(_tree(state)), meta=ocp.args.JsonSave(meta))
        try:
            self._mngr.save(step, args=args, force=True)
        except Exception as exc:  # noqa: BLE001 - any storage failure becomes one clear error
            raise self._error(f"cannot save step {step} to", exc) from exc
        self._pending = step

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata of checkpoint `step`, without reading any array.

        Raises:
            CheckpointError: no complete checkpoint `step` exists, or it cannot be read.
        """
        self._require(step)
        try:
            return dict(self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        except Exception as exc:  # noqa: BLE001
            raise self._error(f"cannot read step {step} metadata from", exc) from exc

    def restore(self, step: int, like: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """Restore checkpoint `step` into arrays shaped, typed and sharded like `like`.

        Raises:
            CheckpointError: no complete checkpoint `step` exists, or its arrays do not fit `like`.
        """
        self._require(step)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _tree(like))
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                   meta=ocp.args.JsonRestore()))
        except Exception as exc:  # noqa: BLE001
            raise self._error(f"cannot restore step {step} from", exc) from exc
        tree = out["state"]
        return TrainState(tree.get("lora", {}), tree["opt_state"], tree["step"], tree.get("base")), dict(out["meta"])

    def delete(self, step: int) -> None:
        """Delete checkpoint `step` (a no-op for a step that does not exist)."""
        if step in self._mngr.all_steps():
            self._mngr.delete(step)

    def wait(self) -> None:
        """Block until the last save is complete.

        Raises:
            CheckpointError: it failed (the checkpoint stays incomplete and invisible).
        """
        pending, self._pending = self._pending, None
        try:
            self._mngr.wait_until_finished()
        except Exception as exc:  # noqa: BLE001
            raise self._error(f"cannot save step {pending} to", exc) from exc
        if pending is not None:
            self._last_complete = pending

    def close(self) -> None:
        """Finish the last save and release the manager.

        Raises:
            CheckpointError: the last save failed.
        """
        try:
            self.wait()
        finally:
            self._mngr.close()

    def _require(self, step: int) -> None:
        if step not in self._mngr.all_steps():
            have = self.all_steps()
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory} "
                                  f"({'steps: ' + ', '.join(map(str, have)) if have else 'it has none'})")

    def _check_reachable(self, action: str) -> None:
        try:
            self._probe()
        except gcs.GCSUnavailable as exc:
            raise self._error(action, exc) from exc

    def _error(self, action: str, exc: BaseException) -> CheckpointError:
        # The last complete step is the one this process knows of: the storage may be what is down.
        cause = " ".join(str(exc).split())
        if len(cause) > 600:  # storage errors are long; the root cause is usually at the end
            cause = f"{cause[:250]} ... {cause[-300:]}"
        message = f"{action} {self.directory}: {type(exc).__name__}: {cause}"
        if hasattr(self, "_last_complete"):
            last = self._last_complete
            message += f" (last complete checkpoint: {'none' if last is None else f'step {last}'})"
        return CheckpointError(message)

