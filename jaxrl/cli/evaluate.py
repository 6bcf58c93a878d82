"""`jaxrl eval run ENV`: an environment's examples played against a model, with `prime eval run` / `vf-eval`'s
flags; the seeds' first step before training ("validate environment behavior before training with the
canonical eval path", then "confirm reward diversity exists at baseline").

Prints the mean reward, the per-example reward std and the share of examples without reward diversity
(`jaxrl.evaluation.report`); with `-s` (or `-o`) saves `results.jsonl` and `metadata.json`. Imports no
JAX until the command runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

eval_app = typer.Typer(help="Evaluate a model on an environment (prime eval / vf-eval's flags).",
                       no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                       rich_markup_mode="markdown")
out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)

EnvArg = Annotated[str, typer.Argument(metavar="ENV", show_default=False,
                                       help="An installed environment's id (`owner/name` or `name`).")]
Model = Annotated[str, typer.Option("--model", "-m", show_default=False,
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


def fail(message: str) -> typer.Exit:
    """Print `message` (no markup) and return the exit-2 exception to raise."""
    err.print(message, markup=False)
    return typer.Exit(code=2)


def json_object(text: str, flag: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; exit 2 naming `flag` otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(f"{flag}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise fail(f"{flag}: must be a JSON object, got {text!r}")
    return value


def sampling_config(raw: dict[str, Any], flag: str) -> Any:
    """`raw` validated as a run config's `[sampling]` table (`jaxrl.config.schema.SamplingConfig`); exit 2
    naming `flag` and each bad key otherwise."""
    from pydantic import ValidationError

    from jaxrl.config.schema import SamplingConfig

    try:
        return SamplingConfig.model_validate(raw)
    except ValidationError as exc:
        raise fail("\n".join(f"{flag}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


def default_output_dir(kind: str, env_id: str, model: str) -> Path:
    """`outputs/<kind>/<env>--<model>/<UTC time>`, as vf-eval files its results (folder-safe names)."""
    safe = [s.replace("/", "--").strip(".-") or "model" for s in (env_id.rsplit("/", 1)[-1], Path(model).name or model)]
    return Path("outputs") / kind / f"{safe[0]}--{safe[1]}" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


@eval_app.command("run")
def run(
    env_id: EnvArg,
    model: Model,
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
    seq_len: SeqLen = 4096,
    decode_slots: DecodeSlots = 32,
) -> None:
    """Play ENV's examples against a model and print the mean reward, the per-example reward std and the
    share of examples with no reward diversity; -s saves results.jsonl (one row per rollout) and
    metadata.json."""
    import asyncio

    if num_examples < 1 and num_examples != -1:
        raise fail(f"--num-examples must be -1 (all) or >= 1, got {num_examples}")
    for flag, value in (("--rollouts-per-example", rollouts_per_example), ("--max-concurrent", max_concurrent),
                        ("--seq-len", seq_len), ("--decode-slots", decode_slots)):
        if value < 1:
            raise fail(f"{flag} must be >= 1, got {value}")
    args = json_object(env_args, "--env-args")
    sampling = sampling_config(json_object(sampling_args, "--sampling-args"), "--sampling-args")
    from jaxrl.cli.local_model import endpoint
    from jaxrl.cli.train import quiet_libraries
    from jaxrl.evaluation import play, report
    from jaxrl.evaluation.endpoint import EndpointError

    quiet_libraries()
    loaded = load_environment(env_id, args)
    tasks = play.examples(loaded, num_examples)
    split = "eval split" if loaded.eval_tasks else "train split (it has no eval split)"
    t0 = time.perf_counter()
    try:
        with endpoint(model, base_url=api_base_url, api_key_var=api_key_var, endpoints_path=endpoints_path,
                      seq_len=seq_len, decode_slots=decode_slots, console=err) as ep:
            out.print(f"{env_id}: {len(tasks)} examples of its {split} x {rollouts_per_example} rollouts on "
                      f"{ep.model} ({'in process' if ep.local else ep.base_url})", markup=False)
            rows = asyncio.run(play.play(loaded, tasks, rollouts_per_example, ep, sampling, max_concurrent, seq_len))
    except EndpointError as exc:
        raise fail(f"jaxrl eval run: {exc}") from None
    elapsed = time.perf_counter() - t0
    summary = report.summarise(rows)
    for line in report.lines(summary):
        out.print(line, markup=False)
    if first := next((r.error for r in rows if r.error), None):
        err.print(f"first error: {first.strip().splitlines()[0][:300] if first.strip() else first}", markup=False)
    if save_results or output_dir is not None:
        folder = output_dir or default_output_dir("evals", env_id, model)
        report.save(folder, rows, summary, {
            "env_id": env_id, "env_args": args, "model": model, "endpoint": "in process" if ep.local else ep.base_url,
            "num_examples": len(tasks), "rollouts_per_example": rollouts_per_example,
            "split": "eval" if loaded.eval_tasks else "train", "sampling_args": sampling.model_dump(exclude_none=True),
            "time_s": round(elapsed, 3), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        out.print(f"saved {folder / report.RESULTS} and {folder / report.METADATA}", markup=False)


def load_environment(env_id: str, args: dict[str, Any]) -> Any:
    """`jaxrl.envs.loader.load_env(env_id, args)`; exit 2 with its message when it cannot be loaded."""
    from jaxrl.envs import loader

    try:
        return loader.load_env(env_id, args)
    except loader.EnvLoadError as exc:
        raise fail(f"{env_id}: {exc}") from None
