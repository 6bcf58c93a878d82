"""Loading verifiers environments and running rollout groups through them.

An `[[env]]` entry names an installed verifiers v1 taskset package (`owner/name[@version]` imports
module `name`, dashes as underscores). `load_env` builds it with verifiers' own loader
(`resolve_env_config` + `load_environment`), and `run_group` plays one task `n` times through the
env. One rollout goes:

    Env.run_episode -> Agent.run -> Rollout (subprocess runtime: a scratch folder, no container)
      -> ChatHarness.launch, in this process: POST {interception}/v1/chat/completions
      -> verifiers' interception server -> TrainClient: Qwen3 renderer -> token ids
      -> POST {base_url without /v1}/inference/v1/generate (jaxrl.inference.server) -> token ids + logprobs
      -> the trace's message graph -> Task.score (@vf.reward) -> Trace -> `Rollout`

A multi-turn env (its `Env.run` drives `agent.interaction(task)`, answering each reply as the user)
resumes the harness on the conversation so far, and the trace stays one branch whose prompt extends
token for token (`jaxrl.rl.samples` turns it into training samples).

The default harness, `ChatHarness`, runs verifiers' plain chat loop in the trainer's process: the
stock `null`/`bash` harnesses run theirs as a PEP 723 script through `uv sync --script`, which needs
a package index and a process per rollout.

A module that exports no v1 Taskset or Env but a `load_environment(**args)` is a classic env
(SingleTurnEnv, MultiTurnEnv, ... from `verifiers.legacy`): it plays over the server's
`/v1/chat/completions` instead (`jaxrl.envs.classic`), which needs `chat_template` on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import json
import ssl
import sys
import types
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pydantic
import renderers.client
import verifiers.v1 as vf
from renderers import GLM45RendererConfig, Qwen3RendererConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.utils.loaders import env_config_type, load_environment, resolve_env_config

from jaxrl.envs import classic, mcp_tools
from jaxrl.envs.classic import ClassicEnv, ClassicTask
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.template import ChatTemplate

HARNESS_ID = "jaxrl-chat"
"""The in-process chat harness's verifiers id; verifiers imports it as module `jaxrl_chat`."""

# The env var verifiers reads the engine's API key from; our server ignores keys, and naming one
# other than the default PRIME_API_KEY keeps verifiers from reading the Prime CLI's config.
API_KEY_VAR = "JAXRL_API_KEY"


