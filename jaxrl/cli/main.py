"""The `jaxrl` command: `validate`, `init` and `run` a Hosted Training TOML file (`sft` one with `[jax.sft]`,
supervised fine-tuning: `jaxrl.run.sft`); manage local runs as
`prime rl` manages hosted ones (`list`, `logs`, `stop`, `delete`, `checkpoints`, `plot`: `jaxrl.cli.manage`);
`models`, `compile` (a run's programs compiled for a TPU slice: `jaxrl.compile`), `export` (`jaxrl.cli.export`)
and `serve`;
`eval run` (`jaxrl.cli.evaluate`), `gepa run` (`jaxrl.cli.gepa`).

`validate`, `init` and the run management commands (but `checkpoints`) import no JAX, so they answer in
well under a second.
Config problems exit with status 2 and one line per problem, never a traceback.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from jaxrl.cli import serve_options
from jaxrl.cli.evaluate import eval_app
from jaxrl.cli.export import export
from jaxrl.cli.gepa import gepa_app
from jaxrl.cli.manage import manage_app
from jaxrl.cli.train import quiet_libraries, train
from jaxrl.compile.slices import slice_names
from jaxrl.config.env_file import load_env_file
from jaxrl.config.model_path import hub_offline
from jaxrl.config.schema import ConfigError, RunConfig, load_config, locate_model_path, no_effect_notes
from jaxrl.config.starter import STARTER_TOML
from jaxrl.parallel.platform import skip_absent_tpu

# Markdown help: docstrings' line breaks are joined into paragraphs in the command list too (rich mode keeps
# them there, mid-sentence), and `[jax]` in backticks stays text instead of being read as rich markup.
app = typer.Typer(help="JAX RL trainer for LLMs, driven by Prime Hosted Training TOML files.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")
# Messages quote TOML tables like [jax]; rich must print them as they are, not read them as markup.
out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)

app.add_typer(eval_app, name="eval")
app.add_typer(gepa_app, name="gepa")


@app.callback()
def _before_every_command() -> None:
    # Before any command imports JAX: no libtpu probe (and its console lines) on a host without TPU chips.
    skip_absent_tpu()


ConfigPath = Annotated[Path, typer.Argument(help="Run config (TOML).", show_default=False)]


def _fail(message: str) -> typer.Exit:
    err.print(message, markup=False)
    return typer.Exit(code=2)


def _load(path: Path) -> RunConfig:
    """The config, its `env_file`s parsed as a check; exit 2 listing the problems found. Prints a note
    for each Hosted Training field that has no effect here."""
    try:
        cfg = load_config(path)
        load_env_file(cfg.env_file, cfg.source)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    for note in no_effect_notes(cfg):
        err.print(f"note: {path}: {note}", style="yellow", markup=False)
    return cfg


@app.command()
def validate(path: ConfigPath) -> None:
    """Check a config and print it with every default filled in (JSON on stdout, notes on stderr)."""
    cfg = _load(path)
    out.print_json(data=cfg.model_dump(mode="json"))
    try:
        found = locate_model_path(cfg)
        err.print(f"model weights: {found if isinstance(found, str) else found.describe()}", markup=False)
        if not isinstance(found, str) and hub_offline():
            err.print("note: `jaxrl run` would stop here: HF_HUB_OFFLINE is set", style="yellow", markup=False)
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
def run(
    path: ConfigPath,
    detach: Annotated[bool, typer.Option("--detach", help="Run in the background (a new session, so closing the "
                                                          "terminal does not stop it); output to the run "
                                                          "folder's console.log.")] = False,
    bench: Annotated[bool, typer.Option("--bench", help="Benchmark instead: the engine's and the trainer's "
                                                        "throughput on synthetic rollouts (random prompts, "
                                                        "max_tokens each, no environment), a few steps, "
                                                        "nothing written; a JSON report on the last line "
                                                        "(jaxrl.run.bench).")] = False,
) -> None:
    """Train: load the config, then start the run (in the foreground, or in
    the background with --detach). Its console output is also kept in `<output_dir>/<name>/console.log`."""
    if bench:
        _bench(path)
        return
    _start(path, detach, "run")


def _bench(path: Path) -> None:
    """`jaxrl run --bench`: the report of `jaxrl.run.bench` on stdout, its last line JSON; exit 2 on a config
    problem (the model cannot be loaded, the mesh does not fit)."""
    import json

    cfg = _load(path)
    if cfg.jax.sft is not None:
        raise _fail(f"{path}: jax.sft: --bench measures an RL config's engine and trainer")
    quiet_libraries()
    from jaxrl.run.bench import bench

    try:
        report = bench(cfg, out)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    out.print(json.dumps(report), markup=False, soft_wrap=True)


@app.command()
def sft(
    path: ConfigPath,
    detach: Annotated[bool, typer.Option("--detach", help="Run in the background, as `jaxrl run --detach`.")] = False,
) -> None:
    """Supervised fine-tuning: train the LoRA on the chat JSONL that the config's `[jax.sft]` names
    (README, "Supervised fine-tuning"); a run like `jaxrl run`'s (checkpoints, adapters, metrics, eval,
    `--detach`), whose checkpoint an RL config's `checkpoint_id` starts from."""
    _start(path, detach, "sft")


