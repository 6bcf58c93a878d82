"""`jaxrl serve`: a model or a run's checkpoint served over HTTP (OpenAI chat completions, vLLM's token route)
or JetStream's gRPC server, until Ctrl-C. Its options are checked before the model loads
(`jaxrl.cli.serve_options`); loading and warming up the model is `jaxrl.cli.serve`'s.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from jaxrl.cli import serve_options
from jaxrl.cli.common import err, fail, out, parse_mesh


def serve(
    ref: Annotated[str, typer.Argument(metavar="MODEL_OR_CHECKPOINT", show_default=False,
                                       help="A HF model folder (config.json + safetensors), a Hugging Face id "
                                            "(owner/name[@revision]: the HF cache, else downloaded), or a run "
                                            "folder, its checkpoints folder or one step's (as `jaxrl export` "
                                            "takes).")],
    host: Annotated[str, typer.Option(help="Address to bind; anything but loopback should come with an API "
                                           "key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind (0: a free one).")] = 8000,
    decode_slots: Annotated[int, typer.Option(help="Sequences decoded at once; more requests wait in the queue.")] = 32,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence, prompt and completion.")] = 4096,
    decode_steps_per_dispatch: Annotated[int | None, typer.Option(
        min=1, show_default=False,
        help="Decode steps the engine runs in one program between the host's looks at it (each slot stops on "
             "the device at its stop token or length), as a run's `[jax] decode_steps_per_dispatch`; 1: one "
             "step a program. Default: the engine's, 8.")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="Environment variable holding the API key clients must "
                                                         "send as `Authorization: Bearer <key>`.",
                                                    show_default=False)] = None,
    max_pending: Annotated[int, typer.Option(help="Requests queued or running at once; more get a 503.")] = 1024,
    name: Annotated[str | None, typer.Option(help="Model name for clients and /v1/models. Default: "
                                                  "MODEL_OR_CHECKPOINT as given.", show_default=False)] = None,
    step: Annotated[int | None, typer.Option(help="Checkpoint step (default: the latest).", show_default=False)] = None,
    config: Annotated[Path | None, typer.Option(help="The run's TOML, for a checkpoint without its run folder.",
                                                show_default=False)] = None,
    dtype: Annotated[str | None, typer.Option(help="Weights: float32 or bfloat16. Default: the run's, else "
                                                   "float32.", show_default=False)] = None,
    mesh: Annotated[str, typer.Option(help="Mesh, e.g. 'tensor=4'. Default: every device on fsdp.")] = "",
    warmup: Annotated[bool, typer.Option(help="Compile every prompt length bucket before serving.")] = True,
    jetstream: Annotated[bool, typer.Option(help="Serve over JetStream's gRPC server instead (the jaxrl[jetstream] "
                                                 "extra): greedy, token ids and text back, no logprobs.")] = False,
) -> None:
    """Serve a model or a run's checkpoint over HTTP: OpenAI chat completions (streaming too), vLLM's
    token-in/token-out route, /v1/models and /health; or, with --jetstream, over JetStream's gRPC server
    (jaxrl.inference.jetstream). Ctrl-C stops it."""
    try:
        api_key = serve_options.check(dtype, max_pending, api_key_env, jetstream, port)
    except serve_options.OptionError as exc:
        raise fail(str(exc)) from None
    shape = parse_mesh(mesh)
    from jaxrl.cli import serve as serving  # heavy (JAX): kept off the validate/init path
    from jaxrl.inference.server import start_server  # starlette and uvicorn: only a command that serves

    try:
        loaded = serving.load(ref, name=name, decode_slots=decode_slots, seq_len=seq_len, step=step, config=config,
                              dtype=dtype, mesh_shape=shape, decode_steps_per_dispatch=decode_steps_per_dispatch)
    except serving.ServeError as exc:
        raise fail(f"jaxrl serve: {exc}") from None
    err.print(f"serving {loaded.description}", markup=False)
    scheduler = loaded.scheduler
    try:
        if warmup:
            t0 = time.perf_counter()
            buckets = serving.warmup(scheduler)
            err.print(f"compiled {buckets} prompt buckets + decode in {time.perf_counter() - t0:.1f}s", markup=False)
        try:
            if jetstream:
                handle = serving.start_jetstream(loaded, host, port)
                where = f"grpc://{host}:{port} (JetStream Orchestrator)"
            else:
                handle = start_server(scheduler, host, port, chat_template=loaded.chat_template, api_key=api_key,
                                      max_pending=max_pending)
                where = f"{handle.base_url} (chat: {handle.base_url}/chat/completions)"
        except serving.ServeError as exc:  # from start_jetstream only
            raise fail(f"jaxrl serve --jetstream: {exc}") from None
        except OSError as exc:
            raise fail(f"jaxrl serve: cannot listen on {host}:{port}: {exc}") from None
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
            err.print(f"warning: serving on {host} without an API key (--api-key-env)", style="yellow", markup=False)
        out.print(f"serving {scheduler.model_name!r} at {where}; Ctrl-C stops", markup=False)
        while not stop.wait(0.5):
            pass
        err.print("stopping", markup=False)
        handle.stop()
    finally:
        scheduler.stop()