class ChatHarnessConfig(vf.HarnessConfig):
    id: str = HARNESS_ID
    request_timeout: float = pydantic.Field(3600.0, gt=0)
    """Seconds one model call may take before the rollout fails."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """A plain chat loop run in this process: one model call per segment, and with the rollout's MCP tool
    servers (`jaxrl.envs.mcp_tools`), their tools offered on every call and each reply's tool calls
    answered before the next call, until a reply calls none (verifiers' `null` harness loop).

    A multi-turn exchange (an env that answers as the user) resumes it on the conversation so far;
    verifiers keeps that one branch whose prompt extends token for token.
    """

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    SUPPORTS_MCP = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(message_to_wire(m) for m in prompt)
        tools = await mcp_tools.connect(mcp_urls, self.config.tool_timeout) if mcp_urls else None
        # Every model call goes through the interception endpoint (the harness contract): it
        # records the turn on the trace and applies the rollout's model and sampling.
        timeout = httpx.Timeout(self.config.request_timeout, connect=10)
        async with httpx.AsyncClient(timeout=timeout, verify=_ssl_context()) as c:
            while True:
                body: dict[str, Any] = {"model": ctx.model, "messages": messages}
                if tools is not None and tools.schemas:
                    body["tools"] = tools.schemas
                try:
                    response = await c.post(f"{endpoint.rstrip('/')}/chat/completions", json=body,
                                            headers={"Authorization": f"Bearer {secret}"})
                except httpx.TransportError as e:
                    return vf.ProgramResult(1, "", f"model call failed: {e!r}")
                if response.status_code != 200:
                    return vf.ProgramResult(1, "", f"model call failed ({response.status_code}): {response.text}")
                message = response.json()["choices"][0]["message"]
                calls = message.get("tool_calls") if tools is not None else None
                if not calls:
                    return vf.ProgramResult(0, response.text, "")
                messages.append({k: v for k, v in message.items() if v is not None})
                messages.extend([await mcp_tools.answer(tools, call) for call in calls])


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Built once: loading the CA bundle costs about 25 ms, which a client per call would pay.
    return ssl.create_default_context()


# verifiers resolves a harness id to an importable module exporting one Harness subclass via
# `__all__` (`jaxrl-chat` -> `jaxrl_chat`); a dotted id such as `jaxrl.envs.loader` cannot be used because
# its loader first probes `verifiers.v1.harnesses.<id>`, which fails on a dotted name.
_plugin = types.ModuleType("jaxrl_chat", "verifiers harness plugin: jaxrl.envs.loader.ChatHarness")
_plugin.ChatHarness = ChatHarness  # type: ignore[attr-defined]
_plugin.__all__ = ["ChatHarness"]
sys.modules.setdefault("jaxrl_chat", _plugin)


class EnvLoadError(ValueError):
    """An `[[env]]` entry that cannot be loaded: its message names the id and the module."""


@dataclasses.dataclass
class LoadedEnv:
    """A verifiers env and its materialised task lists.

    A v1 env (`vf.Env`): `tasks` is the train split (`tasks[i].data.idx == i`); `eval_tasks` the eval
    split, empty when the taskset has none (by convention, a taskset config field `split` that accepts
    "eval"). A classic env (`ClassicEnv`): its dataset and eval dataset rows (`tasks[i].idx == i`).
    `max_retries`: times a failed rollout is played again (`[[env]] max_retries`; `jaxrl.rl.rollouts`).
    """

    id: str
    module: str
    env: vf.Env | ClassicEnv
    tasks: list[vf.Task] | list[ClassicTask]
    eval_tasks: list[vf.Task] | list[ClassicTask]
    max_retries: int = 0

    @property
    def name(self) -> str:
        """The id without owner and version: "jaxrl/reverse-text@0.1" -> "reverse-text"."""
        return self.id.rsplit("/", 1)[-1].split("@", 1)[0]

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[LoadedEnv]:
        """Holds the env's shared serving resources (one interception server and engine client for
        all its rollouts) while `run_group` calls run inside; without it, each rollout starts its own
        (about 4x slower per rollout on 2 cores). Enter it once per env at a time, in the event loop
        that runs the groups."""
        async with self.env.serving():
            yield self

    @property
    def classic(self) -> bool:
        """Whether this is a classic env (`load_environment(**args)`), played over /v1/chat/completions."""
        return isinstance(self.env, ClassicEnv)


@dataclasses.dataclass
class Rollout:
    """One trace, as the trainer consumes it.

    token_ids: prompt + completion tokens of the trace's last branch (for a multi-turn trace, every
    turn's prompt and reply in order). loss_mask: True exactly on sampled tokens. logprobs: the
    engine's logprob of each sampled token, 0.0 on prompt tokens. reward: the taskset's weighted
    reward sum. is_truncated: a length-capped last reply or a turn/token limit. ok: verifiers'
    `trace.ok` and at least one sampled token; a failed rollout has empty lists and `error` set.
    turns: the model's replies (assistant turns) in the conversation. tool_calls: the tool calls those
    replies made (OpenAI `tool_calls` entries; `classic.count_turns`). env_s: seconds the rollout spent in
    its environment's own code, waiting on the engine excluded (`env_seconds`; 0.0 for a rollout that
    never ran).
    """

    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    reward: float
    is_truncated: bool
    ok: bool
    error: str | None
    env_name: str
    example_id: int | None
    turns: int = 0
    tool_calls: int = 0
    env_s: float = 0.0


def module_name(env_id: str) -> str:
    """The module verifiers imports for `env_id`: "owner/my-env@1.0" -> "my_env"."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _env_config(env_id: str, args: dict, taskset: dict, harness: dict) -> dict:
    """Raw verifiers env config for an `[[env]]` entry.

    `args` (the classic `load_environment()` arguments) and `[env.taskset]` both configure the v1
    taskset, the latter winning. `[env.harness]` keys that verifiers 0.3.1 keeps on the agent seat
    (`max_turns`, `timeout`, `sampling`, `runtime`, ...) go to every seat of the env; the rest
    configure the harness, `ChatHarness` unless an `id` names another.
    """
    seat_keys = set(vf.AgentConfig.model_fields) - {"harness", "model", "client"}
    seat = {k: v for k, v in harness.items() if k in seat_keys}
    seat.setdefault("runtime", {"type": "subprocess"})
    seat["harness"] = {"id": HARNESS_ID} | {k: v for k, v in harness.items() if k not in seat_keys}
    fields = env_config_type(env_id).model_fields
    seats = [name for name, field in fields.items() if isinstance(field.default, vf.AgentConfig)]
    return {"taskset": {**args, **taskset, "id": env_id}} | {name: seat for name in seats}


