"""The rollout side of a run: this host's engine and its scheduler, the OpenAI-compatible server in front
of it, the run's event loop, the environments' CPU share and the evaluator (`[eval]`, `[val]`).

An RL run plays its rollouts and its eval through it; an SFT run starts it only for `[eval]` / `[val]`.
`Serving(...)` starts everything but compiles nothing; `compile_engine` compiles the engine's programs,
`serve_envs` starts the environments' servers for the whole run, `note_tasks` records the tasks running
before the first group (`close` settles them), `close` stops it all. What it plays, the training and eval
environments and the chat template classic ones need, is one `RunEnvs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from rich.console import Console

from jaxrl.compile import run_pool
from jaxrl.config.schema import SEED_MULTIPLIER, ConfigError, RunConfig
from jaxrl.envs import loader
from jaxrl.inference.chunked import make_scheduler
from jaxrl.inference.engine import Engine
from jaxrl.inference.lockstep import GroupScheduler
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.inference.server import start_server
from jaxrl.inference.template import ChatTemplate
from jaxrl.model.config import ModelConfig
from jaxrl.parallel import distributed
from jaxrl.rl import rollouts
from jaxrl.rl.producer import VersionLog
from jaxrl.run import evaluate, resources
from jaxrl.run.placement import Placement


def params_dtype(cfg: RunConfig) -> Any:
    """The dtype of the engine's weights and cache, and of the frozen base: `[jax] dtype`."""
    return jnp.bfloat16 if cfg.jax.dtype == "bfloat16" else jnp.float32


def sampling_params(cfg: RunConfig) -> SamplingParams:
    """The rollouts' sampling (`[sampling]`; `max_tokens` defaults to `[jax] seq_len - 1`)."""
    s = cfg.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          repetition_penalty=s.repetition_penalty or 1.0, min_tokens=s.min_tokens or 0,
                          max_tokens=s.max_tokens or cfg.jax.seq_len - 1)


def run_engine(cfg: RunConfig, mcfg: ModelConfig, placement: Placement, say: Any = print) -> Engine:
    """The run's rollout engine on `placement.engine_mesh`: `[jax] decode_slots` slots of `seq_len`
    positions, `kv_cache_tokens` (unset on an accelerator: the pool that fits, sized now, saying so with
    `say`: `jaxrl.compile.run_pool.startup_kv_cache_tokens`), the cache in `[jax] dtype`, LoRA at
    `lora_alpha / lora_rank`, `decode_steps_per_dispatch` (unset: the engine's default). Raises ConfigError
    (key `jax.kv_cache_tokens`) when sizing the pool fails."""
    jcfg = cfg.jax
    kv_tokens = run_pool.startup_kv_cache_tokens(cfg, mcfg, placement.mesh, placement.engine_mesh,
                                                 placement.micro_batch, say)
    steps = jcfg.decode_steps_per_dispatch
    steps = {} if steps is None else {"decode_steps_per_dispatch": steps}
    return Engine(mcfg, placement.engine_mesh, jcfg.decode_slots, jcfg.seq_len,
                  lora_scale=cfg.lora_alpha / jcfg.lora_rank, cache_dtype=params_dtype(cfg),
                  kv_cache_tokens=kv_tokens, **steps)


@dataclasses.dataclass(frozen=True)
class RunEnvs:
    """What a run's rollouts play: the training environments (`train`, `[[env]]` in order), the eval ones
    (`eval`, `[[eval.env]]`) and the chat template the server renders classic environments' chats with
    (`chat_template`, `jaxrl.envs.loader.chat_template`: None when none is classic)."""

    train: list[loader.LoadedEnv]
    eval: list[loader.LoadedEnv]
    chat_template: ChatTemplate | None

    @classmethod
    def load(cls, cfg: RunConfig, tokenizer_path: Path | str, model_path: Path | str) -> RunEnvs:
        """The run's environments, each `[[env]]` with its `max_retries`. Raises ConfigError (key
        `env.<i>.id`, `eval.env.<i>.id` or `env`) when one cannot be loaded or the tokenizer has no chat
        template a classic environment needs."""
        train = []
        for i, e in enumerate(cfg.env):
            try:
                env = loader.load_env(e.id, e.args, e.taskset, e.harness, e.version)
                train.append(dataclasses.replace(env, max_retries=e.max_retries or 0))
            except loader.EnvLoadError as exc:
                raise ConfigError(cfg.source, [(f"env.{i}.id", str(exc))]) from None
        eval_envs = evaluate.load_eval_envs(cfg)  # [[eval.env]]
        try:  # classic envs play over the server's /v1/chat/completions
            template = loader.chat_template(train + eval_envs, tokenizer_path, model_path)
        except loader.EnvLoadError as exc:
            raise ConfigError(cfg.source, [("env", str(exc))]) from None
        return cls(train, eval_envs, template)


