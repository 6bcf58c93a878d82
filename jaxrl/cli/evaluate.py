"""`jaxrl eval run ENV_OR_CONFIG`: an environment's examples played against a model, with `prime eval run` / `vf-eval`'s
flags; the seeds' first step before training ("validate environment behavior before training with the
canonical eval path", then "confirm reward diversity exists at baseline").

Prints the mean reward, the per-example reward std and the share of examples without reward diversity
(`jaxrl.evaluation.report`), and how many rollouts failed when some did; with `-s` (or `-o`) saves
`results.jsonl` and `metadata.json`. An eval in which every rollout failed exits 1 with one line; an
endpoint that cannot be reached, before any rollout, exits 2 (`jaxrl.cli.local_model.endpoint`). Imports no
JAX until the command runs.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from jaxrl.cli.common import err, fail, out, typer_app
from jaxrl.cli.local_model import endpoint
from jaxrl.cli.train import quiet_libraries
from jaxrl.config.base import json_object as parse_json_object
from jaxrl.config.schema import ConfigError, SamplingConfig, load_config, resolve_model_path
from jaxrl.evaluation.endpoint import EndpointError

eval_app = typer_app("Evaluate a model on an environment (prime eval / vf-eval's flags).")

EnvArg = Annotated[str, typer.Argument(metavar="ENV_OR_CONFIG", show_default=False,
                                       help="An installed environment's id (`owner/name` or `name`), or a jaxrl "
                                            "run config (`rl.toml`: its [[env]], model and [sampling]).")]
Model = Annotated[str | None, typer.Option("--model", "-m", show_default=False,
                                    help="A local HF model folder or a jaxrl run / checkpoint (served by jaxrl's "
                                         "engine in this process), or an endpoint's model: an alias of the "
                                         "endpoints file (-e) or a model id with -b.")]
EnvArgs = Annotated[str, typer.Option("--env-args", "-a", help="load_environment / taskset arguments (JSON object).")]
SamplingArgs = Annotated[str, typer.Option("--sampling-args", "-S",
                                           help="Sampling settings (JSON object; the keys of a run config's "
                                                "[sampling]: temperature, max_tokens, top_p, top_k, seed, ...).")]
Concurrency = Annotated[int, typer.Option("--max-concurrent", "-c", help="Rollouts in flight at once.")]
BaseUrl = Annotated[str | None, typer.Option("--api-base-url", "-b", show_default=False,
                                             help="An OpenAI-compatible endpoint's URL (ending in /v1).")]
KeyVar = Annotated[str | None, typer.Option("--api-key-var", "-k", show_default=False,
                                            help="Environment variable holding the endpoint's API key.")]
EndpointsPath = Annotated[str, typer.Option("--endpoints-path", "-e", help="Endpoint aliases (verifiers' "
                                                                          "endpoints.toml).")]
SeqLen = Annotated[int, typer.Option(help="A local model's tokens per sequence (prompt + completion).")]
DecodeSlots = Annotated[int, typer.Option(help="A local model's sequences decoded at once.")]


def json_object(text: str, flag: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; exit 2 naming `flag` otherwise."""
    try:
        return parse_json_object(text)
    except ValueError as exc:
        raise fail(f"{flag}: {exc}") from None


