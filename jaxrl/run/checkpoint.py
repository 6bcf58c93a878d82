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

import contextlib
import logging
import os
import re
import sys
import threading
import time
import traceback
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxrl.rl.train import TrainState
from jaxrl.run import checkpoint_layout, gcs
from jaxrl.run.errors import RunError


def _tree(state: TrainState) -> dict[str, Any]:
    """What a checkpoint stores of `state`: `lora`, `opt_state` and `step`, or in full fine-tuning `base`
    (the weights) in place of the empty `lora`."""
    trained = {"lora": state.lora} if state.base is None else {"base": state.base}
    return {**trained, "opt_state": state.opt_state, "step": state.step}


class _ReportedAsCheckpointError(logging.Filter):
    """Drops Orbax's own error records (each with a traceback, from its background threads; three for one
    failed save): every save or restore failure reaches the call that waits for it and is reported there,
    once, as a CheckpointError."""

    def filter(self, record: logging.LogRecord) -> bool:
        # absl's records carry absl's own file as their pathname: the caller is found on the stack
        return record.levelno < logging.ERROR or not any(
            "/orbax/" in frame.f_code.co_filename.replace("\\", "/") for frame, _ in traceback.walk_stack(None))


logging.getLogger("absl").addFilter(_ReportedAsCheckpointError())  # Orbax logs through absl's logger

_DIRECTORIES: set[str] = set()  # every Checkpointer's folder (absolute) or gs:// URL in this process


