"""Classic verifiers environments: a module whose `load_environment(**args)` returns a `vf.Environment`.

Environments published before verifiers' v1 API (SingleTurnEnv, MultiTurnEnv, ToolEnv, ...; verifiers
0.3.1 keeps them in `verifiers.legacy`, and `import verifiers as vf` still reaches them) talk to an
OpenAI-compatible chat endpoint. One rollout goes:

    Environment.run_rollout -> MultiTurnEnv.rollout (one model call per turn, env replies between)
      -> OpenAIChatCompletionsClient: POST {base_url}/chat/completions with `logprobs: true`,
         `return_token_ids: true` and the rollout's seed (jaxrl.inference.chat, on the run's server)
      -> each turn's `prompt_token_ids`, sampled `token_ids` and their logprobs on the state's trajectory
      -> Rubric.score_rollout -> reward -> `Rollout` (`trajectory_rollout`)

The server renders each turn's messages with the chat template, so a turn's prompt is the earlier
turns re-rendered. Where it begins with the previous turn's tokens (the usual case: the template
re-renders a reply as it was sampled), the turns chain into one sample, prompt and env tokens masked
out and each turn's sampled tokens masked in. Where re-rendering changed earlier tokens (a template that
drops reasoning from past turns, or text that re-tokenizes differently), the sample starts again at that
turn's prompt: the earlier turns are not trained on, and `Rollout.error` stays None.

A rollout fails (ok=False, with its error) when a model call fails, the env's own code raises, or a
reward function raises (verifiers.legacy's Rubric would score that 0.0). An env with group-level
reward functions is not supported: the trainer plays and scores each rollout on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import types
from collections.abc import AsyncIterator
from typing import Any

import verifiers

from jaxrl.inference.protocol import SamplingParams

try:
    from verifiers.legacy import Environment, Rubric
    from verifiers.legacy.clients import OpenAIChatCompletionsClient
    from verifiers.legacy.errors import Error
    from verifiers.legacy.types import ClientConfig

    LEGACY_MISSING: str | None = None
except ImportError:  # verifiers 0.4 dropped the classic API; v1 environments still load (`jaxrl.envs.loader`)
    Environment = Rubric = OpenAIChatCompletionsClient = ClientConfig = None  # type: ignore[assignment,misc]
    Error = Exception  # type: ignore[assignment,misc]
    LEGACY_MISSING = (f"classic environments need verifiers 0.3.x (its verifiers.legacy API), and verifiers "
                      f"{verifiers.__version__} is installed: pip install 'verifiers==0.3.1'")

# The env var the client reads the server's API key from; our server ignores keys.
API_KEY_VAR = "JAXRL_API_KEY"


class ClassicLoadError(ValueError):
    """`load_environment` refused its arguments, raised, or returned something other than an Environment."""


class RewardFunctionError(Error):
    """A reward function of a classic env's rubric raised; the rollout fails with it."""


@dataclasses.dataclass(frozen=True)
class ClassicTask:
    """One dataset row of a classic env: `idx` its position in the split, `input` the row as
    `Environment.run_rollout` takes it (`prompt` messages, `example_id`, `answer`, `info`, ...)."""

    idx: int
    input: dict[str, Any]


