"""The fit rule that `jaxrl compile`'s report, its micro-batch and engine-group choices (`report`) and its
longest-context search (`context`) share: a run fits a chip when its compiled bytes a chip, scratch
included, are at most `FIT_SHARE` of the chip's HBM; the byte counts a compiled program gives at the
model's full depth (compiled there, or extrapolated from two reduced depths: the layers are one scanned
stack, so memory is affine in depth); what of the train step stays on a chip beside the engine; and
whether the engine holds its own copy of the weights.
"""

from __future__ import annotations

from typing import Any

from jaxrl.compile.programs import Program, Shapes

FIT_SHARE = 0.9  # a run fits when its total is at most this share of HBM (the rest: runtime, fragmentation)


def extrapolate(a: Program, b: Program, da: int, db: int, depth: int) -> dict[str, int]:
    """Every byte count of a program at `depth`, on the line through its values at depths `da`, `db`."""

    def line(x: int, y: int) -> int:
        return x + (y - x) * (depth - da) // (db - da)

    out = {f: line(getattr(a, f), getattr(b, f)) for f in ("argument", "output", "alias", "temp")}
    # a program whose scratch is flat in depth can come out a few MB smaller at the deeper one (the
    # compiler's scheduling): its line then falls below zero at 94 layers. Never below what was compiled.
    out["temp"] = max(out["temp"], min(a.temp, b.temp))
    out.update({f"declared_{k}": line(a.declared[k], b.declared[k]) for k in a.declared})
    return out


def at_depth(by_depth: dict[int, Program], depths: tuple[int, ...], layers: int) -> dict[str, int]:
    """A program's byte counts at `layers`: compiled there (one depth) or extrapolated from two
    (`extrapolate`). Keys: `argument`, `output`, `alias`, `temp` and `declared_<part>` for each part of
    `Program.declared` (bytes a chip)."""
    if len(depths) == 1:
        p = by_depth[depths[0]]
        return {**{f: getattr(p, f) for f in ("argument", "output", "alias", "temp")},
                **{f"declared_{k}": v for k, v in p.declared.items()}}
    da, db = depths[:2]
    return extrapolate(by_depth[da], by_depth[db], da, db, layers)


def trainer_bytes(train: dict[str, int]) -> int:
    """Per chip, what the compiled train step (`at_depth`'s counts) keeps whether or not the engine shares
    its chips: the report's weights, lora_optimizer, kl_reference, teacher and batch terms, and the step's
    temporaries."""
    return (train["declared_weights"] + train["declared_lora"] + train["declared_optimizer"] + train["output"]
            - train["alias"] + train["declared_reference"] + train["declared_teacher"] + train["declared_batch"]
            + train["temp"])


def hosts(mesh: Any) -> int:
    """The processes (hosts) whose devices `mesh` holds."""
    return len({d.process_index for d in mesh.devices.flat})


def engine_owns_weights(shapes: Shapes, emesh: Any, mesh: Any) -> bool:
    """Whether an engine on `emesh` holds its own copy of the weights: it runs on fewer devices than the
    trainer's `mesh`, or full fine-tuning (a cast of the float32 master weights to `dtype`, or a copy of
    them: the train step donates them, `jaxrl.run.job.Job.engine_params`). Otherwise it reads the
    trainer's frozen base in place."""
    return emesh.devices.size < mesh.devices.size or shapes.full
