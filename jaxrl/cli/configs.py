"""`jaxrl validate`, `jaxrl init` and `jaxrl models`: a run config checked and printed with its defaults, a
commented starter config written, and the supported models listed with what each device holds on a mesh.
`validate` and `init` import no JAX, so they answer at once; `models` imports it to count and shard the
weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from jaxrl.cli.common import ConfigPath, check_model, check_run_teacher, err, fail, load_run_config, out, parse_mesh
from jaxrl.config.model_path import hf_cache_dir, hub_endpoint
from jaxrl.config.starter import STARTER_TOML
from jaxrl.model import catalog
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.spec import is_spec


def validate(path: ConfigPath) -> None:
    """Check a config and print it with every default filled in (JSON on stdout, notes on stderr); exit 2
    where `jaxrl run` would stop before training: a config error, or model weights it cannot find (no such
    folder, or not in the HF cache with HF_HUB_OFFLINE set)."""
    cfg = load_run_config(path)
    out.print_json(data=cfg.model_dump(mode="json"))
    found = check_model(cfg)
    check_run_teacher(cfg, found)
    err.print(f"model weights: {found if isinstance(found, str) else found.describe()}", markup=False)


def init(
    path: Annotated[Path, typer.Argument(help="File to write.")] = Path("rl.toml"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented starter config (required keys set, optional ones commented out)."""
    if path.exists() and not force:
        raise fail(f"{path} already exists; pass --force to overwrite it")
    path.write_text(STARTER_TOML, encoding="utf-8")
    out.print(f"wrote {path}; check it with `jaxrl validate {path}`", markup=False)


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
    import jax  # the model's parameter counts and shards: JAX, kept off the validate/init path

    from jaxrl.compile.pool import token_bytes
    from jaxrl.model import modules
    from jaxrl.model.blocks import LORA_TARGETS
    from jaxrl.parallel.sharding import bytes_per_device

    shape = parse_mesh(mesh)
    if config is not None:
        cfg = load_run_config(config)
        shape, dtype, lora_rank = cfg.jax.mesh.model_dump(), cfg.jax.dtype, cfg.jax.lora_rank
    if dtype not in ("bfloat16", "float32"):
        raise fail(f"--dtype: {dtype!r} is not bfloat16 or float32")
    itemsize = 2 if dtype == "bfloat16" else 4
    devices = math.prod(shape.values()) if shape else 1
    out.print("architectures: " + ", ".join(f"{k} ({v})" for k, v in catalog.ARCHITECTURES.items()))
    table = Table(title=f"Hosted Training models on mesh {shape or {'fsdp': 1}} ({devices} devices), {dtype}")
    for col in ("model", "params", "active/token", "weights/device", f"LoRA r{lora_rank}+AdamW/device",
                "full FT/device", "KV pool/token/device", "context: model / trains (compiled)"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, hf_config in catalog.HOSTED_MODELS.items():
        mcfg = ModelConfig.from_hf(hf_config)
        dims = mcfg.dims()
        specs = modules.param_specs(mcfg)
        total = sum(math.prod(s.shape(dims)) for s in jax.tree.leaves(specs, is_leaf=is_spec))
        inactive = 3 * mcfg.hidden_size * mcfg.moe_intermediate_size * (mcfg.num_experts - mcfg.num_experts_per_tok)
        active = total - inactive * len(mcfg.moe_layers)
        targets = tuple(LORA_TARGETS)
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
