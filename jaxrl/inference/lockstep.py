"""One rollout engine over the devices of a group of hosts: every process of the group steps the same
prefill / insert / decode programs in the same order (lockstep), so that the group's decode slots act as
one engine. For a base model that does not fit one host's chips; where it fits, an engine per host is
faster (`jaxrl.run.runner` chooses, `[jax] engine_hosts`).

Each process of the group runs a `GroupScheduler` (a `jaxrl.inference.scheduler.Scheduler` over an
`Engine` whose mesh spans the group) and serves its own requests. Before each iteration of the
scheduler's loop, the group exchanges one small message (`jaxrl.parallel.distributed.Exchange`, over
the coordination service, no device program): each process posts the requests queued on it since the
last round (prompt ids, sampling settings), the requests its callers gave up, the weight version it has
pending, and whether it wants to stop or to pause. The group's first process, the leader, keeps the
group's one queue and decides the round's plan: which requests take the free slots (first come, first
served, in order of round then process; a request waits at the head of the queue until the group serves
the newest weight version its process had been handed when it posted it), which are dropped, whether to
swap weights (once every process has the same version pending: in-flight updates take effect at the same
decode step everywhere, and each token records the version that sampled it, as on one host), pause, or stop
(once every process has asked to: a process that is done keeps stepping the group's programs for the
others' requests still in flight, which would otherwise fail or wait forever). So a request queued after
`update_params` never samples with an older policy, as on one host (`Scheduler._next` swaps a pending
update before it admits): the processes hand over a step's weights at different moments, and a request
sent by the first as soon as its own update returned (a synchronous run's next groups, `[val]`) would
otherwise sample with the old weights until the last process's update arrived. Every process applies the
plan, so slots, PRNG keys and sampled tokens are the same on every process; each hands out the tokens
of its own requests. The sampled tokens come out of the programs replicated, so reading them needs no
transfer between hosts.

A device program that spans hosts must be issued in the same order with respect to the engine's on every
process (a TPU runs one program at a time per chip; two hosts issuing two programs in opposite orders
wait on each other forever). `paused()` brackets such programs (the train step, gathers): the group
parks at the first round at which every process asks to pause, after handing out what was sampled.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Iterator
from typing import Any

from jaxrl.inference.engine import Engine
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.request import Request
from jaxrl.inference.scheduler import Scheduler
from jaxrl.model.blocks import Params
from jaxrl.parallel.distributed import Exchange


def _params_json(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params) | {"stop_token_ids": list(params.stop_token_ids)}


class GroupScheduler(Scheduler):
    """A `Scheduler` whose engine spans the processes of `exchange` (see the module docstring). With a
    paged cache it admits a request when every position it may write fits (`preempts` off: a preempted
    request would have to go back to the leader's queue on every process).

    Args:
        engine, params, model_name, seed: as `Scheduler`'s; every process of the group passes the same.
        exchange: the group's processes, the first of them the leader; made alike on every process.
        idle_s: how long an idle round waits for local work before it posts (the group polls at most
            this often while nothing runs).
    """

    preempts = False

    def __init__(self, engine: Engine, params: Params, model_name: str, exchange: Exchange, seed: int = 0,
                 idle_s: float = 0.01) -> None:
        self._exchange, self.idle_s = exchange, idle_s
        # the leader's: [owner, id, prompt, params, n, version its process had been handed (None: none yet)]
        self._queue: collections.deque[list] = collections.deque()
        self._mine: dict[int, Request] = {}  # this process's requests posted and not finished, by id
        self._next_id = 0
        self._cancelled: set[tuple[int, int]] = set()
        self._reported: set[int] = set()  # ids of own given-up requests already posted
        self._versions: dict[int, Params] = {}  # pending weight updates by version
        self._handed: int | None = None  # the newest version update_params was given (pending or swapped)
        self._entered = self._exited = 0  # paused() stretches begun and ended
        self._parked_for = 0  # while parked: the stretches begun when it parked (it waits for their end); else 0
        self._holding = threading.local()  # paused() depth of the calling thread
        self._idle = True
        self._stop_posted = False  # this process has asked the group to stop (it no longer waits when idle)
        super().__init__(engine, params, model_name, seed)

    def update_params(self, params: Params, version: int) -> None:
        """Use `params` from the decode step at which every process of the group has version `version`; the
        requests this process queues from now on wait for that step (the group's first come, first served
        order kept), so that none samples with an older policy than `version`."""
        with self._cv:
            self._versions[version] = params
            self._handed = version
            self._cv.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Park the group's engine for the stretch (every process of the group must enter it at the same
        point of its program). Reentrant within a thread; a stretch begun by another thread while one is
        held waits for the next park. Returns at once once the scheduler has stopped."""
        depth = getattr(self._holding, "depth", 0)
        if depth:
            self._holding.depth = depth + 1
            try:
                yield
            finally:
                self._holding.depth = depth
            return
        with self._cv:
            self._entered += 1
            mine = self._entered
            self._cv.notify_all()
            while not self._cv.wait_for(lambda: self._parked_for >= mine, timeout=0.1):
                if not self._thread.is_alive():
                    break
        self._holding.depth = 1
        try:
            yield
        finally:
            self._holding.depth = 0
            with self._cv:
                self._exited += 1
                self._cv.notify_all()

    # one round ------------------------------------------------------------------------------------
    def _post(self) -> dict[str, Any]:
        """This process's message for the round (waits up to `idle_s` for local work when idle)."""
        with self._cv:
            if self._idle:
                self._cv.wait_for(lambda: (self._stop and not self._stop_posted) or self._waiting or self._versions
                                  or self._entered > self._exited, timeout=self.idle_s)
            new = []
            while self._waiting:
                req = self._waiting.popleft()
                self._mine[self._next_id] = req
                new.append([self._next_id, req.prompt_ids, _params_json(req.params), req.max_tokens, self._handed])
                self._next_id += 1
            for rid in [rid for rid, req in self._mine.items() if req.done]:
                del self._mine[rid]
                self._reported.discard(rid)
            gave_up = [rid for rid, req in self._mine.items() if req.future.cancelled() and rid not in self._reported]
            self._reported.update(gave_up)
            self._stop_posted = self._stop
            return {"new": new, "cancel": gave_up, "version": max(self._versions, default=None),
                    "stop": self._stop, "pause": self._entered > self._exited}

    def _decide(self, posts: list[dict[str, Any]]) -> dict[str, Any]:
        """The leader's plan for the round from every process's post (see the module docstring)."""
        for owner, post in zip(self._exchange.processes, posts, strict=True):
            self._queue.extend([owner, *new] for new in post["new"])
        cancel = [[owner, rid] for owner, post in zip(self._exchange.processes, posts, strict=True)
                  for rid in post["cancel"]]
        gone = {tuple(c) for c in cancel}
        self._queue = collections.deque(q for q in self._queue if (q[0], q[1]) not in gone)
        pause = all(p["pause"] for p in posts)
        versions = {p["version"] for p in posts}
        version = versions.pop() if len(versions) == 1 and not pause else None
        serves = self.policy_version if version is None else version  # the group's policy once the plan is applied
        ready = itertools.takewhile(lambda q: q[5] is None or q[5] <= serves, self._queue)  # first come, first served
        offer = [] if pause else [(len(q[2]), q[4]) for q in itertools.islice(ready, self._slots.count(None))]
        admit = [self._queue.popleft() for _ in range(self._admissible(offer))]  # a paged cache: what fits
        idle = not self._queue and not admit and not self.active and not self._unread
        return {"admit": admit, "cancel": cancel, "version": version, "pause": pause,
                "stop": all(p["stop"] for p in posts), "idle": idle}

    def _next(self) -> list[Request] | None:
        """One round: post, receive the leader's plan, apply it; the requests to admit (None: stop)."""
        plan = self._exchange.gather(self._post(), decide=self._decide)
        if plan["stop"]:
            return None
        self._cancelled.update((owner, rid) for owner, rid in plan["cancel"])
        for owner, rid in plan["cancel"]:
            if owner == self._exchange.me and (req := self._mine.get(rid)) is not None and req.slot is None:
                req.done = True  # given up before it had a slot: nothing else will finish it
        if (version := plan["version"]) is not None:
            with self._cv:
                new = self._versions.get(version)
                self._versions = {v: p for v, p in self._versions.items() if v > version}
            if new is not None:
                self._use_weights(new, version)
        self._idle = plan["idle"]
        if plan["pause"]:
            self._park()
        return [self._request(owner, rid, prompt, params, n) for owner, rid, prompt, params, n, _ in plan["admit"]]

    def _request(self, owner: int, rid: int, prompt: list[int], params: dict, max_tokens: int) -> Request:
        if owner == self._exchange.me:
            req = self._mine[rid]
        else:
            params = SamplingParams(**params | {"stop_token_ids": tuple(params["stop_token_ids"])})
            req = Request(prompt, params, max_tokens, None, None)
        req.origin = (owner, rid)
        return req

    def _dropped(self, req: Request) -> bool:
        return req.origin in self._cancelled

    def _park(self) -> None:
        """Hand out what was sampled, then wait until the stretches begun so far on this process are over
        (one begun meanwhile waits for the next park, which the group agrees on afresh)."""
        while self._unread:
            self._hand_out(self._unread.popleft())
        with self._cv:
            self._parked_for = self._entered
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._exited >= self._parked_for or self._stop)
            self._parked_for = 0
