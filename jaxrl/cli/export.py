"""`jaxrl export`: a run's checkpoint to a Hugging Face folder (`jaxrl.export`). Imports no JAX until the
export starts, so a wrong option is answered at once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jaxrl.cli.common import fail, out
from jaxrl.cli.train import quiet_libraries


def export(
    ref: Annotated[str, typer.Argument(metavar="RUN_OR_CHECKPOINT", show_default=False,
                                       help="A run folder (`<output_dir>/<name>`), its checkpoints folder, or one "
                                            "step's folder (a gs:// one with --config).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder to write: a new or empty one (or with --force "
                                                        "an earlier export of the same kind).", show_default=False)],
    merged: Annotated[bool, typer.Option("--merged", help="A HF checkpoint, LoRA folded in (the default).")] = False,
    adapter: Annotated[bool, typer.Option("--adapter", help="A PEFT LoRA adapter folder instead.")] = False,
    step: Annotated[int | None, typer.Option(help="Checkpoint step. Default: the step folder's, else the latest.",
                                             show_default=False)] = None,
    config: Annotated[Path | None, typer.Option(help="The run's TOML, for a checkpoint whose run folder has no "
                                                     "run_config.json.", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an earlier export of the same kind in --out (the "
                                                        "files its .jaxrl-export.json lists, nothing else).")] = False,
) -> None:
    """Write a run's trained model to Hugging Face format: merged weights, or a PEFT adapter.

    Never writes into a folder holding files it did not write, nor into the run's base model or tokenizer
    folder; the folder appears only once complete.
    """
    if merged and adapter:
        raise fail("jaxrl export: pass --merged or --adapter, not both")
    quiet_libraries()  # Orbax's notes on opening the checkpoint read-only
    from jaxrl.export import exporter as exporting  # heavy (JAX): kept off the validate/init path

    try:
        source = exporting.find_source(ref, step, config)
        exporting.export(source, out_dir, adapter=adapter, force=force)
    except exporting.SourceError as exc:  # ExportError is one
        raise fail(f"jaxrl export: {exc}") from None
    kind = "PEFT adapter" if adapter else "merged model"
    out.print(f"wrote the {kind} of checkpoint step {source.step} ({source.checkpoint_dir}) to {out_dir}",
              markup=False)
