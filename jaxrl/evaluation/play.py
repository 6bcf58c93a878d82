"""Playing an environment's examples against an `Endpoint` and keeping each rollout as a results row.

A classic environment (`load_environment`) plays through verifiers' own `Environment.run_rollout` with
an OpenAI chat client on the endpoint, and its output (prompt, completion, reward, metrics) is the row.
A v1 environment plays `Env.run_episode`: against jaxrl's own server with the training path's model
context (`jaxrl.envs.loader.model_context`: the Qwen3 renderer, token ids through `/inference/v1/generate`),
against a remote endpoint with verifiers' eval client (chat completions); an episode's reward is the mean
of its scored traces (verifiers' GEPA adapter scores an episode the same way).

A rollout that fails (a model call, the environment's code, a reward function) is a row with `error` set
(why it failed, in one line where the library gives a chain of causes) and reward 0.0, never an exception;
its prompt is the example's own when the rollout failed before any message was recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

from jaxrl.config.schema import SamplingConfig
from jaxrl.envs import loader
from jaxrl.envs.classic import ClassicEnv, ClassicTask, ClientConfig, OpenAIChatCompletionsClient  # verifiers 0.3
from jaxrl.evaluation.endpoint import Endpoint
from jaxrl.inference.protocol import SamplingParams


@dataclasses.dataclass(frozen=True)
class Row:
    """One rollout of one example, as `results.jsonl` holds it: `example_id` (the example's position in the
    split played), `rollout_idx` (0 .. rollouts_per_example - 1), `prompt` and `completion` (chat messages,
    OpenAI's wire form), `reward` (the environment's weighted reward; 0.0 when failed), `metrics` (each
    reward function's and metric's value by name), `is_truncated`, `error` (None unless it failed)."""

    example_id: int
    rollout_idx: int
    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    reward: float
    metrics: dict[str, float]
    is_truncated: bool
    error: str | None


def examples(env: loader.LoadedEnv, num_examples: int) -> list[vf.Task] | list[ClassicTask]:
    """The first `num_examples` (-1 = all) of the environment's eval split, else of its train split (as
    `[eval]` in a run picks them: `jaxrl.run.evaluate`)."""
    tasks = env.eval_tasks or env.tasks
    return list(tasks if num_examples == -1 else tasks[:num_examples])


def sampling_params(sampling: SamplingConfig, default_max_tokens: int) -> SamplingParams:
    """`[sampling]` / `-S` as the engine's request settings; `default_max_tokens` when it sets none."""
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          repetition_penalty=sampling.repetition_penalty or 1.0,
                          max_tokens=sampling.max_tokens or default_max_tokens, min_tokens=sampling.min_tokens or 0,
                          seed=sampling.seed)


def chat_sampling_args(sampling: SamplingConfig, seed_offset: int) -> dict[str, Any]:
    """OpenAI chat completion arguments for `sampling`: temperature, top_p, max_tokens and seed (+
    `seed_offset`, so an example's rollouts differ) as OpenAI's fields, vLLM's others (top_k,
    repetition_penalty, min_tokens, the chat template's enable_thinking) in `extra_body`."""
    args: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.max_tokens is not None:
        args["max_tokens"] = sampling.max_tokens
    if sampling.seed is not None:
        args["seed"] = sampling.seed + seed_offset
    extra: dict[str, Any] = {}
    if sampling.top_k > 0:
        extra["top_k"] = sampling.top_k
    if sampling.repetition_penalty is not None:
        extra["repetition_penalty"] = sampling.repetition_penalty
    if sampling.min_tokens:
        extra["min_tokens"] = sampling.min_tokens
    if sampling.enable_thinking is not None:
        extra["chat_template_kwargs"] = {"enable_thinking": sampling.enable_thinking}
    return args | ({"extra_body": extra} if extra else {})


def chat_client(endpoint: Endpoint) -> OpenAIChatCompletionsClient:
    """verifiers' classic OpenAI chat client on `endpoint` (no retries on jaxrl's own server, whose failures
    are not transient; verifiers' default on a remote one)."""
    config = ClientConfig(api_base_url=endpoint.base_url, api_key_var=endpoint.api_key_var)
    if endpoint.local:
        config = ClientConfig(api_base_url=endpoint.base_url, api_key_var=endpoint.api_key_var, max_retries=0)
    return OpenAIChatCompletionsClient(config)


def model_context(endpoint: Endpoint, sampling: SamplingConfig, seed_offset: int, seq_len: int) -> vf.ModelContext:
    """The v1 model context of one rollout on `endpoint` (see the module docstring)."""
    if endpoint.local:
        return loader.model_context(endpoint.base_url, endpoint.model, endpoint.tokenizer_path,
                                    sampling_params(sampling, seq_len), seed_offset, sampling.enable_thinking)
    client = vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var=endpoint.api_key_var)
    return vf.ModelContext(model=endpoint.model, client=client,
                           sampling=vf.SamplingConfig(**chat_sampling_args(sampling, seed_offset)))


