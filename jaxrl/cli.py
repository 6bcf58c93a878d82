"""The `jaxrl` command: `validate`, `init` and `run` a Hosted Training TOML file.

`validate` and `init` import only the config module (no JAX), so they answer in well under a second.
Config problems exit with status 2 and one line per problem, never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from jaxrl.config import (
    STARTER_TOML,
    ConfigError,
    RunConfig,
    load_config,
    load_env_file,
    resolve_model_path,
    unsupported_fields,
)

app = typer.Typer(help="JAX RL trainer for LLMs, driven by Prime Hosted Training TOML files.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
# Messages quote TOML tables like [jax]; rich must print them as they are, not read them as markup.
out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)

ConfigPath = Annotated[Path, typer.Argument(help="Run config (TOML).", show_default=False)]


def _fail(message: str) -> typer.Exit:
    err.print(message, markup=False)
    return typer.Exit(code=2)


def _load(path: Path) -> RunConfig:
    """The config, its `env_file`s parsed as a check; exit 2 listing the problems found."""
    try:
        cfg = load_config(path)
        load_env_file(cfg.env_file)
        return cfg
    except ConfigError as exc:
        raise _fail(str(exc)) from None


@app.command()
def validate(path: ConfigPath) -> None:
    """Check a config and print it with every default filled in (JSON on stdout, notes on stderr)."""
    cfg = _load(path)
    out.print_json(data=cfg.model_dump(mode="json"))
    for field in unsupported_fields(cfg):
        err.print(f"warning: not supported yet: {field}", style="yellow", markup=False)
    try:
        err.print(f"model weights: {resolve_model_path(cfg)}", markup=False)
    except ConfigError as exc:
        err.print(f"note: `jaxrl run` would stop here: {exc}", style="yellow", markup=False)


@app.command()
def init(
    path: Annotated[Path, typer.Argument(help="File to write.")] = Path("rl.toml"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented starter config (required keys set, optional ones commented out)."""
    if path.exists() and not force:
        raise _fail(f"{path} already exists; pass --force to overwrite it")
    path.write_text(STARTER_TOML, encoding="utf-8")
    out.print(f"wrote {path}; check it with `jaxrl validate {path}`", markup=False)


@app.command()
def run(path: ConfigPath) -> None:
    """Train: load the config, refuse fields not built yet, then start the run."""
    cfg = _load(path)
    if unsupported := unsupported_fields(cfg):
        lines = [f"not supported yet: {field}" for field in unsupported]
        raise _fail(f"{path}: refusing to start; remove these settings or set them to their defaults:\n"
                    + "\n".join(lines))
    from jaxrl import distributed  # heavy (JAX), as is the runner: kept off the validate/init path
    from jaxrl.recovery import RunError
    from jaxrl.runner import run as run_training

    try:  # join a multi-host run (JAX_* variables, GCP Batch, Cloud TPU pod) before any device is touched
        distributed.initialize(distributed.from_env())
    except ValueError as exc:
        raise _fail(f"jaxrl run: {exc}") from None

    try:
        run_training(cfg)  # it loads the `env_file` secrets into the environment
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    except RunError as exc:  # a checkpoint that cannot be written, failing environments, preemption
        err.print(f"jaxrl run: {exc}", markup=False)
        raise typer.Exit(code=exc.exit_code) from None


def _parse_mesh(text: str) -> dict[str, int]:
    from jaxrl.sharding import MESH_AXES

    mesh = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        axis, _, size = part.partition("=")
        if axis.strip() not in MESH_AXES or not size.strip().isdigit() or int(size) < 1:
            raise _fail(f"--mesh: {part!r} is not AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)}")
        mesh[axis.strip()] = int(size)
    return mesh


