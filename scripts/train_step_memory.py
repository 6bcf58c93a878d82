"""A run's train step compiled for a TPU slice from this host, at a few depths: what the compiler holds a chip.

The train step `jaxrl compile` compiles (`jaxrl.compile.programs.compile_train`, the config's own sizes and
micro-batch) at each of `--depths`, and per depth the compiler's per-chip bytes (`memory_analysis()`):
arguments, outputs, the outputs written over a donated argument (`alias`), temporaries, and the step's peak
`argument + output - alias + temp` (what `jaxrl compile` adds up: `jaxrl.compile.fit.trainer_bytes`); then
each of them on the line through the first two depths at the model's full depth (memory is affine in depth:
`jaxrl.compile.fit.extrapolate`). One JSON line per depth and one for the full depth.

Why the peak and not the temporaries alone: an output that is not donated is a buffer of its own, empty until
the step writes it at the end, so the compiler places scratch in it (the gradient accumulator, the bf16 casts
of the weights), which `memory_analysis()` then counts as output, not as temporaries. Once the state is
donated, its outputs are its inputs, live from the start, and that scratch counts as temporaries: the
temporaries grow while the peak falls (docs/benchmarks-log.md, 2026-11-28). Runs in older trees too (the
helpers it reads moved between commits), so a tree made by `scripts/worktree_at.sh` can run a copy of it:

    nice python scripts/train_step_memory.py configs/qwen3_4b_full.toml --topology v5p-8 --depths 2,3
    XLA_FLAGS=--xla_dump_to=dump nice python scripts/train_step_memory.py ... --depths 2   # + buffer assignment
"""

from __future__ import annotations

import argparse
import dataclasses
import json

PEAK_PARTS = ("argument", "output", "alias", "temp")


def peak(p: dict[str, int]) -> int:
    """A compiled step's bytes a chip at its peak: its arguments, its outputs less those written in place
    over a donated argument, and its temporaries."""
    return p["argument"] + p["output"] - p["alias"] + p["temp"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a run config (TOML)")
    ap.add_argument("--topology", required=True, help="a TPU slice, as `jaxrl compile --topology` takes it")
    ap.add_argument("--depths", default="2,3", help="layers to compile at, comma-separated (default 2,3)")
    args = ap.parse_args()

    from jaxrl.compile import programs, report, slices
    from jaxrl.config.schema import load_config
    from jaxrl.parallel.sharding import MESH_AXES, make_mesh

    try:  # where the architecture is read from: compile/architecture.py since f76b618, report.py before
        from jaxrl.compile.architecture import model_of
    except ImportError:
        from jaxrl.compile.report import model_of
    cfg = load_config(args.config)
    model = model_of(cfg)
    slice_ = slices.parse_slice(args.topology)
    shape = cfg.jax.mesh.model_dump()
    if all(shape[a] == 1 for a in MESH_AXES):
        shape = {"fsdp": slice_.chips}
    mesh = make_mesh(shape, slices.topology_devices(slice_))
    shapes = dataclasses.replace(report.shapes_of(cfg, model), model=model)
    if shapes.micro_batch_size is None:
        raise SystemExit(f"{args.config}: set [jax] micro_batch_size (this script compiles one, searches none)")
    depths = [int(d) for d in args.depths.split(",")]
    by_depth = {}
    for depth in depths:
        p = dataclasses.asdict(programs.compile_train(shapes.at_depth(depth), mesh))
        by_depth[depth] = {k: p[k] for k in PEAK_PARTS}
        print(json.dumps({"depth": depth, **by_depth[depth], "peak": peak(by_depth[depth]),
                          "micro_batch_size": shapes.micro_batch_size, "compile_s": round(p["compile_s"], 1)}),
              flush=True)
    if len(depths) > 1:
        (da, a), (db, b) = list(by_depth.items())[:2]
        full = {k: a[k] + (b[k] - a[k]) * (model.num_layers - da) // (db - da) for k in PEAK_PARTS}
        print(json.dumps({"depth": model.num_layers, "extrapolated_from": [da, db], **full, "peak": peak(full),
                          "gib": {k: round(v / 2**30, 2) for k, v in {**full, "peak": peak(full)}.items()}}))


if __name__ == "__main__":
    main()