def _start(path: Path, detach: bool, command: str) -> None:
    """`jaxrl run` or `jaxrl sft` (`command`): the config must be of that kind (`[jax.sft]` set for sft
    only); then the run, in the foreground or detached."""
    import os

    from jaxrl.cli import runs
    from jaxrl.run.layout import run_dir_of, run_name

    cfg = _load(path)
    if command == "run" and cfg.jax.sft is not None:
        raise _fail(f"{path}: jax.sft: this is an SFT config; train it with `jaxrl sft {path}`")
    if command == "sft" and cfg.jax.sft is None:
        raise _fail(f"{path}: jax.sft: required by `jaxrl sft` (the data to train on); an RL config runs with "
                    f"`jaxrl run {path}`")
    run_dir, name = run_dir_of(cfg), run_name(cfg)

    def refuse_if_running() -> None:
        pid = runs.running_pid(run_dir)
        if pid is not None and pid != os.getpid():  # a detached run's own process finds itself recorded
            raise _fail(f"jaxrl {command}: run {name} is already running (pid {pid}) in {run_dir}; follow it "
                        f"with `jaxrl logs {name} --follow`, stop it with `jaxrl stop {name}`")

    with runs.claimed(run_dir):  # two commands of one run at once: the second finds the first recorded
        refuse_if_running()
        if detach:
            pid = runs.detach(path.resolve(), run_dir, command)
    if detach:
        where = "" if cfg.jax.output_dir == runs.DEFAULT_RUNS_DIR else f" --runs-dir {cfg.jax.output_dir}"
        out.print(f"started run {name} in the background (pid {pid}); its folder is {run_dir}\n"
                  f"follow it:  jaxrl logs {name}{where} --follow\n"
                  f"stop it:    jaxrl stop {name}{where}", markup=False)
        return
    quiet_libraries()
    from jaxrl.parallel import distributed  # heavy (JAX), as is the runner: kept off the validate/init path

    try:  # join a multi-host run (JAX_* variables, GCP Batch, Cloud TPU pod) before any device is touched
        distributed.initialize(distributed.from_env())
    except ValueError as exc:
        raise _fail(f"jaxrl {command}: {exc}") from None
    if not distributed.is_primary():  # process 0 alone keeps the run's record and log
        train(cfg)
        return
    with runs.claimed(run_dir):  # checked again: not held while JAX starts, which waits for the other hosts
        refuse_if_running()
        previous = runs.start(run_dir, path.resolve())
    if runs.stdout_is(run_dir / runs.LOG):  # detached: stdout and stderr already go to the log
        train(cfg, run_dir=run_dir, previous=previous)
        return
    with (run_dir / runs.LOG).open("a", encoding="utf-8") as log:
        log.write(f"--- jaxrl {command} {path.resolve()} {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
        train(cfg, runs.TeeConsole(log, soft_wrap=True), log, run_dir, previous)


def _parse_mesh(text: str) -> dict[str, int]:
    from jaxrl.parallel.sharding import MESH_AXES

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
    token), and the bytes each device holds on a mesh for the weights, for LoRA + AdamW state, and for full
    fine-tuning (`[jax] finetune = "full"`): float32 master weights and two AdamW moments (12 bytes a
    parameter) plus, in bfloat16, the engine's copy (a KL reference adds one more copy in the dtype), a
    paged KV pool's bytes per cached token (a pool of T tokens per engine: T x that; `jaxrl compile` sizes
    the pool that fits beside the run), and the model's longest context and the longest compiled to train
    at a Hosted batch on a slice (`catalog.COMPILED_CONTEXT`; `jaxrl compile` finds it for a run)."""
    import math

    import jax
    from rich.table import Table

    from jaxrl.compile.pool import token_bytes
    from jaxrl.config.model_path import hf_cache_dir, hub_endpoint
    from jaxrl.model import catalog, modules, qwen3
    from jaxrl.parallel.sharding import bytes_per_device
    from jaxrl.parallel.spec import is_spec

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
    for col in ("model", "params", "active/token", "weights/device", f"LoRA r{lora_rank}+AdamW/device",
                "full FT/device", "KV pool/token/device", "context: model / trains (compiled)"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, hf_config in catalog.HOSTED_MODELS.items():
        mcfg = qwen3.ModelConfig.from_hf(hf_config)
        dims = mcfg.dims()
        specs = modules.param_specs(mcfg)
        total = sum(math.prod(s.shape(dims)) for s in jax.tree.leaves(specs, is_leaf=is_spec))
        inactive = 3 * mcfg.hidden_size * mcfg.moe_intermediate_size * (mcfg.num_experts - mcfg.num_experts_per_tok)
        active = total - inactive * len(mcfg.moe_layers)
        targets = tuple(qwen3.LORA_TARGETS)
        lora = bytes_per_device(modules.lora_specs(mcfg, lora_rank, targets), {**dims, "R": lora_rank}, shape, 4)
        weights = bytes_per_device(specs, dims, shape, itemsize)
        full = 3 * bytes_per_device(specs, dims, shape, 4) + (weights if itemsize != 4 else 0)
        trains = catalog.compiled_context(name)
        trains = "-" if trains is None else f"{trains[0]:,} on {trains[1]} ({trains[2]}, {trains[3]} slots)"
        table.add_row(name, f"{total / 1e9:.2f} B", f"{active / 1e9:.2f} B", f"{weights / 2**30:.2f} GiB",
                      f"{3 * lora / 2**30:.2f} GiB", f"{full / 2**30:.2f} GiB",
                      f"{token_bytes(mcfg, shape, itemsize) / 2**10:.1f} KiB",
                      f"{mcfg.max_position_embeddings:,} / {trains}")
    Console(width=max(out.width, 200), highlight=False).print(table)
    out.print("A model name in a config is found as a local folder, a gs:// URL, or an id in the local "
              f"Hugging Face cache ({hf_cache_dir()}); an id that is not there is downloaded from the Hub "
              f"({hub_endpoint()}) by `jaxrl run`.", markup=False)


@app.command("compile")
def compile_(
    path: ConfigPath,
    topology: Annotated[str, typer.Option(help="TPU slice, as gcloud names it: " + slice_names()
                                               + "; or a topology such as v5p:4x4x4.", show_default=False)],
    json_file: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON here.")] = None,
    depths: Annotated[str, typer.Option(help="Compile at two reduced depths, e.g. '2,3' ('3,4' for INTELLECT-3: "
                                             "its dense layer + 2), and extrapolate; default: full depth.")] = "",
    engine_hosts: Annotated[int | None, typer.Option(help="Hosts per rollout engine; default: [jax] engine_hosts, else "
                                                          "the run's fit rule (one host unless the engine's "
                                                          "weights and KV cache beside the trainer's state "
                                                          "exceed 90% of its HBM).")] = None,
    cost: Annotated[bool, typer.Option(help="Also report the compiler's FLOPs and bytes per layer of the train "
                                            "step, the prefill and the decode step (six more compiles, layers "
                                            "unrolled at depths 2 and 3; a GLM with more dense layers: their "
                                            "count + 1 and + 2), their ratio to the ideal, and a train-step "
                                            "roofline from them.")] = True,
    context: Annotated[bool, typer.Option(help="Also find the longest sequences the slice trains at this batch "
                                               "(powers of two, bisected, each train step compiled).")] = True,
) -> None:
    """Compile the run's train step, prefill and decode programs for a TPU slice (on any machine: libtpu,
    no TPU) with abstract weights, and print per chip: weights, LoRA + optimizer, KV cache, temporaries,
    the total against the chip's HBM (fits or not, and what to change), roofline step times, the compiler's
    cost per layer against the ideal, and the longest sequences the slice trains. Without [jax]
    micro_batch_size, the largest micro-batch that fits is found by compiling (as a run on accelerators
    does). Exit 1 when it does not fit."""
    import json

    from jaxrl.compile.programs import ProgramTooLarge
    from jaxrl.compile.report import compile_run

    cfg = _load(path)
    parts = [p.strip() for p in depths.split(",") if p.strip()]
    if parts and (len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or parts[0] == parts[1]):
        raise _fail(f"--depths: {depths!r} is not two different layer counts, e.g. '2,3'")
    try:
        report = compile_run(cfg, topology, tuple(int(p) for p in parts) or None, engine_hosts, cost, context)
    except ProgramTooLarge as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(code=1) from None
    except (ConfigError, ValueError, RuntimeError) as exc:
        raise _fail(str(exc)) from None
    out.print(report.text(), markup=False)
    if json_file is not None:
        json_file.write_text(json.dumps(report.to_json(), indent=1))
    if not report.fits:
        raise typer.Exit(code=1)


app.command("export")(export)


@app.command()
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
    import signal
    import threading
    import time

    try:
        api_key = serve_options.check(dtype, max_pending, api_key_env, jetstream, port)
    except serve_options.OptionError as exc:
        raise _fail(str(exc)) from None
    shape = _parse_mesh(mesh)
    from jaxrl.cli import serve as serving  # heavy (JAX): kept off the validate/init path
    from jaxrl.inference.server import start_server

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
        try:
            if jetstream:
                handle = serving.start_jetstream(loaded, host, port)
                where = f"grpc://{host}:{port} (JetStream Orchestrator)"
            else:
                handle = start_server(scheduler, host, port, chat_template=loaded.chat_template, api_key=api_key,
                                      max_pending=max_pending)
                where = f"{handle.base_url} (chat: {handle.base_url}/chat/completions)"
        except serving.ServeError as exc:  # from start_jetstream only
            raise _fail(f"jaxrl serve --jetstream: {exc}") from None
        except OSError as exc:
            raise _fail(f"jaxrl serve: cannot listen on {host}:{port}: {exc}") from None
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


app.registered_commands += manage_app.registered_commands  # list, logs, stop, delete, checkpoints, plot
