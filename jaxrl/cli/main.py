"""The `jaxrl` command: `validate`, `init` and `run` a Hosted Training TOML file (`sft` one with `[jax.sft]`,
supervised fine-tuning: `jaxrl.run.sft`); manage local runs as
`prime rl` manages hosted ones (`list`, `logs`, `stop`, `delete`, `checkpoints`, `plot`: `jaxrl.cli.manage`);
`models`, `compile` (a run's programs compiled for a TPU slice: `jaxrl.compile`), `export` and `serve`;
`eval run` (`jaxrl.cli.evaluate`), `gepa run` (`jaxrl.cli.gepa`).

This module only assembles the app; each family of commands is a module of its own:

- `jaxrl.cli.configs`: `validate`, `init`, `models`
- `jaxrl.cli.train`: `run` (and `run --bench`), `sft`, and the training job in this process
- `jaxrl.cli.compiling`: `compile`
- `jaxrl.cli.export`: `export`
- `jaxrl.cli.serving`: `serve` (its option checks: `jaxrl.cli.serve_options`; the model: `jaxrl.cli.serve`)
- `jaxrl.cli.manage`: `list`, `logs`, `stop`, `delete`, `checkpoints`, `plot`
- `jaxrl.cli.evaluate`, `jaxrl.cli.gepa`: the `eval` and `gepa` groups
- `jaxrl.cli.common`: what they share (consoles, exit 2, a config loaded, a `--mesh` parsed)

`validate`, `init` and the run management commands (but `checkpoints`) import no JAX, so they answer in
well under a second: a command module imports JAX (or another library that is slow to import, or an
optional extra) only inside the command that needs it (`tests/test_structure.py` holds every
function-level import to that).
Config problems exit with status 2 and one line per problem, never a traceback.
"""

from __future__ import annotations

from jaxrl.cli import compiling, configs, manage, serving, train
from jaxrl.cli.common import typer_app
from jaxrl.cli.evaluate import eval_app
from jaxrl.cli.export import export
from jaxrl.cli.gepa import gepa_app
from jaxrl.parallel.platform import skip_absent_tpu

app = typer_app("JAX RL trainer for LLMs, driven by Prime Hosted Training TOML files.")

app.add_typer(eval_app, name="eval")
app.add_typer(gepa_app, name="gepa")


@app.callback()
def _before_every_command() -> None:
    # Before any command imports JAX: no libtpu probe (and its console lines) on a host without TPU chips.
    skip_absent_tpu()


# In the order `jaxrl --help` lists them.
app.command("validate")(configs.validate)
app.command("init")(configs.init)
app.command("run")(train.run)
app.command("sft")(train.sft)
app.command("models")(configs.models)
app.command("compile")(compiling.compile_)
app.command("export")(export)
app.command("serve")(serving.serve)
app.command("list")(manage.list_runs)
app.command("logs")(manage.logs)
app.command("stop")(manage.stop)
app.command("delete")(manage.delete)
app.command("checkpoints")(manage.checkpoints)
app.command("plot")(manage.plot)