@app.command()
def models(
    mesh: Annotated[str, typer.Option(help="Mesh to size shards for, e.g. 'fsdp=8,expert=4'.")] = "",
    config: Annotated[Path | None, typer.Option(help="Take the mesh and dtype from this run config.")] = None,
    dtype: Annotated[str, typer.Option(help="Weight dtype: bfloat16 or float32.")] = "bfloat16",
    lora_rank: Annotated[int, typer.Option(help="LoRA rank for the adapter + AdamW state column.")] = 16,
) -> None:
    """List the supported architectures and Hosted Training models: parameters (total and active per
    token), and the bytes each device holds for the weights and for LoRA + AdamW state on a mesh."""
    import math

    import jax
    from rich.table import Table

    from jaxrl import catalog, model
    from jaxrl.sharding import bytes_per_device

    shape = _parse_mesh(mesh)
    if config is not None:
        cfg = _load(config)
        shape, dtype, lora_rank = cfg.jax.mesh.model_dump(), cfg.jax.dtype, cfg.jax.lora_rank
    if dtype not in ("bfloat16", "float32"):
        raise _fail(f"--dtype: {dtype!r} is not bfloat16 or float32")
    itemsize = 2 if dtype == "bfloat16" else 4
    devices = math.prod(shape.values()) if shape else 1
    out.print("architectures: " + ", ".join(f"{k} ({v})" for k, v in catalog.ARCHITECTURES.items()))
    table = Table(title=f"Hosted Training models on mesh {shape or {'fsdp': 1}} ({devices} devices), {dtype}")
    for col in ("model", "params", "active/token", "weights/device", f"LoRA r{lora_rank}+AdamW/device"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, hf_config in catalog.HOSTED_MODELS.items():
        mcfg = model.ModelConfig.from_hf(hf_config)
        dims = mcfg.dims()
        specs = model.param_specs(mcfg)
        total = sum(math.prod(s.shape(dims)) for s in jax.tree.leaves(specs, is_leaf=model.is_spec))
        inactive = 3 * mcfg.hidden_size * mcfg.moe_intermediate_size * (mcfg.num_experts - mcfg.num_experts_per_tok)
        active = total - inactive * len(mcfg.moe_layers)
        targets = tuple(model.LORA_TARGETS)
        lora = bytes_per_device(model.lora_specs(mcfg, lora_rank, targets), {**dims, "R": lora_rank}, shape, 4)
        table.add_row(name, f"{total / 1e9:.2f} B", f"{active / 1e9:.2f} B",
                      f"{bytes_per_device(specs, dims, shape, itemsize) / 2**30:.2f} GiB",
                      f"{3 * lora / 2**30:.2f} GiB")
    Console(width=max(out.width, 130), highlight=False).print(table)
    out.print("A model name in a config is found as a local folder, a gs:// URL, or an id in the local "
              f"Hugging Face cache ({catalog.hf_cache_dir()}); nothing is downloaded.", markup=False)


@app.command("export")
def export_(
    ref: Annotated[str, typer.Argument(metavar="RUN_OR_CHECKPOINT", show_default=False,
                                       help="A run folder (<output_dir>/<name>), its checkpoints folder, or one "
                                            "step's folder (a gs:// one with --config).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder to write.", show_default=False)],
    merged: Annotated[bool, typer.Option("--merged", help="A HF checkpoint, LoRA folded in (the default).")] = False,
    adapter: Annotated[bool, typer.Option("--adapter", help="A PEFT LoRA adapter folder instead.")] = False,
    step: Annotated[int | None, typer.Option(help="Checkpoint step. Default: the step folder's, else the latest.",
                                             show_default=False)] = None,
    config: Annotated[Path | None, typer.Option(help="The run's TOML, for a checkpoint whose run folder has no "
                                                     "config.json.", show_default=False)] = None,
) -> None:
    """Write a run's trained model to Hugging Face format: merged weights, or a PEFT adapter."""
    if merged and adapter:
        raise _fail("jaxrl export: pass --merged or --adapter, not both")
    from jaxrl import export as exporting  # heavy (JAX): kept off the validate/init path

    try:
        source = exporting.find_source(ref, step, config)
        exporting.export(source, out_dir, adapter=adapter)
    except exporting.ExportError as exc:
        raise _fail(f"jaxrl export: {exc}") from None
    kind = "PEFT adapter" if adapter else "merged model"
    out.print(f"wrote the {kind} of checkpoint step {source.step} ({source.checkpoint_dir}) to {out_dir}",
              markup=False)


@app.command()
def serve(
    ref: Annotated[str, typer.Argument(metavar="MODEL_OR_CHECKPOINT", show_default=False,
                                       help="A HF model folder (config.json + safetensors), or a run folder, its "
                                            "checkpoints folder or one step's (as `jaxrl export` takes).")],
    host: Annotated[str, typer.Option(help="Address to bind; anything but loopback should come with an API "
                                           "key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind (0: a free one).")] = 8000,
    decode_slots: Annotated[int, typer.Option(help="Sequences decoded at once; more requests wait in the queue.")] = 32,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence, prompt and completion.")] = 4096,
    api_key_env: Annotated[str | None, typer.Option(help="Environment variable holding the API key clients must "
                                                         "send as 'Authorization: Bearer <key>'.",
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
    (jaxrl.jetstream). Ctrl-C stops it."""
    import os
    import signal
    import threading
    import time

    if dtype not in (None, "float32", "bfloat16"):
        raise _fail(f"--dtype: {dtype!r} is not float32 or bfloat16")
    if max_pending < 1:
        raise _fail(f"--max-pending must be >= 1, got {max_pending}")
    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise _fail(f"--api-key-env: the environment variable {api_key_env} is not set or empty")
    shape = _parse_mesh(mesh)
    if jetstream:
        _check_jetstream(api_key, port)
    from jaxrl import serve as serving  # heavy (JAX): kept off the validate/init path
    from jaxrl.server import start_server

    try:
        loaded = serving.load(ref, name=name, decode_slots=decode_slots, seq_len=seq_len, step=step, config=config,
                              dtype=dtype, mesh_shape=shape)
    except serving.ServeError as exc:
        raise _fail(f"jaxrl serve: {exc}") from None
    err.print(f"serving {loaded.description}", markup=False)
    scheduler = loaded.scheduler
    try:
        if warmup:
            t0 = time.perf_counter()
            buckets = serving.warmup(scheduler)
            err.print(f"compiled {buckets} prompt buckets + decode in {time.perf_counter() - t0:.1f}s", markup=False)
        if jetstream:
            handle, where = _start_jetstream(loaded, host, port), f"grpc://{host}:{port} (JetStream Orchestrator)"
        else:
            try:
                handle = start_server(scheduler, host, port, chat_template=loaded.chat_template, api_key=api_key,
                                      max_pending=max_pending)
            except OSError as exc:
                raise _fail(f"jaxrl serve: cannot listen on {host}:{port}: {exc}") from None
            where = f"{handle.base_url} (chat: {handle.base_url}/chat/completions)"
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


def _check_jetstream(api_key: str | None, port: int) -> None:
    """Refuse what `serve --jetstream` cannot do, before the model loads."""
    if api_key is not None:
        raise _fail("--jetstream: JetStream's gRPC server has no API keys; drop --api-key-env")
    if port == 0:
        raise _fail("--jetstream needs a --port other than 0 (JetStream's server does not say which port it got)")
    try:
        import jaxrl.jetstream  # noqa: F401 - about 5 s (TensorFlow): paid here, before the model loads
    except ImportError as exc:
        raise _fail(f"--jetstream needs the jetstream extra (pip install 'jaxrl[jetstream]'): {exc}") from None


def _start_jetstream(loaded: Any, host: str, port: int) -> Any:
    """JetStream's gRPC server over the loaded engine and weights (`jaxrl.jetstream.serve`), with the
    served tokenizer and its end-of-turn ids; `stop()` ends it."""
    from jaxrl import jetstream as js

    template, scheduler = loaded.chat_template, loaded.scheduler
    try:
        tokenizer = js.HFTokenizer(template.tokenizer.backend_tokenizer, template.stop_token_ids)
        return js.serve(js.JetStreamEngine(scheduler.engine, scheduler.params, tokenizer), port, host)
    except ValueError as exc:
        raise _fail(f"jaxrl serve --jetstream: {exc}") from None
    except OSError as exc:
        raise _fail(f"jaxrl serve: cannot listen on {host}:{port}: {exc}") from None