def sampling_config(raw: dict[str, Any], flag: str) -> Any:
    """`raw` validated as a run config's `[sampling]` table (`jaxrl.config.schema.SamplingConfig`); exit 2
    naming `flag` and each bad key otherwise."""
    try:
        return SamplingConfig.model_validate(raw)
    except ValidationError as exc:
        raise fail("\n".join(f"{flag}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


def default_output_dir(kind: str, env_id: str, model: str) -> Path:
    """`outputs/<kind>/<env>--<model>/<UTC time>`, as vf-eval files its results (folder-safe names)."""
    safe = [s.replace("/", "--").strip(".-") or "model" for s in (env_id.rsplit("/", 1)[-1], Path(model).name or model)]
    return Path("outputs") / kind / f"{safe[0]}--{safe[1]}" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


@dataclasses.dataclass
class Target:
    """One environment to evaluate: its id, `args`, and for a run config's `[[env]]` its `taskset` /
    `harness` tables and display name (the results' subfolder when the config has several)."""

    env_id: str
    args: dict[str, Any]
    taskset: dict[str, Any] | None = None
    harness: dict[str, Any] | None = None
    name: str | None = None


def targets(env_or_config: str, model: str | None, env_args: dict[str, Any],
            sampling: dict[str, Any]) -> tuple[str, dict[str, Any], int | None, list[Target]]:
    """(model, raw sampling, the config's seq_len or None, environments) for ENV_OR_CONFIG: an environment id
    with `-m`, or a jaxrl run config (`rl.toml`): its `[[env]]` entries, its model (`-m` overrides it) and
    `[sampling]` (`-S` keys override its keys). Exit 2 naming the problem otherwise."""
    if not env_or_config.endswith(".toml"):
        if model is None:
            raise fail("--model / -m is required with an environment id")
        return model, sampling, None, [Target(env_or_config, env_args)]
    if env_args:
        raise fail("--env-args: a run config's [[env]] tables hold the environments' args")
    try:
        cfg = load_config(env_or_config)
        model = model or resolve_model_path(cfg)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    own = cfg.sampling.model_dump(exclude_none=True, exclude={"temp_scheduler", "extra_body", "reasoning_effort"})
    envs = [Target(e.id, dict(e.args or {}), e.taskset, e.harness, e.display_name) for e in cfg.env]
    return model, {**own, **sampling}, cfg.jax.seq_len, envs


@eval_app.command("run")
def run(
    env_or_config: EnvArg,
    model: Model = None,
    num_examples: Annotated[int, typer.Option("--num-examples", "-n",
                                              help="Examples of the eval split (else the train split); -1: all.")] = 5,
    rollouts_per_example: Annotated[int, typer.Option("--rollouts-per-example", "-r",
                                                      help="Rollouts of each example.")] = 3,
    save_results: Annotated[bool, typer.Option("--save-results", "-s",
                                               help="Save results.jsonl and metadata.json.")] = False,
    output_dir: Annotated[Path | None, typer.Option("--output-dir", "-o", show_default=False,
                                                    help="Where to save (implies -s). Default: "
                                                         "`outputs/evals/<env>--<model>/<time>`.")] = None,
    env_args: EnvArgs = "{}",
    sampling_args: SamplingArgs = "{}",
    max_concurrent: Concurrency = 32,
    api_base_url: BaseUrl = None,
    api_key_var: KeyVar = None,
    endpoints_path: EndpointsPath = "configs/endpoints.toml",
    seq_len: Annotated[int | None, SeqLen.__metadata__[0]] = None,
    decode_slots: DecodeSlots = 32,
) -> None:
    """Play ENV's examples (or each [[env]] of a run config's) against a model and print the mean reward, the
    per-example reward std and the share of examples with no reward diversity; -s saves results.jsonl (one
    row per rollout) and metadata.json."""
    import asyncio

    if num_examples < 1 and num_examples != -1:
        raise fail(f"--num-examples must be -1 (all) or >= 1, got {num_examples}")
    for flag, value in (("--rollouts-per-example", rollouts_per_example), ("--max-concurrent", max_concurrent),
                        ("--seq-len", seq_len or 1), ("--decode-slots", decode_slots)):
        if value < 1:
            raise fail(f"{flag} must be >= 1, got {value}")
    model, raw_sampling, config_seq_len, envs = targets(env_or_config, model, json_object(env_args, "--env-args"),
                                                        json_object(sampling_args, "--sampling-args"))
    sampling = sampling_config(raw_sampling, "--sampling-args")
    seq_len = seq_len or config_seq_len or 4096
    quiet_libraries()
    loaded = [load_environment(t.env_id, t.args, t.taskset, t.harness) for t in envs]
    folder = (output_dir or default_output_dir("evals", env_or_config.removesuffix(".toml"), model)
              if save_results or output_dir is not None else None)
    try:
        with endpoint(model, base_url=api_base_url, api_key_var=api_key_var, endpoints_path=endpoints_path,
                      seq_len=seq_len, decode_slots=decode_slots, console=err) as ep:
            for t, env in zip(envs, loaded, strict=True):
                play_one(t, env, ep, asyncio.run, num_examples=num_examples, rollouts_per_example=rollouts_per_example,
                         sampling=sampling, max_concurrent=max_concurrent, seq_len=seq_len, model=model,
                         folder=folder / t.name if folder and len(envs) > 1 and t.name else folder)
    except EndpointError as exc:
        raise fail(f"jaxrl eval run: {exc}") from None


def play_one(t: Target, env: Any, ep: Any, run_async: Any, *, num_examples: int, rollouts_per_example: int,
             sampling: Any, max_concurrent: int, seq_len: int, model: str, folder: Path | None) -> None:
    """One environment's eval: play, print the summary (with the share of failed rollouts when some
    failed), save to `folder` when given. When every rollout failed it prints one line instead (how many,
    the first error, where the rows went) and exits 1: a mean reward of 0 over nothing measured is no
    result, and the environments after it (which would likely fail the same way) are not played."""
    from jaxrl.evaluation import play, report  # verifiers: only a command that plays an environment

    tasks = play.examples(env, num_examples)
    split = "eval split" if env.eval_tasks else "train split (it has no eval split)"
    out.print(f"{t.name or t.env_id}: {len(tasks)} examples of its {split} x {rollouts_per_example} rollouts on "
              f"{ep.model} ({'in process' if ep.local else ep.base_url})", markup=False)
    t0 = time.perf_counter()
    rows = run_async(play.play(env, tasks, rollouts_per_example, ep, sampling, max_concurrent, seq_len))
    elapsed = time.perf_counter() - t0
    summary = report.summarise(rows)
    first = next((play.first_line(r.error) for r in rows if r.error), None)
    if not summary.all_failed:
        for line in report.lines(summary):
            out.print(line, markup=False)
        if first is not None:
            err.print(f"first error: {first}", markup=False)
    if folder is not None:
        report.save(folder, rows, summary, {
            "env_id": t.env_id, "env_args": t.args, "taskset": t.taskset, "harness": t.harness, "model": model,
            "endpoint": "in process" if ep.local else ep.base_url, "num_examples": len(tasks),
            "rollouts_per_example": rollouts_per_example, "split": "eval" if env.eval_tasks else "train",
            "sampling_args": sampling.model_dump(exclude_none=True), "time_s": round(elapsed, 3),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        if not summary.all_failed:
            out.print(f"saved {folder / report.RESULTS} and {folder / report.METADATA}", markup=False)
    if summary.all_failed:
        saved = f"; the rows are in {folder / report.RESULTS}" if folder is not None else ""
        err.print(f"jaxrl eval run: {t.name or t.env_id}: every rollout failed ({summary.failed_line()}); first "
                  f"error: {first}{saved}", markup=False)
        raise typer.Exit(code=1)


def load_environment(env_id: str, args: dict[str, Any], taskset: dict[str, Any] | None = None,
                     harness: dict[str, Any] | None = None) -> Any:
    """`jaxrl.envs.loader.load_env(env_id, args, taskset, harness)`; exit 2 with its message when it cannot be
    loaded."""
    from jaxrl.envs import loader  # verifiers and renderers, as `play_one`

    try:
        return loader.load_env(env_id, args, taskset, harness)
    except loader.EnvLoadError as exc:
        raise fail(f"{env_id}: {exc}") from None
