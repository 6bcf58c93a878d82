"""`-m` of `jaxrl eval run` and `jaxrl gepa run`: a local model served by jaxrl's own engine in this process,
or a remote OpenAI-compatible endpoint.

A `-m` that is an existing folder is local: a Hugging Face model folder, or a jaxrl run / checkpoint (its
base model with the checkpoint's LoRA, as `jaxrl serve` loads it: `jaxrl.cli.serve.load`). It is served on
127.0.0.1 (a free port) by the same server as `jaxrl serve` and a training run (`jaxrl.inference.server`:
chat completions with the model's chat template for classic environments and reflection, the token route
for v1 environments), with `max_tokens` clamped to the context as in a run. With `-b`, or when `-m` is
an alias of the endpoints file, it is a remote endpoint (`jaxrl.evaluation.endpoint.remote`), checked to
answer before anything is played; otherwise
a Hugging Face model id, downloaded into the HF cache when missing (`jaxrl.config.hub`) and
served locally.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from jaxrl.config.hub import resolve_model
from jaxrl.config.model_path import ModelNotFoundError
from jaxrl.evaluation.endpoint import Endpoint, EndpointError, check_reachable, load_aliases, remote


def is_local(model: str) -> bool:
    """Whether `-m model` names a local folder (a HF model folder or a jaxrl run / checkpoint)."""
    return Path(model).expanduser().is_dir()


def tokenizer_path(ref: str) -> str:
    """The tokenizer folder of a local `-m`: the model folder itself, or a checkpoint's run's tokenizer.

    Raises:
        EndpointError: `ref` is neither a model folder nor a run / checkpoint.
    """
    from jaxrl.cli import serve  # JAX: only a local model needs it
    from jaxrl.export import exporter

    if serve.is_hf_folder(ref):
        return str(Path(ref).expanduser().resolve())
    try:
        return str(exporter.find_source(ref).tokenizer_path)
    except exporter.SourceError as exc:
        raise EndpointError(f"-m {ref}: not a model folder (config.json + safetensors) nor a run's checkpoint: "
                            f"{exc}") from None


@contextlib.contextmanager
def served(ref: str, *, seq_len: int, decode_slots: int, console: Console) -> Iterator[Endpoint]:
    """jaxrl's server over the local model `ref` for the duration of the block.

    Raises:
        EndpointError: the model cannot be loaded or served (`jaxrl.cli.serve.ServeError`'s message).
    """
    from jaxrl.cli import serve  # JAX, and the HTTP server: only a local model needs them
    from jaxrl.inference.server import start_server

    tokenizer = tokenizer_path(ref)
    try:
        loaded = serve.load(ref, decode_slots=decode_slots, seq_len=seq_len)
    except serve.ServeError as exc:
        raise EndpointError(f"-m {ref}: {exc}") from None
    console.print(f"serving {loaded.description} in process ({decode_slots} decode slots, {seq_len} tokens)",
                  markup=False)
    try:
        handle = start_server(loaded.scheduler, chat_template=loaded.chat_template, clamp_max_tokens=True)
        try:
            yield Endpoint(handle.base_url, ref, tokenizer_path=tokenizer)
        finally:
            handle.stop()
    finally:
        loaded.scheduler.stop()


@contextlib.contextmanager
def endpoint(model: str, *, base_url: str | None, api_key_var: str | None, endpoints_path: str | Path,
             seq_len: int, decode_slots: int, console: Console) -> Iterator[Endpoint]:
    """The endpoint `-m model` names (see the module docstring), served for the block when local.

    Raises:
        EndpointError: a local model that cannot be served, or a remote one that cannot be resolved or
            reached (`check_reachable`: a run against an endpoint that is down stops before its first rollout).
    """
    aliases = load_aliases(endpoints_path)
    if base_url or model in aliases:
        found = remote(model, base_url, api_key_var, aliases)
        check_reachable(found)
        yield found
        return
    with served(local_folder(model), seq_len=seq_len, decode_slots=decode_slots, console=console) as ep:
        yield ep


def local_folder(model: str) -> str:
    """`model` as a local folder: itself when it is one, else a Hugging Face id's snapshot, downloaded
    into the HF cache when missing (`jaxrl.config.hub.resolve_model`).

    Raises:
        EndpointError: neither a folder nor a Hub model that can be had (the download's one-line reason).
    """
    if is_local(model):
        return model
    try:
        return resolve_model(model)
    except ModelNotFoundError as exc:
        raise EndpointError(f"-m {model!r} is not a local model folder or jaxrl run / checkpoint, not an alias of the "
                            f"endpoints file (-e), and no endpoint URL (-b) was given; as a Hugging Face model: "
                            f"{exc}") from None
