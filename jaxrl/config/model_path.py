"""Where a config's model name is found: a local folder, a `gs://` URL, a complete snapshot in the local
Hugging Face cache, or else the Hugging Face Hub (`owner/name`, optionally `owner/name@revision`), which
`jaxrl.config.hub.resolve_model` downloads into that cache. `locate_model` only says which, without
the network: `jaxrl validate` calls it. No JAX and no `huggingface_hub` import here.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REVISION = "main"
_COMMIT = re.compile(r"[0-9a-f]{40}")


class ModelNotFoundError(FileNotFoundError):
    """No checkpoint for a model name; the message names every place looked in, or why the download failed."""


@dataclass(frozen=True)
class HubModel:
    """A model that is not on this machine: `repo_id` (`owner/name`) at `revision` (a branch, tag or
    commit hash) on the Hugging Face Hub, to be downloaded into `hf_cache_dir()`."""

    repo_id: str
    revision: str = DEFAULT_REVISION

    def describe(self) -> str:
        """One line for `jaxrl validate`: what `jaxrl run` downloads, from where, into which folder."""
        return (f"{self.repo_id} at revision {self.revision}, downloaded by `jaxrl run` from the Hugging Face "
                f"Hub ({hub_endpoint()}) into {hf_cache_dir()}")

    def offline_refusal(self) -> str:
        """Why it is not downloaded while `hub_offline()`."""
        return (f"model {self.repo_id}@{self.revision} is not in the Hugging Face cache {hf_cache_dir()} and "
                "HF_HUB_OFFLINE is set, so it is not downloaded")


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    return Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"


def hub_endpoint() -> str:
    """The Hub's address: `$HF_ENDPOINT`, else https://huggingface.co (read at each call, as tests set it)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_offline() -> bool:
    """`$HF_HUB_OFFLINE` (or transformers' `$TRANSFORMERS_OFFLINE`) is set to a true value."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def split_revision(where: str) -> tuple[str, str | None]:
    """`"owner/name@rev"` -> `("owner/name", "rev")`; a name without `@` -> `(name, None)`."""
    name, at, rev = where.partition("@")
    return (name, rev) if at and rev else (where, None)


def complete_snapshot(folder: Path) -> bool:
    """Whether a checkpoint folder holds `config.json` and all its weights: every shard that
    `model.safetensors.index.json` names, else at least one `*.safetensors` (a cache folder that only
    `jaxrl compile` filled holds `config.json` alone)."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return bool(shards) and all((folder / s).is_file() for s in shards)
    return any(folder.glob("*.safetensors"))


def find_in_hf_cache(repo_id: str, revision: str | None = None, *, need: str = "weights") -> Path | None:
    """The snapshot folder of `owner/name` in the local HF cache, or None. `revision`: a branch or tag
    (through `refs/<revision>`) or a commit hash; None: `refs/main`, else, when no ref is recorded, the
    newest snapshot. `need`:
    "weights" (`complete_snapshot`) or "config" (a `config.json` is enough)."""
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None

    def ok(p: Path) -> bool:
        return complete_snapshot(p) if need == "weights" else (p / "config.json").is_file()

    rev = revision or DEFAULT_REVISION
    ref = repo / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev if _COMMIT.fullmatch(rev) else None
    if commit and ok(snapshots / commit):
        return snapshots / commit
    if revision is not None or any((repo / "refs").glob("*")):
        return None  # the newest snapshot only stands in for `main` in a cache that records no branch at all
    found = [p for p in snapshots.iterdir() if ok(p)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def locate_model(where: str, base_dir: Path = Path("."), revision: str | None = None) -> str | HubModel:
    """Where a model name's checkpoint is, without the network: a `gs://` URL as given; a local folder
    (relative to `base_dir`); an `owner/name[@rev]` id's complete snapshot in the local HF cache; else the
    `HubModel` to download. `revision` (`[jax] model_revision`) applies when the name has no `@rev`.

    Raises:
        ModelNotFoundError: not a folder and not an `owner/name` id (the message names the folder).
    """
    if where.startswith("gs://"):
        return where
    folder = base_dir / Path(where).expanduser()
    if folder.is_dir():
        return str(folder.resolve())
    repo_id, rev = split_revision(where)
    rev = rev or revision
    if repo_id.count("/") == 1 and not repo_id.startswith((".", "/", "~")) and all(repo_id.split("/")):
        snapshot = find_in_hf_cache(repo_id, rev)
        return str(snapshot) if snapshot is not None else HubModel(repo_id, rev or DEFAULT_REVISION)
    raise ModelNotFoundError(f"model {where!r} not found: no folder {folder}, and it is not a Hugging Face "
                             "id (owner/name)")

