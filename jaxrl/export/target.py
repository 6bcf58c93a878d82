"""The folder `jaxrl export` writes, and what it refuses to write over.

An export goes only into a new or empty folder, or (with `force`) over an earlier export of the same kind
(merged or adapter) that holds nothing but the files it wrote: each export lists its files in the folder's
manifest, `.jaxrl-export.json`, written last. It never goes into the run's own base model or tokenizer
folder: the next export of the same checkpoint would read the merged weights as its base and apply the
LoRA a second time. The files are written to a temporary folder beside the target, which is renamed into
place only when complete, so a failed export (a full disk, an interrupt) leaves nothing behind and an
earlier export untouched. Files and folders get the modes the user's umask gives (`hf.umask_mode`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from jaxrl.model.hf import umask_mode
from jaxrl.run.trained import SourceError

MANIFEST = ".jaxrl-export.json"
KINDS = {"merged": "a merged model", "adapter": "a PEFT adapter"}


class ExportError(SourceError):
    """An export that cannot be done: no such run or checkpoint, no config to read, a LoRA that the
    target format cannot hold, or a target folder it must not or cannot write. The message says which
    and what to do."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What one export wrote: `kind` ("merged" or "adapter"), the checkpoint (`checkpoint_dir`, `step`)
    and the names of the files it wrote in its folder (the manifest itself left out)."""

    kind: str
    checkpoint_dir: str
    step: int
    files: tuple[str, ...]

    @classmethod
    def read(cls, folder: Path) -> Manifest | None:
        """The manifest of `folder`; None when it has none or one that is not a manifest."""
        try:
            data = json.loads((folder / MANIFEST).read_text())
            manifest = cls(data["kind"], data["checkpoint_dir"], int(data["step"]), tuple(data["files"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        ok = manifest.kind in KINDS and all(isinstance(f, str) and "/" not in f for f in manifest.files)
        return manifest if ok else None

    def write(self, folder: Path) -> None:
        data = {"written_by": "jaxrl export", **dataclasses.asdict(self), "files": list(self.files)}
        (folder / MANIFEST).write_text(json.dumps(data, indent=1) + "\n")


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(sorted(names)[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_target(out: Path, kind: str, *, force: bool, protected: dict[str, str]) -> None:
    """Refuse a target folder `out` that an export of `kind` must not write.

    Args:
        protected: local folders never written, even with `force`, each with what it is ("the run's
            base model folder").

    Raises:
        ExportError: `out` is a file, a protected folder, a folder holding files no export wrote, an
            earlier export without `force`, or an earlier export of the other kind.
    """
    if out.exists() and not out.is_dir():
        raise ExportError(f"cannot write {out}: it is a file, not a folder")
    real = out.resolve()
    for folder, what in protected.items():
        if real == Path(folder).expanduser().resolve():
            raise ExportError(f"{out} is {what}: an export never writes there (the next export would read "
                              "the merged weights as its base and apply the LoRA twice); choose another --out")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    manifest = Manifest.read(out)
    if manifest is None:
        raise ExportError(f"{out} is not empty and holds files jaxrl export did not write ({_names(entries)}); "
                          "an export goes into a new or empty folder: choose another --out")
    if manifest.kind != kind:
        raise ExportError(f"{out} holds {KINDS[manifest.kind]} export and this one is {KINDS[kind]}: writing "
                          "it there would mix two kinds of files; choose another --out")
    if others := sorted(set(entries) - set(manifest.files) - {MANIFEST}):
        raise ExportError(f"{out} holds files jaxrl export did not write ({_names(others)}); --force replaces "
                          "only an earlier export's own files: choose another --out")
    if not force:
        raise ExportError(f"{out} holds an earlier export (step {manifest.step} of {manifest.checkpoint_dir}); "
                          "pass --force to replace it")


def _missing_parents(folder: Path) -> list[Path]:
    """The ancestors of `folder` that do not exist, deepest first."""
    return [p for p in folder.parents if not p.exists()]


def _swap_into_place(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`: over nothing or an empty folder at once; over an earlier export by
    moving it aside first (put back if the second rename fails), then deleting it."""
    if not out.is_dir() or not any(out.iterdir()):
        os.rename(staging, out)  # onto an empty folder too; a folder filled meanwhile: ENOTEMPTY
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except OSError:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_folder(out: Path, manifest: Callable[[list[str]], Manifest], fill: Callable[[Path], None]) -> None:
    """Have `fill` write the export into a temporary folder beside `out` (missing parents created), add its
    manifest (`manifest(names of the files fill wrote)`), and rename it into place (`check_target` first).
    On any error the temporary folder and the parents made for it are removed and `out` is as it was.

    Raises:
        What `fill` raises; OSError: `out`'s parent cannot be made or the folder cannot be written.
    """
    made = _missing_parents(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    except OSError:
        _remove_empty(made)
        raise
    try:
        fill(staging)
        manifest(sorted(p.name for p in staging.iterdir())).write(staging)
        staging.chmod(umask_mode(0o777))
        _swap_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(made)
        raise


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()