def _materialise(taskset: vf.Taskset, where: str) -> list[vf.Task]:
    """The taskset's tasks, each with `data.idx` its position (verifiers 0.3.1 leaves `idx` to the
    taskset author; the buffer keys examples by it)."""
    if taskset.INFINITE:
        raise EnvLoadError(f"{where}: its taskset is infinite; bound it in its config")
    try:
        tasks = list(taskset)
    except Exception as e:  # noqa: BLE001 - a taskset whose load() fails, with any error
        raise EnvLoadError(f"{where}: loading its tasks failed: {type(e).__name__}: {e}") from e
    for i, task in enumerate(tasks):
        if task.data.idx != i:
            task.data = task.data.model_copy(update={"idx": i})
    return tasks


def _exports_v1(module: types.ModuleType) -> bool:
    """Whether `module` exports a v1 Taskset or Env subclass in `__all__` (what verifiers' v1 loader takes)."""
    exported = (getattr(module, name, None) for name in getattr(module, "__all__", ()))
    return any(isinstance(obj, type) and issubclass(obj, vf.Taskset | vf.Env) for obj in exported)


def installed_version(module: str) -> str | None:
    """The version of the installed distribution that provides top-level `module`; None when none does."""
    dists = importlib.metadata.packages_distributions().get(module)
    return importlib.metadata.version(dists[0]) if dists else None


def load_env(
    env_id: str, args: dict | None = None, taskset: dict | None = None, harness: dict | None = None,
    version: str | None = None,
) -> LoadedEnv:
    """Loads an `[[env]]` entry and materialises its tasks, by what its module exports: a v1 Taskset or
    Env subclass through verifiers' v1 loader; otherwise a classic `load_environment(**args)`
    (`jaxrl.envs.classic`), which takes no `[env.taskset]` / `[env.harness]` tables. `version` (else
    the id's `@version`) pins the installed package's version.

    Raises EnvLoadError (naming the id and the module) when the module is not importable, is not the
    pinned version, exports neither, rejects the config or args, fails to load, or loads no train task.
    """
    args, taskset, harness = dict(args or {}), dict(taskset or {}), dict(harness or {})
    module = module_name(env_id)
    where = f"environment {env_id!r} (module {module!r})"
    try:
        imported = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - an env package that fails while importing
        if classic.needs_legacy(e):
            raise EnvLoadError(f"{where}: {classic.LEGACY_MISSING}") from e
        if isinstance(e, ImportError):
            raise EnvLoadError(f"{where} is not importable; install its package (pip install -e ...): {e}") from e
        raise EnvLoadError(f"{where} failed to import: {type(e).__name__}: {e}") from e
    pinned = version or (env_id.split("@", 1)[1] if "@" in env_id else None)
    if pinned is not None and (installed := installed_version(module)) != pinned:
        have = f"the installed package is version {installed}" if installed else "no installed package provides it"
        raise EnvLoadError(f"{where}: version {pinned} is pinned, but {have}")
    if not _exports_v1(imported) and classic.is_classic(imported):
        return _load_classic(env_id, module, imported, args, taskset, harness, where)
    try:
        config = resolve_env_config(_env_config(env_id, args, taskset, harness))
        env = load_environment(config)
    except pydantic.ValidationError as e:
        raise EnvLoadError(f"{where}: invalid config: {e}") from e
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise EnvLoadError(f"{where} could not be loaded: {e}") from e
    tasks = _materialise(env.taskset, where)
    if not tasks:
        raise EnvLoadError(f"{where}: the taskset loaded no task")
    eval_tasks: list[vf.Task] = []
    taskset_cls = type(config.taskset)
    if "split" in taskset_cls.model_fields:
        try:
            eval_config = taskset_cls.model_validate({**config.taskset.model_dump(), "split": "eval"})
        except pydantic.ValidationError:
            eval_config = None
        if eval_config is not None and eval_config != config.taskset:
            eval_tasks = _materialise(type(env.taskset)(eval_config), where)
    return LoadedEnv(id=env_id, module=module, env=env, tasks=tasks, eval_tasks=eval_tasks)