@dataclasses.dataclass(eq=False)
class ClassicEnv:
    """A loaded classic environment and the chat clients held for it while `serving` (one per base URL)."""

    environment: Environment
    clients: dict[str, OpenAIChatCompletionsClient] | None = None

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Keeps one chat client per server for the rollouts run inside (a client costs an SSL context
        and a connection pool); closes them on exit."""
        self.clients = {}
        try:
            yield
        finally:
            clients, self.clients = list(self.clients.values()), None
            for client in clients:
                await client.close()


def needs_legacy(exc: BaseException) -> bool:
    """Whether importing an env module failed for want of verifiers' classic API on a verifiers without
    it: `vf.SingleTurnEnv` (an AttributeError on the `verifiers` module) or `from verifiers.legacy import`."""
    if LEGACY_MISSING is None:
        return False
    if isinstance(exc, AttributeError):
        return getattr(exc, "obj", None) is verifiers
    return isinstance(exc, ImportError) and (exc.name or "").startswith("verifiers")


def is_classic(module: types.ModuleType) -> bool:
    """Whether `module` is a classic env package: it defines a callable `load_environment`."""
    return callable(getattr(module, "load_environment", None))


def load(module: types.ModuleType, args: dict[str, Any]) -> tuple[ClassicEnv, list[ClassicTask], list[ClassicTask]]:
    """Calls `module.load_environment(**args)` and materialises its train and eval datasets.

    Returns the env, its train tasks and its eval tasks ([] without an eval dataset).
    Raises ClassicLoadError when verifiers.legacy is missing (verifiers 0.4 and later: `LEGACY_MISSING`),
    when `args` do not fit the function's signature, when it raises, when it returns anything but a
    verifiers `Environment`, or when building a dataset fails.
    """
    if LEGACY_MISSING is not None:
        raise ClassicLoadError(LEGACY_MISSING)
    fn = module.load_environment
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as e:
        raise ClassicLoadError(f"load_environment{inspect.signature(fn)} does not take args {args}: {e}") from None
    try:
        environment = fn(**args)
    except Exception as e:  # noqa: BLE001 - an env's own code, failing with any error
        raise ClassicLoadError(f"load_environment(**{args}) raised {type(e).__name__}: {e}") from e
    if not isinstance(environment, Environment):
        raise ClassicLoadError(f"load_environment returned {type(environment).__name__}, not a verifiers "
                               "Environment (SingleTurnEnv, MultiTurnEnv, ToolEnv, ...)")
    _fail_on_reward_errors(environment.rubric)
    try:
        train, evaluation = environment.build_dataset(), environment.build_eval_dataset()
    except Exception as e:  # noqa: BLE001
        raise ClassicLoadError(f"building its dataset failed: {type(e).__name__}: {e}") from e

    def tasks(dataset: Any) -> list[ClassicTask]:
        return [] if dataset is None else [ClassicTask(i, dict(row)) for i, row in enumerate(dataset)]

    return ClassicEnv(environment), tasks(train), tasks(evaluation)


def _fail_on_reward_errors(rubric: Rubric) -> None:
    """Makes a reward function that raises fail the rollout, in `rubric` and the rubrics it groups.

    verifiers.legacy's Rubric logs the error and scores the function 0.0
    (`Rubric._call_individual_reward_func`); training on that 0 would teach the policy the env's bug.
    Each call gets the function wrapped (`functools.wraps`: same signature, so the Rubric passes it the
    same arguments) to put the error on the rollout's state, where `trajectory_rollout` finds it.
    """
    for child in getattr(rubric, "rubrics", ()):
        _fail_on_reward_errors(child)
    call = rubric._call_individual_reward_func

    async def strict_call(func: Any, state: Any) -> float:
        @functools.wraps(func)
        async def strict(**kwargs: Any) -> Any:
            try:
                out = func(**kwargs)
                return await out if inspect.isawaitable(out) else out
            except Exception as e:
                if state.get("error") is None:
                    state["error"] = RewardFunctionError(
                        f"reward function {getattr(func, '__name__', func)!r} raised {type(e).__name__}: {e}")
                raise

        return await call(func=strict, state=state)

    rubric._call_individual_reward_func = strict_call  # type: ignore[method-assign]


def extra_sampling_fields(sampling: SamplingParams) -> dict[str, Any]:
    """The request's sampling settings beyond OpenAI's chat fields, as vLLM's extra request fields, each only
    where it acts: `top_k` (> 0), `repetition_penalty` (when `sampling.penalizes`), `min_tokens` (> 0). A
    classic rollout sends them in `extra_body`, a v1 rollout in its `vf.SamplingConfig`
    (`jaxrl.envs.loader.model_context`); jaxrl's server reads both."""
    fields: dict[str, Any] = {}
    if sampling.top_k > 0:
        fields["top_k"] = sampling.top_k
    if sampling.penalizes:
        fields["repetition_penalty"] = sampling.repetition_penalty
    if sampling.min_tokens:
        fields["min_tokens"] = sampling.min_tokens
    return fields


def sampling_args(environment: Environment, sampling: SamplingParams, seed_offset: int,
                  enable_thinking: bool | None = None) -> dict[str, Any]:
    """The rollout's sampling args: the env's own (`Environment.sampling_args`), then the run's
    [sampling] (its `enable_thinking` as the chat template's switch when set; None: the template's
    default), then what the trainer needs back:
    each sampled token's logprob and the token ids (vLLM's `return_token_ids`). A seeded request gets
    `seed + seed_offset`, so a group's rollouts differ."""
    own = dict(environment.sampling_args or {})
    extra = {**(own.pop("extra_body", None) or {}), "return_token_ids": True}
    if enable_thinking is not None:
        extra["chat_template_kwargs"] = {**extra.get("chat_template_kwargs", {}), "enable_thinking": enable_thinking}
    extra |= extra_sampling_fields(sampling)
    args = {**own, "temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens,
            "logprobs": True, "extra_body": extra}
    if sampling.seed is not None:
        args["seed"] = sampling.seed + seed_offset
    return args


def _client(base_url: str) -> OpenAIChatCompletionsClient:
    # No retries: the server is this process's own; a failed call fails the rollout at once.
    return OpenAIChatCompletionsClient(ClientConfig(api_base_url=base_url, api_key_var=API_KEY_VAR, max_retries=0))


@contextlib.asynccontextmanager
async def _client_for(env: ClassicEnv, base_url: str) -> AsyncIterator[OpenAIChatCompletionsClient]:
    """The client `env` holds for `base_url` while serving; otherwise one for this group alone."""
    if env.clients is not None:
        if base_url not in env.clients:
            env.clients[base_url] = _client(base_url)
        yield env.clients[base_url]
        return
    client = _client(base_url)
    try:
        yield client
    finally:
        await client.close()


Chain = tuple[list[int], list[bool], list[float]]


