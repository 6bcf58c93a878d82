"""Continuous batching over the engine's decode slots, in a background thread.

The engine's decode steps run `decode_steps_per_dispatch` (k) at a time, in one program
(`Engine.generate_steps`, an on-device loop, as tpu-inference's multi-step decode): the host sees the engine
once per k tokens a slot, and each slot stops on the device at its stop token or its length (the host gives
each slot its budget of steps, `max_tokens` less what it dispatched). Between two dispatches the scheduler
admits waiting requests into free slots (prefill in a length bucket, then insert), so a batch is never padded
to its longest request. The only host/device synchronisation in the loop is reading sampled tokens, which
must be handed out anyway, and it runs one dispatch behind the device: each iteration dispatches its
prefills and the next k steps before it reads what the previous dispatch sampled, so the device always has
work queued while the host hands out tokens (nanodo reads its metrics one step late for the same reason).
A request's length is known at dispatch, so the dispatch that samples its last token frees its slot for the
next prefill at once; a slot whose request samples a stop token is masked on the device from then on (it
keeps its state) and refilled at the first admission after its tokens are read: one dispatch after the one
that sampled it. `update_params` swaps the weights between two dispatches; requests in flight keep their KV
cache and go on under the new weights, and every sampled token records the policy version that produced it
(a dispatch's k steps all run one version). A request may pass `on_token`, called on its event loop with each
token as it is read (for streaming: up to k at a time); a request whose future is cancelled (its caller gave
up) is skipped before prefill or dropped from its slot at the next dispatch.

Prefills run one request at a time, not batched per bucket: a batch's matmuls round differently with
its size (hidden states 4e-6 apart between a batch of 4 and of 1 on the Qwen3-0.6B shape), so a seeded
request's tokens would depend on which requests happened to arrive beside it, and a resumed run would
not reproduce the tokens of the run it resumes. Requests with the same prompt admitted together (the
rollouts of a group) share the prompt's forward pass (`Engine.prefill_shared`); each then samples its
first token in a program of its own, so its numbers are those of a prefill of its own. Likewise a decode
step reads only the cache chunks that hold the busy slots' positions (`Engine.cache_chunks`, on CPU), and a
slot's numbers do not depend on how many that is (`jaxrl.model.cpu.Chunked.attend`). Packing several
prompts into one prefill would not keep that: one prompt's logits moved by 2-4e-6 when packed beside
others into a longer row (Qwen3-0.6B shape, Nov 2026).

With a paged engine and `keep_turns`, a finished request's pages are kept (`PageAllocator.retire`, then
`remember` once its tokens are read) and a later prompt that extends its tokens (a multi-turn
conversation's next turn) prefills only the positions after them, over the kept pages
(`Engine.prefill_shared`). New weights drop every kept page before the next admission, and a request whose
decode spanned new weights keeps none, so no reused key or value is an older policy's. The reused keys and
values of sampled tokens come from decode steps, so such a turn's numbers are a whole prefill's only up to
float rounding (and depend on whether its last turn's pages were still kept): off by default.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Iterator

import jax
import numpy as np

from jaxrl.inference.decode_state import DecodeState, ResultSteps
from jaxrl.inference.engine import Engine, pad_prompt
from jaxrl.inference.engine_params import EngineParams
from jaxrl.inference.protocol import BackendStopped, Completion, SamplingParams
from jaxrl.inference.request import Request, Sampled
from jaxrl.model.blocks import Params

log = logging.getLogger(__name__)


class Scheduler:
    """A `GenerateBackend` that serves requests from one `Engine` with continuous batching.

    Args:
        engine: the engine; its `max_concurrent_decodes` is the number of slots.
        params: engine params `{"base", "lora"}`.
        model_name: the name `/v1/models` reports.
        seed: base PRNG seed for requests without their own `seed`.
        keep_turns: with a paged engine, keep a finished request's pages so that a later prompt extending
            its tokens (a multi-turn conversation's next turn) shares them and prefills only the rest
            (`keeps`). Its numbers then differ from a prefill of the whole prompt by float rounding (the
            kept keys and values of sampled tokens come from decode steps): off, every prompt is prefilled
            whole and the outputs are the dense cache's bit for bit.
    """

    def __init__(self, engine: Engine, params: Params, model_name: str, seed: int = 0,
                 keep_turns: bool = False) -> None:
        self.engine = engine
        self.keeps = keep_turns and engine.pages is not None
        self.model_name = model_name
        self.max_model_len = engine.max_seq_len
        self.policy_version = 0
        self._params = engine.prepare(params)
        self._pending: tuple[Params, int] | None = None
        self._waiting: collections.deque[Request] = collections.deque()
        self._slots: list[Request | None] = [None] * engine.max_concurrent_decodes
        self._state: DecodeState | None = None
        self._unread: collections.deque[Sampled] = collections.deque()  # dispatched, in device order
        self._cv = threading.Condition()
        self._stop = False
        self._base_key = jax.random.key(seed)
        self._n_requests = 0
        self.decode_steps = 0  # decode steps dispatched (a dispatch counts the most its slots may run)
        self.dispatches = 0  # decode programs dispatched (`Engine.generate_steps`)
        self.preemptions = 0  # requests put back to wait for pages, to be computed again (a paged cache)
        self._admitted = 0  # admissions so far: a running request's order, the last admitted preempted first
        self._epoch = 0  # weight sets served so far, less one (`_use_weights`)
        self._thread = threading.Thread(target=self._run, name="jaxrl-scheduler", daemon=True)
        self._thread.start()

    # GenerateBackend ------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[..., None] | None = None) -> Completion:
        """Queue a request and wait for its completion. `on_token(token, logprob)` is called on the
        caller's event loop for each sampled token, before the completion is returned (`on_token(token,
        logprob, top)` when `params.top_logprobs` > 0: `GenerateBackend.generate`'s).

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, or a prompt that leaves no
                room to sample in `max_seq_len`.
        """
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if not all(0 <= t < self.engine.cfg.vocab_size for t in prompt_ids):
            raise ValueError(f"the prompt holds a token id outside the vocabulary [0, {self.engine.cfg.vocab_size})")
        room = self.engine.max_seq_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in max_model_len "
                             f"{self.engine.max_seq_len}")
        loop = asyncio.get_running_loop()
        req = Request(list(prompt_ids), params, min(params.max_tokens, room), loop, loop.create_future(),
                       on_token=on_token)
        with self._cv:
            if self._stop:
                raise BackendStopped("the scheduler is stopped")
            self._waiting.append(req)
            self._cv.notify()
        return await req.future

    async def score(self, prompt_ids: list[int]) -> list[tuple[float, int]]:
        """Each prompt token's logprob given those before it and its rank (`Engine.score`, on the current
        weights), computed in a worker thread beside the decode steps (the completions route's
        `prompt_logprobs`).

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, or more than the engine's
                `max_prefill_length` tokens.
        """
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if not all(0 <= t < self.engine.cfg.vocab_size for t in prompt_ids):
            raise ValueError(f"the prompt holds a token id outside the vocabulary [0, {self.engine.cfg.vocab_size})")
        return await asyncio.to_thread(self.engine.score, self.params, list(prompt_ids))

    async def warmup(self, params: SamplingParams) -> int:
        """Compile every prefill bucket and the decode steps for `params`'s kind of sampling (truncating
        or not, penalizing or not, and with `min_tokens` the steps with and without its ban) before real
        traffic, so that no request's latency, and no rollout's timeout, includes XLA compilation. Runs
        one short request per bucket through the normal path, one at a time, so that each count of cache
        chunks a decode step reads (`Engine.cache_chunks`) compiles too (and one with `min_tokens` after
        them). A next turn's prefill over kept pages (`keep_turns`) compiles on first use.

        Returns:
            The number of prefill buckets compiled.
        """
        probe = dataclasses.replace(params, max_tokens=2, stop_token_ids=(), seed=0, min_tokens=0)
        for i, n in enumerate(self.engine.buckets):  # alone: its decode step reads the chunks up to its own position
            # a token of its own: no probe extends another's kept pages (`keep_turns`), so each prefills whole
            await self.generate([i % self.engine.cfg.vocab_size] * n, probe)
        if params.min_tokens:  # a step with a slot short of its min_tokens bans; the steps after it do not
            await self.generate([0], dataclasses.replace(probe, min_tokens=2))
        return len(self.engine.buckets)

    # weights --------------------------------------------------------------------------------------
    def update_params(self, params: Params, version: int) -> None:
        """Use `params` from the next decode step on; tokens sampled after it report `version`."""
        with self._cv:
            self._pending = (params, version)
            self._cv.notify()

    def stop(self) -> None:
        """Stop the loop; requests still queued or in flight fail with BackendStopped (a RuntimeError)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    @property
    def params(self) -> EngineParams:
        """The engine params (`Engine.prepare`d) that the next prefill and decode step use."""
        return self._params

    @property
    def active(self) -> int:
        return sum(r is not None for r in self._slots)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A stretch in which this process may run device programs that span other processes (a train
        step, a gather) without interleaving with the engine's: nothing to do here, where the engine's
        programs run on this process's devices only (`jaxrl.inference.lockstep` parks its group)."""
        yield

    # the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._state = self.engine.init_decode_state()
            while (admit := self._next()) is not None:
                self._admit(admit)
                ready = len(self._unread)  # the previous step and this iteration's prefills
                self._step()
                for _ in range(ready):
                    self._hand_out(self._unread[0])
                    self._unread.popleft()
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear about it
            log.exception("scheduler loop failed")
            self._fail_all(exc)
            return
        self._fail_all(BackendStopped("the scheduler is stopped"))

    def _next(self) -> list[Request] | None:
        """Wait for work, apply a pending weight update, and return the requests to admit now (None: stop)."""
        with self._cv:
            while (not self._stop and not self._waiting and not self.active and self._pending is None
                   and not self._unread):
                self._cv.wait()
            if self._stop:
                return None
            if self._pending is not None:
                self._use_weights(*self._pending)
                self._pending = None
            free = min(self._slots.count(None), len(self._waiting))
            n = self._admissible([(len(r.prompt_ids), r.max_tokens) for r in list(self._waiting)[:free]])
            admit = [self._waiting.popleft() for _ in range(n)]
        return admit

    def _use_weights(self, params: Params, version: int) -> None:
        """Serve `params` (`{"base", "lora"}`) as policy `version` from the next prefill and decode step on:
        the one place a weight swap is applied. The engine prepares them (`Engine.prepare`), and the keys
        and values computed so far are the old policy's: the epoch moves on (a request admitted before
        keeps no pages, `_remember`) and kept pages and shared prompts are forgotten."""
        self._params, self.policy_version = self.engine.prepare(params), version
        self._epoch += 1
        if self.engine.pages is not None:
            self.engine.pages.forget_all()

    preempts = True  # a paged cache: admit beside the running requests' next pages, preempt when out

    def _admissible(self, entries: list[tuple[int, int]]) -> int:
        """How many of `entries` (prompt length, max_tokens), the head of the queue in order, to admit now
        (the head first: no request is passed over): all of them with a dense cache (the caller offers no
        more than the free slots). With a paged one (`Engine.pages`), as vLLM's scheduler, as many as fit
        the free pages with their prompts' pages and one page of growth for each running request, theirs
        included; a step that then finds too few pages preempts (`_make_room`). Where `preempts` is off
        (an engine group), each running request reserves the pages of every position it may write (its
        prompt and `max_tokens - 1` decode steps), so the pool never runs out mid-decode."""
        if (pages := self.engine.pages) is None:
            return len(entries)

        def need(length: int, max_tokens: int) -> int:
            return math.ceil((length + max_tokens - 1) / pages.page)

        running = [r for r in self._slots if r is not None]
        if self.preempts:
            left = pages.free - len(running)
            for i, (length, _) in enumerate(entries):
                if (left := left - math.ceil(length / pages.page) - 1) < 0:
                    return i
            return len(entries)
        left = pages.num_pages - 1 - sum(need(len(r.prompt_ids), r.max_tokens) for r in running)
        for i, entry in enumerate(entries):
            if (left := left - need(*entry)) < 0:
                return i
        return len(entries)

    def _make_room(self) -> None:
        """Before a dispatch of decode steps over a paged cache: while the steps need more pages than are free,
        preempt the running request admitted last (vLLM's recompute preemption): its slot and pages are
        returned, what it sampled is forgotten (tokens still in flight for it discarded) and it waits again at
        the head of the queue, with its PRNG key, to be computed again: with the same weights the same tokens
        (a slot's numbers do not depend on the others'); `on_token` is not given again the tokens it had."""
        pages = self.engine.pages
        while pages is not None and pages.needed(self._budget()) > pages.free:
            victim = max((r for r in self._slots if r is not None), key=lambda r: r.admitted)
            self._release(victim)
            for sampled in self._unread:
                sampled.rows = [None if r is victim else r for r in sampled.rows]
            victim.restart()
            self.preemptions += 1
            with self._cv:
                self._waiting.appendleft(victim)

    def _budget(self) -> np.ndarray:
        """The decode steps each slot may run in the next dispatch, int32 [B]: the engine's
        `decode_steps_per_dispatch`, fewer where a request has fewer tokens left to dispatch, 0 for a free slot."""
        budget_B = np.zeros((len(self._slots),), np.int32)
        for slot, req in enumerate(self._slots):
            if req is not None:
                budget_B[slot] = min(self.engine.decode_steps_per_dispatch, req.max_tokens - req.dispatched)
        return budget_B

    def _dropped(self, req: Request) -> bool:
        """Whether `req`'s caller gave up (its future is cancelled)."""
        return req.future.cancelled()

    def _key(self, req: Request) -> jax.Array:
        if req.key is None:
            self._n_requests += 1
            req.key = (jax.random.key(req.params.seed) if req.params.seed is not None else
                       jax.random.fold_in(self._base_key, self._n_requests))
        return req.key

    def _admit(self, admit: list[Request]) -> None:
        """Dispatch the prefills of `admit` (one per distinct prompt: `Engine.prefill_shared`) and, for
        each request whose prefill does not sample its last token, its insert into a free slot, in order."""
        live = [(req, self._key(req)) for req in admit if not self._dropped(req)]
        groups: dict[tuple[int, ...], list[tuple[Request, jax.Array]]] = {}
        for req, key in live:
            groups.setdefault(tuple(req.prompt_ids), []).append((req, key))
        prefixes = {}
        for prompt, group in groups.items():
            try:
                bucket = self.engine.bucket(len(prompt))
                done = self.engine.prefill_shared(self._params, pad_prompt(list(prompt), bucket), len(prompt),
                                                  [r.params for r, _ in group], [k for _, k in group],
                                                  pool=self._state.cache if self.keeps else None)
            except Exception as exc:  # noqa: BLE001 - a bad request must not stop the loop
                for req, _ in group:
                    req.fail(exc)
                continue
            prefixes.update({id(r): p for (r, _), p in zip(group, done, strict=True)})
        for req, _ in live:
            if (prefix := prefixes.get(id(req))) is None:
                continue
            req.dispatched = 1
            self._unread.append(Sampled(prefix.token, prefix.logprob, [req], self.policy_version, prefix.top_ids,
                                         prefix.top_logprobs))
            if req.dispatched < req.max_tokens:
                req.slot = self._slots.index(None)
                self._state = self.engine.insert(prefix, self._state, req.slot)
                self._slots[req.slot] = req
                req.admitted = self._admitted = self._admitted + 1
                req.epoch = self._epoch
        if self.engine.pages is not None:
            self.engine.pages.unpin()  # kept pages matched for prompts not inserted (finished at their first token)

    def _step(self) -> None:
        """Dispatch up to `decode_steps_per_dispatch` decode steps over the occupied slots, if any (`_decode`)."""
        for req in self._slots:
            if req is not None and self._dropped(req):
                req.done = True
                self._release(req)
        if self.preempts:
            self._make_room()
        rows = list(self._slots)
        if any(r is not None for r in rows):
            self._decode(rows)

    def _decode(self, rows: list[Request | None]) -> None:
        """Dispatch up to `decode_steps_per_dispatch` decode steps of the requests in `rows` (the slots, None
        where free) as one program (`_steps`): each slot runs its budget (`_budget`) or stops at a stop token."""
        active = [r for r in rows if r is not None]
        budget_B = self._budget()
        self._state, result = self._steps(budget_B, active, self._flags(active))
        self.decode_steps += int(budget_B.max())
        self.dispatches += 1
        self._unread.append(Sampled(result.tokens, result.logprobs, rows, self.policy_version, result.top_ids,
                                     result.top_logprobs, result.counts))
        for req in active:
            req.dispatched += int(budget_B[req.slot])
            if req.dispatched >= req.max_tokens:
                self._release(req, keep=True)  # its tokens come with `_hand_out`

    def _flags(self, active: list[Request]) -> dict[str, bool | int]:
        """The variant of the step that `active`'s settings need: `Engine.generate`'s truncate, penalize,
        ban (a request still short of its `min_tokens`) and top."""
        return {"truncate": any(r.params.truncates for r in active),
                "penalize": any(r.params.penalizes for r in active),
                "ban": any(r.dispatched < r.params.min_tokens for r in active),
                "top": self.engine.top_for([r.params for r in active])}

    def _steps(self, budget_B: np.ndarray, active: list[Request],
               flags: dict[str, bool | int]) -> tuple[DecodeState, ResultSteps]:
        """The decode state after `Engine.generate_steps` of budgets `budget_B` over the occupied slots
        (`active`), reading the cache chunks that hold every position a slot may feed, and its tokens."""
        chunks = self.engine.cache_chunks(max(len(r.prompt_ids) + r.dispatched + int(budget_B[r.slot]) - 1
                                              for r in active))
        return self.engine.generate_steps(self._params, self._state, budget_B, chunks=chunks, **flags)

    def _hand_out(self, sampled: Sampled) -> None:
        """Read `sampled` (waits for the device) and give each live request its tokens, in order."""
        r = len(sampled.rows)
        tokens, logprobs = np.asarray(sampled.tokens).reshape(-1, r), np.asarray(sampled.logprobs).reshape(-1, r)
        counts = np.full((r,), tokens.shape[0]) if sampled.counts is None else np.asarray(sampled.counts)
        top_ids = np.asarray(sampled.top_ids).reshape(tokens.shape[0], r, sampled.top_ids.shape[-1])
        top_lps = np.asarray(sampled.top_logprobs).reshape(top_ids.shape)
        for row, req in enumerate(sampled.rows):
            if req is None or req.done:
                continue
            if self._dropped(req):
                req.done = True
                self._release(req)
                self._remember(req, None)
                continue
            k = req.params.top_logprobs
            for i in range(int(counts[row])):
                top = list(zip(top_ids[i, row, :k].tolist(), top_lps[i, row, :k].tolist(), strict=True)) if k else None
                if req.add(int(tokens[i, row]), float(logprobs[i, row]), sampled.version, top):
                    req.done = True
                    self._release(req, keep=True)
                    self._remember(req, req.prompt_ids + req.tokens)
                    req.finish()
                    break

    def _release(self, req: Request, keep: bool = False) -> None:
        """Free `req`'s slot; a paged cache's pages go back to the pool, or with `keep` (a finished
        request, where `keeps`) are kept under its admission number until `_remember` says what they hold."""
        if req.slot is not None:
            self._slots[req.slot] = None
            if keep and self.keeps:
                self.engine.pages.retire(req.slot, req.admitted)
            else:
                self.engine.release(req.slot)
            req.slot = None

    def _remember(self, req: Request, tokens: list[int] | None) -> None:
        """The kept pages of finished `req` hold `tokens`' keys and values up to the last token a decode
        step fed (its prompt and its sampled tokens but the last: a stopped slot feeds nothing more), if all
        of them were computed with the weights in use now; else (None, or new weights since its prefill)
        they go back to the pool."""
        if not self.keeps:
            return
        if tokens is None or req.epoch != self._epoch:
            self.engine.pages.remember(req.admitted, [])
            return
        self.engine.pages.remember(req.admitted, tokens[:len(req.prompt_ids) + len(req.tokens) - 1])

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            in_flight = [r for sampled in self._unread for r in sampled.rows if r is not None]
            reqs = [r for r in self._slots if r is not None] + list(self._waiting) + in_flight
            self._slots = [None] * len(self._slots)
            self._waiting.clear()
            self._unread.clear()
        for r in {id(r): r for r in reqs}.values():
            if not r.done:
                r.done = True
                r.fail(exc)
