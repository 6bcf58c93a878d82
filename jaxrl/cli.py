"""The `jaxrl` command: `validate`, `init` and `run` a Hosted Training TOML file.

`validate` and `init` import only the config module (no JAX), so they answer in well under a second.
Config problems exit with status 2 and one line per problem, never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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
