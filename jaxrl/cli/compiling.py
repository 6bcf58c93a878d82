"""`jaxrl compile`: a run's train step, prefill and decode programs compiled for a TPU slice on any machine
(libtpu, no TPU), and the report of their memory a chip against its HBM (`jaxrl.compile.report`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from jaxrl.cli.common import ConfigPath, err, fail, load_run_config, out
from jaxrl.compile.slices import slice_names
from jaxrl.config.schema import ConfigError


def compile_(
    path: ConfigPath,
    topology: Annotated[str, typer.Option(help="TPU slice, as gcloud names it: " + slice_names()
                                               + "; or a topology such as v5p:4x4x4.", show_default=False)],
    json_file: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON here.")] = None,
    depths: Annotated[str, typer.Option(help="Compile at two reduced depths, e.g. '2,3', and extrapolate "
                                             "(memory is affine in depth); default: the model's depth. The "
                                             "smaller is at least 2, or a GLM's dense layers + 2 ('3,4' for "
                                             "INTELLECT-3): a scan of one trip is inlined.")] = "",
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
    no TPU) with abstract weights (an engine over TPU's ragged pool runs chunked prefill: its one ragged step,
    no prefill bucket), and print per chip: weights, LoRA + optimizer, KV cache, temporaries,
    the total against the chip's HBM (fits or not, and what to change), roofline step times, the compiler's
    cost per layer against the ideal, and the longest sequences the slice trains. Without [jax]
    micro_batch_size, the largest micro-batch that fits is found by compiling (as a run on accelerators
    does). Exit 1 when it does not fit."""
    from jaxrl.compile.programs import ProgramTooLarge  # JAX and libtpu: kept off the validate/init path
    from jaxrl.compile.report import compile_run

    cfg = load_run_config(path)
    parts = [p.strip() for p in depths.split(",") if p.strip()]
    if parts and (len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or parts[0] == parts[1]):
        raise fail(f"--depths: {depths!r} is not two different layer counts, e.g. '2,3'")
    try:
        report = compile_run(cfg, topology, tuple(int(p) for p in parts) or None, engine_hosts, cost, context)
    except ProgramTooLarge as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(code=1) from None
    except (ConfigError, ValueError, RuntimeError) as exc:
        raise fail(str(exc)) from None
    out.print(report.text(), markup=False)
    if json_file is not None:
        json_file.write_text(json.dumps(report.to_json(), indent=1))
    if not report.fits:
        raise typer.Exit(code=1)