def _load_classic(env_id: str, module: str, imported: types.ModuleType, args: dict, taskset: dict,
                  harness: dict, where: str) -> LoadedEnv:
    if taskset or harness:
        tables = " and ".join(t for t, v in (("[env.taskset]", taskset), ("[env.harness]", harness)) if v)
        raise EnvLoadError(f"{where} is a classic environment (load_environment); it takes `args` only, "
                           f"not {tables}")
    try:
        env, tasks, eval_tasks = classic.load(imported, args)
    except classic.ClassicLoadError as e:
        raise EnvLoadError(f"{where}: {e}") from e
    if not tasks:
        raise EnvLoadError(f"{where}: load_environment returned an environment without a train dataset")
    return LoadedEnv(id=env_id, module=module, env=env, tasks=tasks, eval_tasks=eval_tasks)


def chat_template(
    loaded: Sequence[LoadedEnv], tokenizer_path: str | Path, model_path: str | Path
) -> ChatTemplate | None:
    """The chat template the run's server needs for `/v1/chat/completions` when a classic env is among
    `loaded` (they play over that route); None otherwise, so a run of v1 envs alone never imports
    transformers. End-of-turn ids as `ChatTemplate.load` takes them (the model's generation config).

    Raises EnvLoadError naming the classic envs when the tokenizer has no chat template.
    """
    chatting = [env.id for env in loaded if env.classic]
    if not chatting:
        return None
    try:
        return ChatTemplate.load(tokenizer_path, model_path)
    except ValueError as e:
        raise EnvLoadError(f"classic environment(s) {', '.join(map(repr, chatting))} play over "
                           f"/v1/chat/completions, which needs a chat template: {e}") from None


@functools.cache
def renderer_config(tokenizer_path: str | Path, enable_thinking: bool) -> Any:
    """The renderers package's config for the model in `tokenizer_path`: GLM-4.5's (`glm-4.5`) where the folder's
    `config.json` has model_type "glm4_moe" (GLM-4.5, INTELLECT-3), else Qwen3's."""
    config = Path(tokenizer_path) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type == "glm4_moe":
        return GLM45RendererConfig(enable_thinking=enable_thinking)
    return Qwen3RendererConfig(enable_thinking=enable_thinking)


def model_context(
    base_url: str, model_name: str, tokenizer_path: str | Path, sampling: SamplingParams, seed_offset: int = 0,
    enable_thinking: bool | None = None,
) -> vf.ModelContext:
    """The verifiers model context of a rollout against our server at `base_url` (".../v1").

    The renderer is named explicitly (`renderer_config`), thinking as `enable_thinking` (`[sampling]
    enable_thinking`; None: off): given a local tokenizer folder, verifiers' automatic choice would fall back to a
    default renderer without the model's tool-call parsing.
    `sampling.stop_token_ids` is not forwarded: the renderer always sends its own (Qwen3: `<|im_end|>`,
    `<|endoftext|>`). A seeded request gets `seed + seed_offset`, so a group's rollouts differ.
    """
    client = vf.TrainClientConfig(
        base_url=base_url,
        api_key_var=API_KEY_VAR,
        renderer=renderer_config(tokenizer_path, bool(enable_thinking)),
        renderer_model_name=str(tokenizer_path),
    )
    fields: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        **classic.extra_sampling_fields(sampling),
    }
    if sampling.seed is not None:
        fields["seed"] = sampling.seed + seed_offset
    return vf.ModelContext(model=model_name, client=client, sampling=vf.SamplingConfig(**fields))