class Serving:
    """The engine (`jaxrl.inference.engine.Engine` on `placement.engine_mesh`, given `params` as policy
    `start_step`) behind its scheduler (`scheduler`: one per process, or a `GroupScheduler` stepping one
    engine over an engine group, which then pauses for device programs spanning hosts), `versions` (the
    policy version of each token it samples, `jaxrl.rl.producer.VersionLog`), the server (`server`;
    `client`: how the environments reach it), the run's event loop (`loop`) with the environments' CPU
    share (`in_flight`: the bound on rollouts running at once, or None) and the `evaluator`. The engine's
    seeds start at `sampling_seed * SEED_MULTIPLIER + start_step`."""

    def __init__(self, cfg: RunConfig, mcfg: ModelConfig, placement: Placement, params: dict[str, Any],
                 start_step: int, envs: RunEnvs, tokenizer_path: Path | str, console: Console,
                 secrets: list[str]) -> None:
        jcfg = cfg.jax
        self.console, self.envs = console, envs
        engine = run_engine(cfg, mcfg, placement, console.print)
        seed, hosts = cfg.sampling_seed * SEED_MULTIPLIER + start_step, placement.engine_hosts
        console.print(f"rollout engine: one over {hosts} processes (engine_hosts = {hosts})" if hosts > 1
                      else "rollout engine: one per process")
        if hosts > 1:
            self.scheduler: Scheduler | GroupScheduler = GroupScheduler(
                engine, params, cfg.model, distributed.Exchange(placement.engine_group), seed=seed)
            distributed.set_fence(self.scheduler.paused)  # device programs spanning hosts pause it
        else:
            self.scheduler = make_scheduler(engine, params, model_name=cfg.model, seed=seed,
                                            keep_turns=jcfg.kv_reuse_turns)
        self.scheduler.policy_version = start_step
        self.versions = VersionLog(self.scheduler)  # each sampled token's policy version
        self.server = start_server(self.versions, host=jcfg.host, port=jcfg.port, chat_template=envs.chat_template,
                                   clamp_max_tokens=True)
        self.sampling = sampling_params(cfg)
        self.client = {"base_url": self.server.base_url, "model_name": cfg.model, "tokenizer_path": tokenizer_path,
                       "enable_thinking": cfg.sampling.enable_thinking}
        self.loop = asyncio.new_event_loop()  # one loop for the run: verifiers' HTTP clients outlive a step
        env_resources = resources.env_resources(cfg.infrastructure.compute_size)
        resources.apply(self.loop, env_resources)
        self.in_flight = asyncio.Semaphore(env_resources.max_in_flight) if env_resources.max_in_flight else None
        console.print(env_resources.describe(cfg.infrastructure.compute_size))
        self.evaluator = evaluate.Evaluator(cfg, envs.train, envs.eval, self.client, self.sampling, console, secrets,
                                            self.in_flight)  # [eval]
        self.stack = contextlib.AsyncExitStack()  # the environments' servers
        self.tasks: set[asyncio.Task] | None = None  # the tasks running before the first group

    def compile_engine(self) -> None:
        """Compile the engine's prefill buckets and decode step (`Scheduler.warmup`), printing the time."""
        loop = self.loop
        # Rollouts in flight are cancelled at every run's end, not only on a signal.
        loop.set_exception_handler(lambda lp, context: None if isinstance(
            context.get("exception"), asyncio.CancelledError) else lp.default_exception_handler(context))
        t_warm = time.perf_counter()
        buckets = loop.run_until_complete(self.scheduler.warmup(self.sampling))
        self.console.print(f"engine compiled ({buckets} prefill buckets + decode) in "
                           f"{time.perf_counter() - t_warm:.1f}s")

    def serve_envs(self) -> None:
        """Serve the environments (training and eval) for the whole run: one interception server and client
        per environment, closed by `close`."""
        for env in self.envs.train:
            self.loop.run_until_complete(self.stack.enter_async_context(env.serving()))
        self.loop.run_until_complete(self.stack.enter_async_context(self.evaluator.serving()))

    def note_tasks(self) -> None:
        """Record the tasks running now, before any group is launched: `close` settles them."""
        self.tasks = asyncio.all_tasks(self.loop)

    def publish(self, params: dict[str, Any], version: int) -> None:
        """Hand the engine `params` as policy `version` (between two decode steps)."""
        self.scheduler.update_params(params, version=version)

    def evaluate(self, step: int, stop: Any) -> dict[str, float]:
        """`[eval]` / `[val]` metrics when due after step `step` (`evaluate.Evaluator.run`), else {}."""
        return self.evaluator.run(step, self.loop, stop)

    def close(self) -> None:
        """Stop the environments' servers, the event loop, the server and the scheduler."""
        if self.tasks is not None:
            self.loop.run_until_complete(rollouts.settle(self.tasks, timeout_s=10.0))
        self.loop.run_until_complete(self.stack.aclose())
        self.loop.close()
        self.server.stop()
        self.scheduler.stop()