def chain_turns(steps: list[dict[str, Any]]) -> Chain:
    """One sample from a trajectory's per-turn tokens (`prompt_ids`, `completion_ids`, `completion_mask`,
    `completion_logprobs` of each step): a turn whose prompt begins with the sample so far appends its
    new prompt tokens (masked out) and its completion (mask from `completion_mask`, its logprobs); any
    other turn starts the sample again at its prompt. Prompt tokens carry logprob 0.0.

    Raises ValueError for a step without token ids or with lists of different lengths.
    """
    ids: list[int] = []
    mask: list[bool] = []
    lps: list[float] = []
    for n, step in enumerate(steps):
        tokens = step.get("tokens")
        if not tokens:
            raise ValueError(f"turn {n + 1} came back without token ids (the server must honour return_token_ids)")
        prompt, completion = list(tokens["prompt_ids"]), list(tokens["completion_ids"])
        completion_mask, logprobs = tokens["completion_mask"], tokens["completion_logprobs"]
        if not len(completion) == len(completion_mask) == len(logprobs):
            raise ValueError(f"turn {n + 1}: {len(completion)} completion ids, {len(completion_mask)} mask "
                             f"entries and {len(logprobs)} logprobs")
        if prompt[: len(ids)] != ids:
            ids, mask, lps = [], [], []
        new = prompt[len(ids):]
        ids += new + completion
        mask += [False] * len(new) + [bool(m) for m in completion_mask]
        lps += [0.0] * len(new) + [float(lp) if m else 0.0 for lp, m in zip(logprobs, completion_mask, strict=True)]
    return ids, mask, lps


def count_turns(messages: list[Any]) -> tuple[int, int]:
    """(assistant messages, tool calls they make) in `messages`, verifiers' message models or dicts alike."""
    turns = calls = 0
    for m in messages:
        get = m.get if isinstance(m, dict) else functools.partial(getattr, m)
        if get("role", None) == "assistant":
            turns += 1
            calls += len(get("tool_calls", None) or ())
    return turns, calls


def env_seconds(timing: Any) -> float:
    """Seconds of a classic rollout spent in the environment's own code (setup, `env_response`, the
    rubric), from verifiers' rollout timing (`RolloutTiming`, or its dict in a serialised output): its
    total less the model calls' spans; 0.0 when the output has none."""
    if timing is None:
        return 0.0
    get = timing.get if isinstance(timing, dict) else functools.partial(getattr, timing)
    model = get("model")
    model_s = model.get("duration", 0.0) if isinstance(model, dict) else model.duration
    return max(0.0, float(get("total") or 0.0) - float(model_s or 0.0))


def trajectory_rollout(output: dict[str, Any], env_name: str, example_id: int) -> dict[str, Any]:
    """`envs.Rollout` fields of a finished classic rollout (`Environment.run_rollout`'s output with the
    `trajectory` column). A rollout that errored, or has no sampled token, is failed with its error."""
    error = output.get("error_chain") or (str(output["error"]) if output.get("error") else None)
    chain: Chain = ([], [], [])
    if error is None:
        try:
            chain = chain_turns(output.get("trajectory") or [])
        except ValueError as e:
            error = str(e)
    if error is None and not any(chain[1]):
        error = f"the rollout has no sampled token (stop condition: {output.get('stop_condition')})"
    ok = error is None
    replies = [m for step in output.get("trajectory") or [] for m in step.get("completion") or []]
    turns, tool_calls = count_turns(replies)
    return {"turns": turns, "tool_calls": tool_calls, "token_ids": chain[0] if ok else [],
            "loss_mask": chain[1] if ok else [],
            "logprobs": chain[2] if ok else [], "reward": float(output.get("reward") or 0.0),
            "is_truncated": bool(output.get("is_truncated")), "ok": ok, "error": error, "env_name": env_name,
            "example_id": example_id, "env_s": env_seconds(output.get("timing"))}


async def run_group(env: ClassicEnv, task: ClassicTask, rollouts_per_example: int, *, base_url: str, model_name: str,
                    sampling: SamplingParams, env_name: str,
                    enable_thinking: bool | None = None) -> list[dict[str, Any]]:
    """Plays `task` `rollouts_per_example` times concurrently (rollout i seeded `seed + i`), each scored by the
    env's rubric on its own; returns `envs.Rollout` fields per rollout, in order. A rollout that fails
    comes back failed with its error, never as an exception."""
    environment = env.environment

    async def one(i: int, client: OpenAIChatCompletionsClient) -> dict[str, Any]:
        try:
            output = await environment.run_rollout(task.input, client, model_name,
                                                   sampling_args(environment, sampling, i, enable_thinking),
                                                   state_columns=["trajectory"])
        except Exception as e:  # noqa: BLE001 - an env's own code (rubric, env_response) failing
            return trajectory_rollout({"error": f"{type(e).__name__}: {e}"}, env_name, task.idx)
        return trajectory_rollout(output, env_name, task.idx)

    async with _client_for(env, base_url) as client:
        return list(await asyncio.gather(*(one(i, client) for i in range(rollouts_per_example))))