def env_seconds(timing: vf.Timing) -> float:
    """Seconds of a v1 trace spent in the environment's own code, from verifiers' trace timing: booting
    and setting up its runtime, the harness's time between model calls (tool calls, message handling),
    finalizing and scoring; the model calls (`agent.model`: each call's wall time through the interception
    server, so the engine's queueing and decoding) are what is left out."""
    spans = (timing.boot, timing.setup, timing.finalize, timing.scoring)
    return sum(span.duration for span in spans) + timing.agent.harness.duration


def trace_rollout(trace: vf.Trace, env_name: str, failure: str | None = None) -> Rollout:
    """The `Rollout` of a finished trace (its last branch); `failure` fails it regardless (an
    episode-level error)."""
    branch = trace.branches[-1] if trace.branches else None
    mask = branch.sampled_mask if branch is not None else []
    turns, tool_calls = classic.count_turns(branch.messages if branch is not None else [])
    ok = trace.ok and any(mask) and failure is None
    error = failure or (trace.errors[-1].message if trace.errors else None)
    if not ok and error is None:
        error = "the trace has no sampled token" if trace.ok else f"trace failed: {trace.stop_condition}"
    return Rollout(
        token_ids=branch.token_ids if ok and branch else [],
        loss_mask=mask if ok else [],
        logprobs=branch.logprobs if ok and branch else [],
        reward=trace.reward,
        is_truncated=trace.is_truncated,
        ok=ok,
        error=None if ok else error,
        env_name=env_name,
        example_id=trace.task.data.idx,
        turns=turns,
        tool_calls=tool_calls,
        env_s=env_seconds(trace.timing),
    )


async def run_group(
    env: LoadedEnv,
    task: vf.Task | ClassicTask | int,
    rollouts_per_example: int,
    *,
    base_url: str,
    model_name: str,
    tokenizer_path: str | Path,
    sampling: SamplingParams,
    enable_thinking: bool | None = None,
) -> list[Rollout]:
    """Plays `task` (or `env.tasks[task]`) `rollouts_per_example` times concurrently; one `Rollout` per trainable
    trace, in episode order (one per episode for a single-agent env); `enable_thinking` is the chat
    template's thinking switch.

    A classic env plays over `{base_url}/chat/completions` (`jaxrl.envs.classic.run_group`).
    A rollout that fails (model call, harness, reward function, ...) comes back with ok=False and its
    error, never as an exception. Raises IndexError for a task index out of range.
    """
    if isinstance(task, int):
        task = env.tasks[task]
    if isinstance(env.env, ClassicEnv):
        assert isinstance(task, ClassicTask)
        fields = await classic.run_group(env.env, task, rollouts_per_example, base_url=base_url, model_name=model_name,
                                         sampling=sampling, env_name=env.name, enable_thinking=enable_thinking)
        return [Rollout(**f) for f in fields]
    assert isinstance(task, vf.Task)
    rebind_renderers_lock()
    episodes = await asyncio.gather(
        *(
            env.env.run_episode(task, model_context(base_url, model_name, tokenizer_path, sampling, i, enable_thinking))
            for i in range(rollouts_per_example)
        )
    )
    return [r for episode in episodes for r in _episode_rollouts(episode, env.name)]


def rebind_renderers_lock() -> None:
    """renderers 0.1.12 guards its one-time `GET /v1/models` lookup with a module-level asyncio.Lock
    (renderers/client.py:68), which binds to the first event loop that waits on it; in any later loop
    a contended lookup then fails every waiting rollout ("bound to a different event loop"). Give a
    new loop a fresh lock."""
    lock = getattr(renderers.client, "_max_prompt_len_lock", None)
    bound = getattr(lock, "_loop", None)
    if isinstance(lock, asyncio.Lock) and bound is not None and bound is not asyncio.get_running_loop():
        renderers.client._max_prompt_len_lock = asyncio.Lock()


def _episode_rollouts(episode: vf.Episode, env_name: str) -> Sequence[Rollout]:
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    # An episode error is the env's own run()/finalize() failing, possibly after some traces finished.
    failure = episode.errors[-1].message if episode.errors else None
    if not traces:
        error = failure or "the episode produced no trace"
        return [Rollout([], [], [], 0.0, False, False, error, env_name, episode.task.data.idx)]
    return [trace_rollout(t, env_name, failure) for t in traces]