def _text_messages(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [dict(m) if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages or []]


def error_text(error: Any) -> str:
    """A rollout's error as one readable string: verifiers' classic error record (a dict whose
    `error_chain_repr` is the chain of causes, `ModelError() -> APIConnectionError(...) -> ...`) by its chain,
    anything else as `str`."""
    if isinstance(error, dict):
        return str(error.get("error_chain_repr") or error.get("message") or error.get("error") or error)
    return str(error)


def first_line(error: str) -> str:
    """An error's first non-blank line, at most 300 characters (the console's one line about it)."""
    return next((line.strip()[:300] for line in error.splitlines() if line.strip()), error[:300])


def classic_row(output: dict[str, Any], example_id: int, rollout_idx: int) -> Row:
    """The row of a classic `Environment.run_rollout` output."""
    error = output.get("error")
    return Row(example_id, rollout_idx, _text_messages(output.get("prompt")),
               _text_messages(output.get("completion")), 0.0 if error else float(output.get("reward") or 0.0),
               {k: float(v) for k, v in (output.get("metrics") or {}).items() if v is not None},
               bool(output.get("is_truncated")), error_text(error) if error else None)


def task_prompt(task: vf.Task) -> list[dict[str, Any]]:
    """A v1 task's opening messages (its system prompt, then its prompt), OpenAI's wire form: what a rollout
    that failed before recording any message was asked."""
    data = task.data
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt is not None else []
    return system + _text_messages(data.prompt)


def episode_reward(episode: vf.Episode) -> float:
    """The mean reward of the episode's traces that recorded rewards; 0.0 when none did
    (`verifiers.v1.gepa.adapter._episode_score`'s rule)."""
    scored = [t.reward for t in episode.traces if t.rewards]
    return sum(scored) / len(scored) if scored else 0.0


def episode_row(episode: vf.Episode, example_id: int, rollout_idx: int, task: vf.Task | None = None) -> Row:
    """The row of a v1 episode: its first trace's messages split at the first reply (`task`'s prompt,
    when given, if no trace recorded a message), its reward (`episode_reward`), the reward functions' and
    metrics' values of its traces."""
    traces = episode.traces
    errors = [e.message for e in episode.errors] + [e.message for t in traces for e in t.errors]
    messages = [message_to_wire(m) for m in traces[0].messages] if traces else []
    if not messages and task is not None:
        messages = task_prompt(task)
    first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    metrics: dict[str, float] = {}
    for t in traces:
        metrics |= {name: float(r.value) for name, r in t.rewards.items() if r is not None}
        metrics |= {name: float(v) for name, v in t.metrics.items() if v is not None}
    ok = bool(traces) and all(t.ok for t in traces) and not episode.errors
    error = None if ok else (errors[-1] if errors else "the episode failed without an error message")
    return Row(example_id, rollout_idx, messages[:first_reply], messages[first_reply:],
               episode_reward(episode) if ok else 0.0, metrics, any(t.is_truncated for t in traces), error)


async def play(env: loader.LoadedEnv, tasks: list, rollouts_per_example: int, endpoint: Endpoint,
               sampling: SamplingConfig, concurrency: int, seq_len: int) -> list[Row]:
    """Every task of `tasks` (`examples`) played `rollouts_per_example` times, at most `concurrency`
    rollouts at once; rows in (example, rollout) order. Rollout r of example e is seeded
    `sampling.seed + e * rollouts_per_example + r` when `sampling.seed` is set."""
    gate = asyncio.Semaphore(concurrency)
    loader.rebind_renderers_lock()  # a fresh event loop: renderers' module lock must not be bound to an old one
    jobs = [(e, r) for e in range(len(tasks)) for r in range(rollouts_per_example)]
    if isinstance(env.env, ClassicEnv):
        environment = env.env.environment
        client = chat_client(endpoint)

        async def classic_one(e: int, r: int) -> Row:
            task: ClassicTask = tasks[e]
            args = {**(environment.sampling_args or {}), **chat_sampling_args(sampling, e * rollouts_per_example + r)}
            async with gate:
                try:
                    output = await environment.run_rollout(task.input, client, endpoint.model, args)
                except Exception as exc:  # noqa: BLE001 - the environment's own code, failing with any error
                    output = {"error": f"{type(exc).__name__}: {exc}", "prompt": task.input.get("prompt")}
            return classic_row(output, e, r)

        try:
            return list(await asyncio.gather(*(classic_one(e, r) for e, r in jobs)))
        finally:
            await client.close()

    async def v1_one(e: int, r: int) -> Row:
        ctx = model_context(endpoint, sampling, e * rollouts_per_example + r, seq_len)
        async with gate:
            episode = await env.env.run_episode(tasks[e], ctx)
        return episode_row(episode, e, r, tasks[e])

    async with env.serving():
        return list(await asyncio.gather(*(v1_one(e, r) for e, r in jobs)))