class _OrbaxAsyncLeftovers(logging.Filter):
    """Drops asyncio's reports of Orbax's reads and writes left behind by a failed restore or save ("Task
    exception was never retrieved", "Future ...", "_GatheringFuture ...", "Task was destroyed but it is
    pending!", a traceback each: about 150 lines around the one line of a damaged checkpoint of a real run).
    Orbax stops and closes its event loop at the first failed read; reads that fail in the same turn of the
    loop are then never awaited, and asyncio reports each when it is collected. The failure itself reaches
    the call that waits for it and is reported once, as a CheckpointError. A record is Orbax's when its
    exception was raised in Orbax's code or its text names that code (a task of Orbax's coroutines), or when
    its exception has no Python frames (tensorstore's, raised in C++) and names a checkpoint folder of this
    process. An exception raised in jaxrl's own code, outside Orbax, is kept whatever it names."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        frames = [f.f_code.co_filename.replace("\\", "/") for f, _ in traceback.walk_tb(exc.__traceback__)] \
            if exc is not None else []
        text = record.getMessage() + (str(exc) if exc is not None else "")
        orbax_code = any("/orbax/" in f for f in frames) or "/orbax/" in record.getMessage().replace("\\", "/")
        checkpoint_io = not frames and any(directory in text for directory in _DIRECTORIES)
        return not (orbax_code or checkpoint_io)


logging.getLogger("asyncio").addFilter(_OrbaxAsyncLeftovers())  # asyncio's default exception handler logs here


def _closed_loop_callback(kind: type[BaseException] | None, value: BaseException | None, tb: Any) -> bool:
    """Whether an exception is tensorstore's callback into an asyncio loop Orbax has closed after a failed read
    or write: "RuntimeError: Event loop is closed", raised in `call_soon_threadsafe` when called from
    tensorstore's C++ threads, whose frames are asyncio's alone."""
    frames = [frame.f_code.co_filename.replace("\\", "/") for frame, _ in traceback.walk_tb(tb)]
    return (kind is RuntimeError and str(value) == "Event loop is closed" and bool(frames)
            and all("/asyncio/" in f for f in frames))


def _unraisable(hook: Any) -> Any:
    """`sys.unraisablehook` that drops what Orbax's own coroutines leave behind once a restore has failed
    (its other reads, collected after their event loop closed: "Exception ignored in: <coroutine
    _read_array_index_and_device_put>", "RuntimeError: Event loop is closed", a traceback each, interleaved
    with the run's output) and tensorstore's callbacks into that closed loop (reported with no object, so
    printed as a bare traceback; seen in about one restore of a truncated array file in six); the failure
    itself is the CheckpointError. Anything else goes to `hook`."""

    def unraisable(info: Any) -> None:
        code = getattr(info.object, "cr_code", None)
        ours = code is not None and "/orbax/" in code.co_filename.replace("\\", "/")
        if not ours and not _closed_loop_callback(info.exc_type, info.exc_value, info.exc_traceback):
            hook(info)

    return unraisable


sys.unraisablehook = _unraisable(sys.unraisablehook)


def _excepthook(hook: Any) -> Any:
    """`sys.excepthook` that drops tensorstore's callbacks into an asyncio loop Orbax has closed after a failed
    read or write (`_closed_loop_callback`); anything else goes to `hook`."""

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not _closed_loop_callback(kind, value, tb):
            hook(kind, value, tb)

    return excepthook


sys.excepthook = _excepthook(sys.excepthook)

DAMAGED = ".damaged"
"""Suffix of a damaged step folder set aside (`Checkpointer.set_aside`)."""


def _cause(exc: BaseException) -> str:
    """`Type: message` of a storage error's root cause (the last of its `__cause__` chain: Orbax wraps
    tensorstore's "Requested byte range [0, 15163) is not valid for value of size 7712" of a truncated file
    in a message that quotes the whole TensorStore spec; tensorstore's own `[tensorstore_spec=...]` dropped)
    on one line, cut in the middle past 600 characters
    (storage errors are long; the root cause is usually at the end)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    cause = re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", " ".join(str(exc).split()))  # a whole spec, as JSON
    if len(cause) > 600:
        cause = f"{cause[:250]} ... {cause[-300:]}"
    return f"{type(exc).__name__}: {cause}"


CLOSE_TIMEOUT_S = 10.0
"""How long `Checkpointer.close` waits for Orbax's threads after a failed save before leaving them."""


class CheckpointError(RunError):
    """A checkpoint that could not be written or read. The message names the step, the folder, the
    last complete checkpoint in it and the cause; the run's local files are left as they are.
    `last_complete`: that checkpoint's step (None: none, or not known)."""

    last_complete: int | None = None


def _close_after_failure(mngr: ocp.CheckpointManager, timeout_s: float) -> None:
    """Release what a CheckpointManager holds after a failed save. Its `close` stops at its first step (it
    waits for the save, which raises again) and leaves its handlers' threads running: each background write
    is a non-daemon Orbax `_SignalingThread` that first waits for signals from the steps before it, and a
    step that failed never sends them, so they wait out Orbax's 300 s coordination timeout, one after
    another, and Python's exit waits for them in `threading._shutdown` (a read-only checkpoint folder's run
    never exited). Here each such thread is cancelled and sent the signals it waits for, so it returns
    without running its write; then the manager's parts are closed, and the threads joined for at most
    `timeout_s` seconds in all. Orbax has no public call for this (0.12: `_SignalingThread`,
    `future.set_signals`)."""
    from orbax.checkpoint._src.futures import future as ocp_future

    stuck = [t for t in threading.enumerate() if isinstance(t, ocp_future._SignalingThread) and t.is_alive()]  # noqa: SLF001
    for thread in stuck:
        with contextlib.suppress(Exception):
            thread.cancel()
            ocp_future.set_signals(thread._receive_signals, operation_id=thread._operation_id)  # noqa: SLF001
    for part in ("_checkpointer", "_non_blocking_metadata_store", "_blocking_metadata_store", "_checkpoint_deleter"):
        with contextlib.suppress(Exception):
            getattr(mngr, part).close()
    deadline = time.monotonic() + timeout_s
    for thread in stuck:
        threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))


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
        self._mngr = ocp.CheckpointManager(directory if self._probe else os.path.abspath(directory), options=options)
        _DIRECTORIES.add(directory.rstrip("/") if self._probe else os.path.abspath(directory))
        self._pending: int | None = None
        self._failed = False  # a save failed: `close` releases Orbax's threads
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
        meta = {**meta, checkpoint_layout.LAYOUT_KEY: checkpoint_layout.RANK_MAJOR}  # read back by `restore`
        args = ocp.args.Composite(state=ocp.args.StandardSave(_tree(state)), meta=ocp.args.JsonSave(meta))
        try:
            self._mngr.save(step, args=args, force=True)
        except Exception as exc:  # noqa: BLE001 - any storage failure becomes one clear error
            self._failed = True
            raise self._error(f"cannot save step {step} to", exc) from exc
        self._pending = step

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata of checkpoint `step` (as `save` was given it), without reading any array.

        Raises:
            CheckpointError: no complete checkpoint `step` exists, or it cannot be read.
        """
        meta = self._read_meta(step)
        meta.pop(checkpoint_layout.LAYOUT_KEY, None)
        return meta

    def _read_meta(self, step: int) -> dict[str, Any]:
        self._require(step)
        try:
            return dict(self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        except Exception as exc:  # noqa: BLE001
            raise self._error(f"cannot read step {step} metadata from", exc) from exc

    def restore(self, step: int, like: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """Restore checkpoint `step` into arrays shaped, typed and sharded like `like`, and its metadata.
        A checkpoint saved before the LoRA A factors became rank-major (no layout in its metadata) is
        restored in its layout and transposed (`jaxrl.run.checkpoint_layout`).

        Raises:
            CheckpointError: no complete checkpoint `step` exists, or its arrays do not fit `like`.
        """
        meta = self._read_meta(step)
        old = meta.pop(checkpoint_layout.LAYOUT_KEY, None) != checkpoint_layout.RANK_MAJOR
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _tree(like))
        target = checkpoint_layout.old_layout_target(abstract) if old else abstract
        try:
            tree = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
        except Exception as exc:  # noqa: BLE001
            raise self._error(f"cannot restore step {step} from", exc) from exc
        if old:
            tree = checkpoint_layout.to_rank_major(tree, abstract)
        return TrainState(tree.get("lora", {}), tree["opt_state"], tree["step"], tree.get("base")), meta

    def damage(self, step: int) -> str | None:
        """Why checkpoint `step` does not restore whole, None when it does: its metadata JSON, its tree
        metadata and every array read back onto the host (no target: the arrays as saved). Reads the
        whole checkpoint (LoRA ones are a few MB)."""
        try:
            self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                             meta=ocp.args.JsonRestore()))
        except Exception as exc:  # noqa: BLE001 - any layer's refusal is the damage
            return _cause(exc)
        return None

    def set_aside(self, step: int) -> str:
        """Rename a damaged local step folder `<step>` to `<step>.damaged` (kept, never deleted; Orbax
        lists only numbered folders), so a resumed run's save of that step number can be written; return
        the folder's new path. On `gs://` the step stays where it is (a rename there is a copy) and its
        path is returned.

        Raises:
            CheckpointError: the folder cannot be renamed.
        """
        path = f"{self.directory.rstrip('/')}/{step}"
        if gcs.is_gcs(self.directory):
            return path
        target = f"{path}{DAMAGED}"
        try:
            os.rename(path, target if not os.path.exists(target) else f"{target}.{int(time.time())}")
        except OSError as exc:
            raise self._error(f"cannot set damaged step {step} aside in", exc) from exc
        self._mngr.reload()
        return target

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
            self._failed = True
            raise self._error(f"cannot save step {pending} to", exc) from exc
        if pending is not None:
            self._last_complete = pending

    def resume_note(self) -> str:
        """How running the run again goes on: from the newest complete checkpoint, or from step 0 without one."""
        last = self.latest_step()
        return "no checkpoint yet: it starts from step 0" if last is None else f"resumes from checkpoint step {last}"

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Finish the last save and release the manager and its threads, within about `timeout_s` seconds
        after a failed save.

        Raises:
            CheckpointError: the last save failed.
        """
        try:
            self.wait()
        finally:
            if self._failed:
                _close_after_failure(self._mngr, timeout_s)
            else:
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
        message = f"{action} {self.directory}: {_cause(exc)}"
        last = getattr(self, "_last_complete", None)
        if hasattr(self, "_last_complete"):
            message += f" (last complete checkpoint: {'none' if last is None else f'step {last}'})"
        error = CheckpointError(message)
        error.last_complete = last
        return error

