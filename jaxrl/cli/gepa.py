"""`jaxrl gepa run ENV_OR_CONFIG`: an environment's system prompt optimised with GEPA, with `prime gepa run` /
`vf-gepa`'s flags or their TOML form (`jaxrl.config.gepa`), rollouts and (by default) reflection on jaxrl's
own engine in this process for a local model (`jaxrl.cli.local_model`), or on endpoints.

The search and its outputs: `jaxrl.evaluation.gepa_run`; reflection that cannot fail silently:
`jaxrl.evaluation.reflection`. Imports no JAX until the command runs.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from jaxrl.cli.common import err, fail, out, typer_app
from jaxrl.cli.evaluate import (
    BaseUrl,
    Concurrency,
    DecodeSlots,
    EndpointsPath,
    EnvArgs,
    KeyVar,
    SamplingArgs,
    SeqLen,
    default_output_dir,
    json_object,
    load_environment,
)
from jaxrl.cli.local_model import endpoint
from jaxrl.cli.train import quiet_libraries
from jaxrl.config.gepa import from_flags
from jaxrl.config.schema import ConfigError
from jaxrl.evaluation.endpoint import EndpointError

gepa_app = typer_app("Optimise an environment's system prompt with GEPA (prime gepa / vf-gepa's flags).")


def _opt(*names: str, help: str, kind: Any = int) -> Any:
    return Annotated[kind | None, typer.Option(*names, help=help, show_default=False)]


@gepa_app.command("run")
def run(
    env_or_config: Annotated[str, typer.Argument(metavar="ENV_OR_CONFIG", show_default=False,
                                                 help="An installed environment's id, or a GEPA TOML file "
                                                      "(`configs/gepa/*.toml`; flags given override its keys).")],
    model: _opt("--model", "-m", kind=str, help="Rollout model: a local HF folder or jaxrl run / checkpoint "
                                                "(served in process), or an endpoint's model (-b, or an -e alias).")
    = None,
    reflection_model: _opt("--reflection-model", "-M", kind=str, help="Reflection model (same forms). Default: "
                                                                      "--model.") = None,
    max_calls: _opt("--max-calls", "-B", help="Rollout budget. Default 500.") = None,
    num_train: _opt("--num-train", "-n", help="Train examples. Default 100.") = None,
    num_val: _opt("--num-val", "-N", help="Validation examples. Default 50.") = None,
    minibatch_size: _opt("--minibatch-size", help="Examples per reflection. Default 3.") = None,
    perfect_score: _opt("--perfect-score", kind=float, help="Skip reflecting on a minibatch that scores this "
                                                             "everywhere. Default: never skip.") = None,
    state_columns: _opt("--state-columns", kind=list[str], help="Extra state fields shown to the reflection "
                                                                 "model (repeat the flag).") = None,
    env_args: Annotated[str | None, EnvArgs.__metadata__[0]] = None,
    sampling_args: Annotated[str | None, SamplingArgs.__metadata__[0]] = None,
    max_concurrent: Annotated[int | None, Concurrency.__metadata__[0]] = None,
    seed: _opt("--seed", help="gepa's seed and the rollouts' sampling seed. Default 0.") = None,
    run_dir: _opt("--run-dir", "-o", kind=str, help="Output folder (an existing run's resumes). Default: "
                                                     "`outputs/gepa/<env>--<model>/<time>`.") = None,
    api_base_url: BaseUrl = None,
    api_key_var: KeyVar = None,
    endpoints_path: Annotated[str | None, EndpointsPath.__metadata__[0]] = None,
    seq_len: Annotated[int | None, SeqLen.__metadata__[0]] = None,
    decode_slots: Annotated[int | None, DecodeSlots.__metadata__[0]] = None,
    reflection_max_tokens: _opt("--reflection-max-tokens", help="Tokens of one reflection reply. Default "
                                                                 "2048.") = None,
    max_failed_proposals: _opt("--max-failed-proposals", help="Failed proposals in a row that stop the run. "
                                                               "Default 5.") = None,
) -> None:
    """Optimise ENV's system prompt with GEPA; writes system_prompt.txt, best_prompt.txt, results.jsonl,
    pareto_frontier.jsonl and metadata.json to the run folder (rerun with the same -o to resume)."""
    flags = {"model": model, "reflection_model": reflection_model, "gepa.max_calls": max_calls,
             "gepa.num_train": num_train, "gepa.num_val": num_val, "gepa.minibatch_size": minibatch_size,
             "gepa.perfect_score": perfect_score, "gepa.state_columns": state_columns,
             "gepa.max_concurrent": max_concurrent, "gepa.seed": seed, "run_dir": run_dir,
             "api_base_url": api_base_url, "api_key_var": api_key_var, "endpoints_path": endpoints_path,
             "jax.seq_len": seq_len, "jax.decode_slots": decode_slots,
             "jax.reflection_max_tokens": reflection_max_tokens, "jax.max_failed_proposals": max_failed_proposals,
             "env_args": None if env_args is None else json_object(env_args, "--env-args"),
             "sampling": None if sampling_args is None else json_object(sampling_args, "--sampling-args")}
    try:
        cfg = from_flags(env_or_config, flags)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    optimise(cfg)


def optimise(cfg: Any) -> None:
    """Run the GEPA search of `cfg` (a `jaxrl.config.gepa.GepaConfig`) and print its outcome (with the share
    of failed rollouts when some failed); exit 2 on a config, environment or endpoint problem (an endpoint
    that is down included), 1 when the first batch of rollouts all failed or reflection failed too often."""
    from jaxrl.evaluation import gepa_run  # gepa and verifiers: only `jaxrl gepa` needs them
    from jaxrl.evaluation.reflection import ReflectionFailed

    env_cfg = cfg.env[0]
    folder = Path(cfg.run_dir) if cfg.run_dir else default_output_dir("gepa", env_cfg.env_id, cfg.model)
    quiet_libraries()
    loaded = load_environment(env_cfg.env_id, env_cfg.env_args)
    try:
        resuming = gepa_run.check_resume(folder, cfg.model_dump(mode="json", exclude={"run_dir"}))
        with _endpoints(cfg) as (rollouts, reflection), gepa_run.plan(cfg, loaded, rollouts) as p:
            out.print(f"GEPA on {env_cfg.env_id}: {len(p.trainset)} train / {len(p.valset)} validation examples, "
                      f"budget {cfg.gepa.max_calls} rollouts, rollouts on {rollouts.model}, reflection on "
                      f"{reflection.model}; {'resuming' if resuming else 'writing'} {folder}", markup=False)
            result = _search(cfg, p, reflection, folder)
    except (gepa_run.GepaRunError, EndpointError) as exc:
        raise fail(f"jaxrl gepa run: {exc}") from None
    except gepa_run.RolloutsFailed as exc:
        err.print(f"jaxrl gepa run: {exc}", markup=False)
        raise typer.Exit(code=1) from None
    except ReflectionFailed as exc:
        err.print(f"jaxrl gepa run: {exc} (outputs so far in {folder})", markup=False)
        raise typer.Exit(code=1) from None
    scores = list(result.val_aggregate_scores)
    out.print(f"validation score: seed prompt {scores[0]:.4f}, best {scores[result.best_idx]:.4f} (candidate "
              f"{result.best_idx} of {len(scores)}, {result.total_metric_calls} rollouts)", markup=False)
    if p.tally.failed:
        err.print(f"{p.tally.line()}; first error: {p.tally.first_error}", markup=False)
    out.print(f"best prompt: {folder / gepa_run.BEST_PROMPT}; wrote {', '.join(gepa_run.OUTPUTS)}", markup=False)


@contextlib.contextmanager
def _endpoints(cfg: Any) -> Any:
    """(rollout endpoint, reflection endpoint): the reflection model is the rollout one (served once) unless
    `reflection_model` names another."""
    common = {"base_url": cfg.api_base_url, "api_key_var": cfg.api_key_var, "endpoints_path": cfg.endpoints_path,
              "seq_len": cfg.jax.seq_len, "decode_slots": cfg.jax.decode_slots, "console": err}
    with endpoint(cfg.model, **common) as rollouts:
        if cfg.reflection_model in (None, cfg.model):
            yield rollouts, rollouts
            return
        with endpoint(cfg.reflection_model, **common) as reflection:
            yield rollouts, reflection


def _search(cfg: Any, p: Any, reflection: Any, folder: Path) -> Any:
    """The search with a progress bar (budget used, best validation score) and the reflector's lines; the
    reflection prompt fitted to a local reflection model's context (`--seq-len`)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from jaxrl.evaluation import gepa_run  # gepa and verifiers, as `optimise`
    from jaxrl.evaluation.reflection import Reflector, chat_model
    from jaxrl.evaluation.reflection_prompt import Unrecoverable, local_budget

    try:  # jaxrl's own server: its context and tokenizer are known; a remote model's prompt goes as rendered
        budget = local_budget(reflection.tokenizer_path, cfg.jax.seq_len, cfg.jax.reflection_max_tokens) \
            if reflection.local else None
    except Unrecoverable as exc:
        raise fail(f"jaxrl gepa run: {exc}") from None
    log = gepa_run.FileLog(folder / gepa_run.LOG_FILE)
    columns = (TextColumn("GEPA"), BarColumn(), MofNCompleteColumn(),
               TextColumn("rollouts, best val {task.fields[best]}"), TimeElapsedColumn())
    with Progress(*columns, console=out, transient=False) as bar:
        task = bar.add_task("gepa", total=cfg.gepa.max_calls, best="-")

        def note(line: str) -> None:
            log.log(line)
            bar.console.print(f"{time.strftime('%H:%M:%S')} {line}", markup=False)

        def count(done: int, best: str) -> None:
            # gepa checks its budget before an iteration, so the last one may run past it: the bar grows.
            bar.update(task, completed=done, total=max(done, cfg.gepa.max_calls), best=best)

        def watch(state: Any) -> None:
            scores = state.program_full_scores_val_set
            count(state.total_num_evals, f"{max(scores):.4f}" if scores else "-")

        lm = chat_model(reflection.base_url, reflection.model, reflection.api_key_var, cfg.jax.reflection_max_tokens)
        reflector = Reflector(lm, cfg.jax.max_failed_proposals, note, budget)
        result = gepa_run.run(cfg, p, reflector, folder, log, watch)
        count(result.total_metric_calls or 0, f"{max(result.val_aggregate_scores):.4f}")
    return result
