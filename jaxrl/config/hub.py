"""A model name's checkpoint, downloaded when it is not on this machine (`resolve_model`; where it is looked
for: `jaxrl.config.model_path`): from the Hugging Face Hub into the local HF cache with `huggingface_hub`, as
transformers and vLLM do: `HF_TOKEN` (or the token `hf auth login` stored), `HF_ENDPOINT`,
`HF_HUB_CACHE` / `HF_HOME` and `HF_HUB_OFFLINE` are honoured, and a progress bar is shown
(`HF_HUB_DISABLE_PROGRESS_BARS=1` hides it). Only the files a Qwen3 checkpoint needs are fetched
(`ALLOW_PATTERNS`). Every failure is one `ModelNotFoundError` line saying why (missing or gated repo,
bad token, unknown revision, no network, too little disk).

Several processes on one host (multi-host JAX runs start one per host, but tests and GPU boxes may start
more) download once: the first takes a file lock in the cache folder, the others wait on it and then find
the snapshot in the cache. Hosts with separate disks each download their own copy; a `gs://` copy of the
checkpoint (`[jax] model_path`) is read by all hosts instead.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from jaxrl.config.model_path import (
    HubModel,
    ModelNotFoundError,
    find_in_hf_cache,
    hf_cache_dir,
    hub_endpoint,
    hub_offline,
    locate_model,
)

ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
]
"""The files of a Qwen3 checkpoint that jaxrl reads: architecture, generation defaults, weights and their
index, tokenizer and chat template (no PyTorch `.bin`, no ONNX or GGUF copies)."""


def resolve_model(where: str, base_dir: Path = Path("."), revision: str | None = None) -> str:
    """The checkpoint location for a model name (`locate_model`), downloading a `HubModel` into the HF
    cache first (`download`: one process per host downloads, the others wait).

    Raises:
        ModelNotFoundError: not found, or the download failed (one line saying why).
    """
    found = locate_model(where, base_dir, revision)
    if isinstance(found, HubModel):
        try:
            return str(download(found))
        except ModelNotFoundError as exc:  # a mistyped local folder reads as an owner/name id too
            raise ModelNotFoundError(f"{exc} (and there is no folder {base_dir / where})") from None
    return found


def download(model: HubModel) -> Path:
    """Download `model`'s `ALLOW_PATTERNS` files into the HF cache and return the snapshot folder. The
    repo's listing is read first (a dry run) so that too little disk stops it before any byte is written.

    Raises:
        ModelNotFoundError: `HF_HUB_OFFLINE` is set, the repo or revision is missing, private or gated,
            the token is not valid, the Hub cannot be reached, the files need more than the free disk, or
            the repo holds no safetensors weights.
    """
    from filelock import FileLock

    where = f"{model.repo_id}@{model.revision}"
    if hub_offline():
        raise ModelNotFoundError(model.offline_refusal())
    cache = hf_cache_dir()
    (cache / ".locks").mkdir(parents=True, exist_ok=True)
    with FileLock(cache / ".locks" / f"jaxrl--{model.repo_id.replace('/', '--')}.lock"):
        if (found := find_in_hf_cache(model.repo_id, model.revision)) is not None:
            return found  # another process on this host downloaded it while this one waited
        folder = Path(_fetch(model, cache))
    if (found := find_in_hf_cache(model.repo_id, model.revision)) is None:
        raise ModelNotFoundError(f"model {where} on {hub_endpoint()} has no safetensors weights beside its "
                                 f"config.json (downloaded into {folder})")
    return found


def download_config(model: HubModel) -> Path:
    """Only `config.json` of `model` (what `jaxrl compile` needs), into the HF cache; its local path.

    Raises:
        ModelNotFoundError: as `download`, or the repo has no `config.json`.
    """
    from huggingface_hub import hf_hub_download

    if hub_offline():
        raise ModelNotFoundError(f"{model.repo_id}@{model.revision}: config.json is not in the Hugging Face "
                                 f"cache {hf_cache_dir()} and HF_HUB_OFFLINE is set")
    try:
        return Path(hf_hub_download(model.repo_id, "config.json", revision=model.revision,
                                    cache_dir=hf_cache_dir(), endpoint=hub_endpoint()))
    except Exception as exc:
        raise ModelNotFoundError(explain(exc, model)) from None


def _fetch(model: HubModel, cache: Path) -> str:
    from huggingface_hub import snapshot_download

    args = dict(revision=model.revision, cache_dir=cache, endpoint=hub_endpoint(), allow_patterns=ALLOW_PATTERNS)
    try:
        files = snapshot_download(model.repo_id, dry_run=True, **args)
        need = sum(f.file_size or 0 for f in files if f.will_download)
        free = shutil.disk_usage(cache).free
        if need > free:
            raise ModelNotFoundError(f"model {model.repo_id}@{model.revision} needs {need / 1e9:.2f} GB "
                                     f"({len(files)} files) but {cache} has {free / 1e9:.2f} GB free; free some "
                                     "space or set HF_HUB_CACHE to a larger disk")
        print(f"jaxrl: downloading {model.repo_id}@{model.revision} ({len(files)} files, {need / 1e9:.2f} GB) "
              f"from {hub_endpoint()} into {cache}", file=sys.stderr, flush=True)
        return snapshot_download(model.repo_id, **args)
    except ModelNotFoundError:
        raise
    except Exception as exc:
        raise ModelNotFoundError(explain(exc, model)) from None


def explain(exc: BaseException, model: HubModel) -> str:
    """One line for a failed Hub call: `huggingface_hub`'s error types (a dry run's `DryRunError` carries
    the cause), HTTP status, and connection errors, named in the user's terms."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import (
        DryRunError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, DryRunError) and exc.__cause__ is not None:
        exc = exc.__cause__
    where, url = f"{model.repo_id}@{model.revision}", hub_endpoint()
    token = "HF_TOKEN" if get_token() else None
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, GatedRepoError):
        why = (f"{model.repo_id} is gated: ask for access at {url}/{model.repo_id} and set HF_TOKEN to a token "
               "of an account that has it")
    elif isinstance(exc, RepositoryNotFoundError):
        why = (f"no repository {model.repo_id} on {url}, or it is private and "
               + ("the token (HF_TOKEN or `hf auth login`) has no access to it" if token
                  else "no token is set (set HF_TOKEN or run `hf auth login`)") + f" (HTTP {status})")
    elif isinstance(exc, RevisionNotFoundError):
        why = f"{model.repo_id} has no revision {model.revision!r} on {url}"
    elif isinstance(exc, RemoteEntryNotFoundError):
        why = f"{model.repo_id} at {model.revision} has no config.json on {url}"
    elif isinstance(exc, HfHubHTTPError) and status == 401:
        why = f"the token (HF_TOKEN or `hf auth login`) is not valid on {url} (HTTP 401)"
    elif isinstance(exc, HfHubHTTPError) and status == 403:
        why = f"the token is not allowed to read {model.repo_id} on {url} (HTTP 403)"
    elif isinstance(exc, HfHubHTTPError):
        why = f"{url} answered HTTP {status}"
    elif isinstance(exc, LocalEntryNotFoundError | ConnectionError | OSError) or "Connect" in type(exc).__name__ \
            or "Timeout" in type(exc).__name__:
        why = f"cannot reach {url} ({type(exc).__name__}); check the network, or set HF_ENDPOINT"
        if isinstance(exc, OSError) and exc.errno == 28:
            why = f"the disk of {hf_cache_dir()} is full (set HF_HUB_CACHE to a larger disk)"
    else:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return f"model {where}: cannot download it: {why}"
