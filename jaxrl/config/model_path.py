"""Where a config's model name is found on this machine: a local folder, a `gs://` URL, or the local
Hugging Face cache (nothing is downloaded). No JAX here: `jaxrl validate` resolves it.
"""

from __future__ import annotations

import os
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    """No checkpoint for a model name; the message lists every place that was looked in."""


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    return Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"


def find_in_hf_cache(repo_id: str) -> Path | None:
    """The snapshot folder of `owner/name` in the local HF cache that holds a `config.json` (the one
    `refs/main` points at, else the newest), or None."""
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    main = repo / "refs" / "main"
    if main.is_file() and (snapshots / main.read_text().strip() / "config.json").is_file():
        return snapshots / main.read_text().strip()
    found = [p for p in snapshots.iterdir() if (p / "config.json").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_model(where: str, base_dir: Path = Path(".")) -> str:
    """The checkpoint location for a model name: a `gs://` URL as given; a local folder (relative to
    `base_dir`); else, for an `owner/name` id, its snapshot in the local HF cache.

    Raises:
        ModelNotFoundError: none of these holds it (the message names each place looked in).
    """
    if where.startswith("gs://"):
        return where
    folder = base_dir / Path(where).expanduser()
    if folder.is_dir():
        return str(folder.resolve())
    looked = [f"no folder {folder}"]
    if where.count("/") == 1 and not where.startswith((".", "/", "~")):
        if (snapshot := find_in_hf_cache(where)) is not None:
            return str(snapshot)
        looked.append(f"not in the Hugging Face cache {hf_cache_dir()}")
    raise ModelNotFoundError(f"model {where!r} not found: {'; '.join(looked)} (nothing is downloaded)")
