"""What every `jaxrl` command shares: its consoles (messages quote TOML tables such as `[jax]`, which rich
must print as they are, not read as markup), the exit-2 refusal of a config or usage problem, a run
config loaded with its problems listed, its model located, a `--mesh` parsed, and the settings of each typer
app.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from jaxrl.config.env_file import load_env_file
from jaxrl.config.model_path import HubModel, locate_model
from jaxrl.config.schema import ConfigError, RunConfig, load_config, locate_model_path, no_effect_notes
from jaxrl.config.teacher import vocabulary_mismatch
from jaxrl.run.layout import run_tokenizer_path

out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)

ConfigPath = Annotated[Path, typer.Argument(help="Run config (TOML).", show_default=False)]


def typer_app(help: str) -> typer.Typer:
    """A typer app (the `jaxrl` command, or a group of subcommands) with the CLI's settings: help without
    arguments, no shell completion, plain tracebacks. Markdown help: docstrings' line breaks are joined
    into paragraphs in the command list too (rich mode keeps them there, mid-sentence), and `[jax]` in
    backticks stays text instead of being read as rich markup."""
    return typer.Typer(help=help, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                       rich_markup_mode="markdown")


def fail(message: str) -> typer.Exit:
    """Print `message` (no markup) on stderr and return the exit-2 exception to raise."""
    err.print(message, markup=False)
    return typer.Exit(code=2)


def load_run_config(path: Path) -> RunConfig:
    """The config, its `env_file`s parsed as a check; exit 2 listing the problems found. Prints a note
    for each Hosted Training field that has no effect here."""
    try:
        cfg = load_config(path)
        load_env_file(cfg.env_file, cfg.source)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    for note in no_effect_notes(cfg):
        err.print(f"note: {path}: {note}", style="yellow", markup=False)
    return cfg


def check_model(cfg: RunConfig) -> str | HubModel:
    """Where the run's weights are (`locate_model_path`: no network); exit 2 with its one line where `jaxrl run`
    would stop: no such folder, or a model to download with HF_HUB_OFFLINE set."""
    try:
        return locate_model_path(cfg)
    except ConfigError as exc:
        raise fail(str(exc)) from None


def check_run_teacher(cfg: RunConfig, model: str | HubModel) -> None:
    """A `[jax.teacher] model` that is a local jaxrl run, checkpoints or step folder: its run's tokenizer
    (as its run config recorded it) must be the student's (`vocabulary_mismatch`; the student's folder:
    `[jax] tokenizer_path`, else `model`, the weights `check_model` found); exit 2 with one line where it
    is not. Model folders are compared when the config loads; `gs://`, Hub and server teachers when
    `jaxrl run` starts."""
    teacher = cfg.jax.teacher
    if teacher is None or teacher.model is None:
        return
    found = locate_model(teacher.model, cfg.config_dir)
    if not isinstance(found, str) or found.startswith("gs://") or (Path(found) / "config.json").is_file():
        return
    student = str(cfg.config_dir / cfg.jax.tokenizer_path) if cfg.jax.tokenizer_path else model
    if not isinstance(student, str) or student.startswith("gs://"):
        return
    try:
        reason = vocabulary_mismatch(student, run_tokenizer_path(Path(found)))
    except ValueError as exc:
        reason = f"{found} is neither a model folder (config.json + safetensors) nor a jaxrl run or checkpoint: {exc}"
    if reason:
        raise fail(f"{cfg.source}: jax.teacher.model: {reason}")


def parse_mesh(text: str) -> dict[str, int]:
    """`--mesh` (`AXIS=SIZE,...`, e.g. 'fsdp=8,expert=4') as a mesh shape; exit 2 naming the part that is
    not an axis of `jaxrl.parallel.sharding.MESH_AXES` with a size >= 1."""
    from jaxrl.parallel.sharding import MESH_AXES  # imports JAX: kept off the validate/init path

    mesh = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        axis, _, size = part.partition("=")
        if axis.strip() not in MESH_AXES or not size.strip().isdigit() or int(size) < 1:
            raise fail(f"--mesh: {part!r} is not AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)}")
        mesh[axis.strip()] = int(size)
    return mesh
