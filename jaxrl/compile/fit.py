"""The fit rule that `jaxrl compile`'s report, its micro-batch search (`micro_batch`), engine-group choice
(`report`) and longest-context search (`context`) share: a run fits a chip when its compiled bytes a
chip, scratch included, are at most `FIT_SHARE` of the chip's HBM; the byte counts a compiled program
gives at the model's full depth (compiled there, or extrapolated from two reduced depths: the layers are
one scanned stack, so memory is affine in depth); the memory terms a run's three programs add up to
(`memory_terms`); what of the train step stays on a chip beside the engine; and whether the engine
holds its own copy of the weights.
"""

from __future__ import annotations

from typing import Any

from jaxrl.compile.programs import Program, Shapes

FIT_SHARE = 0.9  # a run fits when its total is at most this share of HBM (the rest: runtime, fragmentation)
# the byte counts of a program the run does not run (`at_depth` of none compiled): an engine that runs chunked
# prefill has no prefill bucket (`jaxrl.compile.programs.runs_prefill`)
ABSENT = {"argument": 0, "output": 0, "alias": 0, "temp": 0}


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
    (`extrapolate`), or `ABSENT` where none was compiled (`by_depth` empty). Keys: `argument`, `output`, `alias`,
    `temp` and `declared_<part>` for each part of `Program.declared` (bytes a chip)."""
    if not by_depth:
        return dict(ABSENT)
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


def memory_terms(train: dict[str, int], prefill: dict[str, int], decode: dict[str, int],
                 engine_owns_weights: bool) -> dict[str, int]:
    """`jaxrl compile`'s memory terms (`jaxrl.compile.report.TERMS`), bytes a chip, from the three programs'
    byte counts at full depth (`at_depth`); the engine's weights count only where it holds its own copy
    (`engine_owns_weights`). Their sum is what a run holds at once: the micro-batch search
    (`jaxrl.compile.micro_batch`) judges each candidate by it, the report prints it."""
    return {
        "weights": train["declared_weights"],  # full fine-tuning: the float32 master weights
        # the state (donated: its update is written in place, the compiler's aliased bytes) and the step's
        # other outputs (its metrics)
        "lora_optimizer": train["declared_lora"] + train["declared_optimizer"] + train["output"] - train["alias"],
        # full fine-tuning with kl_coef > 0: the frozen starting weights (in `dtype`) the KL reference runs
        "kl_reference": train["declared_reference"],
        # `[jax.teacher] model`: the teacher's frozen weights (in `dtype`), run in the train step
        "teacher": train["declared_teacher"],
        "engine_weights": decode["declared_weights"] + decode["declared_lora"] if engine_owns_weights else 0,
        "kv_cache": decode["declared_kv_cache"],
        # the train step runs in a thread while the engine decodes: both programs' scratch at once
        "temporaries": train["temp"] + max(prefill["temp"], decode["temp"]),
        "other": train["declared_batch"] + decode["declared_slots"] + prefill["output"],
    }
