"""A request as the scheduler (`jaxrl.inference.scheduler`) holds it, from its queueing to its completion
(`Request`), and what a dispatched prefill or dispatch of decode steps sampled, not read yet (`Sampled`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import jax

from jaxrl.inference.protocol import Completion, SamplingParams


@dataclasses.dataclass
class Request:
    """One request. `loop` and `future` are None for a request that another process of an engine group
    queued (`jaxrl.inference.lockstep`): this process steps it, but only its owner hands it out."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    loop: asyncio.AbstractEventLoop | None
    future: asyncio.Future | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    queued_at: float = dataclasses.field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    on_token: Callable[..., None] | None = None
    slot: int | None = None  # the decode slot it holds, None once its last token is dispatched
    dispatched: int = 0  # tokens dispatched to the device, read or not
    done: bool = False  # finished or cancelled: tokens still in flight for it are discarded
    origin: tuple[int, int] | None = None  # (process, number) in an engine group
    key: jax.Array | None = None  # its PRNG key, kept for a recompute after preemption
    admitted: int = 0  # the scheduler's count of admissions when it took its slot
    streamed: int = 0  # tokens given to `on_token` (a recompute after preemption does not give them again)
    epoch: int = 0  # the scheduler's weights (`Scheduler._epoch`) when it was prefilled

    def add(self, token: int, logprob: float, version: int, top: list[tuple[int, float]] | None = None) -> bool:
        """Record a sampled token (and its alternatives, for a request that asked for `top_logprobs`); True
        when the request is finished."""
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.queued_at
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if top is not None:
            self.top.append(top)
        if self.on_token is not None and len(self.tokens) > self.streamed:
            self.streamed += 1
            args = (token, logprob) if top is None else (token, logprob, top)
            self.loop.call_soon_threadsafe(self.on_token, *args)
        return token in self.params.stop_token_ids or len(self.tokens) >= self.max_tokens

    def restart(self) -> None:
        """Forget what was sampled: the request is preempted and will be computed again from its prompt."""
        self.tokens, self.logprobs, self.versions, self.top = [], [], [], []
        self.dispatched = 0

    def finish(self) -> None:
        if self.future is None:
            return
        stopped = bool(self.tokens) and self.tokens[-1] in self.params.stop_token_ids
        done = Completion(self.tokens, self.logprobs, "stop" if stopped else "length", self.versions, self.ttft_s,
                          self.top if self.params.top_logprobs else None)
        self.loop.call_soon_threadsafe(_resolve, self.future, done)

    def fail(self, exc: BaseException) -> None:
        if self.future is not None:
            self.loop.call_soon_threadsafe(_reject, self.future, exc)


@dataclasses.dataclass
class Sampled:
    """What a dispatched prefill or dispatch of k decode steps samples, not read yet (device arrays): token
    ids int32 [k, R] and logprobs float32 [k, R] (a prefill's [R], k = 1), the request of each row (None: a
    free slot), the policy version, each row's most likely tokens and their logprobs [k, R, top] (top 0: no
    request asked), and how many of the k steps each row ran, int32 [R] (None: all)."""

    tokens: jax.Array
    logprobs: jax.Array
    rows: list[Request | None]
    version: int
    top_ids: jax.Array
    top_logprobs: jax.Array
    counts: jax.Array | None = None


def _resolve(fut: asyncio.Future, value: Completion) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
