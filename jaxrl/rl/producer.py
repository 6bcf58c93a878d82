"""Rollouts generated while the trainer trains (`max_async_level`, `oversampling_factor`).

The producer keeps example groups in flight on the run's event loop: each group is drawn from the
buffer, numbered `t` in launch order over the run (its rollouts sample with the seeds `seed_of(t) + i`,
so a group's tokens depend on its number, never on when it ran), and played by `play` at the
temperature of the step the producer is filling when it launches the group (`temperature_of`:
`[sampling.temp_scheduler]`), which the group keeps for the trainer. It launches
groups while fewer than `in_flight` are launched and not yet trained on (`ceil(batch_size x
oversampling_factor / rollouts_per_example)` groups, prime-rl's in-flight rollouts = batch_size x
oversampling_factor). A group's requests reach the engine only once its policy is recent enough for the
next step to train them: engine version v >= next step - `max_async_level` (prime-rl's orchestrator
waits, before it generates step n's batch, for policy n - async_level). A group launched before that
plays its environment (renders its prompts, sends its requests) and `VersionLog` holds its requests
until `set_version` says the engine serves that version.

The engine swaps weights between decode steps with requests in flight (`Scheduler.update_params`), so
one rollout's tokens may come from several policy versions. `VersionLog` sits in front of the engine
and records the version of every token sampled for a request whose seed a launched group expects (each
rollout's requests, over all its turns, carry its seed). Step s, run by the trainer at policy version s,
takes the first groups to finish whose OLDEST token is of version >= s - `max_async_level`, the first
`per_step` of them in finishing order, trained in launch order; a finished group with an older token is
dropped whole (its advantages are relative to the group) and counted. With `max_async_level = 0` the
producer launches step s's groups once step s - 1's are taken, while step s - 1 trains, and their
requests wait for step s - 1's weight update, so step s's groups are exactly the next `per_step` groups
drawn, all of version s: the synchronous loop. Launching them early lets the environments' own work
(rendering, HTTP) overlap the train step, and the engine then admits the whole step's requests at once:
on the small Qwen3 of scripts/peers (32 rollouts), the requests had reached the engine over 0.06-0.19 s
of the rollout half, each late one delaying its group's last token (docs/benchmarks.md, 2026-11-25 morning).

Several processes (`gather` set, one producer per process) keep one producer state between them: every
process draws the same groups at the same points and numbers them alike, and each group is played by one
owner, the process with the fewest unfinished groups at its launch (ties: the lowest index). Which groups
have finished is agreed by `gather`, an all-gather of small messages (`jaxrl.parallel.distributed.Exchange`)
that `take` calls every `poll_s` seconds while it waits: each process reports the groups it finished
since the last round with their tokens' policy versions, and every process marks them finished in the
same order (round, process, number). From that agreed record every process computes the same stale
groups, the same step's groups and the same groups in flight (the checkpoint's list), and a stop request
(SIGTERM on any host) rides the same messages, so every process leaves `take` in the same round. The
rollouts themselves stay with their owner; the runner gathers those of the step's groups afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from jaxrl.config.schema import SEED_MULTIPLIER, RunConfig
from jaxrl.envs.loader import Rollout
from jaxrl.inference.protocol import Completion, GenerateBackend, SamplingParams
from jaxrl.rl.buffer import Buffer, BufferExhausted, BufferState
from jaxrl.rl.rollouts import temperature_at

Job = tuple[int, int]
"""(env index, example index)."""


def in_flight_groups(batch_size: int, rollouts_per_example: int, oversampling_factor: float) -> int:
    """Groups kept in flight: `batch_size x oversampling_factor` rollouts, rounded up to whole groups."""
    return math.ceil(batch_size * oversampling_factor / rollouts_per_example - 1e-9)


class VersionLog:
    """A `GenerateBackend` in front of `backend` that records, for the seeds `expect` was given, the
    policy version of each token sampled for a request with that seed, and holds such a request until
    the engine serves the policy version `expect` asked for (`serve`). Requests with other seeds (or
    none) pass through unrecorded. Thread-safe: the server awaits `generate` on its own thread, the
    runner calls `serve` from its own."""

    def __init__(self, backend: GenerateBackend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._versions: dict[int, list[int]] = {}
        self._serving = 0  # the engine's policy version, as `serve` last said
        self._needs: dict[int, int] = {}  # seed -> the policy version its requests wait for
        self._waiting: list[tuple[int, asyncio.Future]] = []  # (version, the held request's future)

    @property
    def model_name(self) -> str:
        return self._backend.model_name

    @property
    def max_model_len(self) -> int:
        return self._backend.max_model_len

    def expect(self, seeds: Sequence[int], version: int = 0) -> None:
        """Record the tokens of requests with these seeds from now on; their requests wait until the
        engine serves policy `version` (`serve`)."""
        with self._lock:
            for s in seeds:
                self._versions.setdefault(s, [])
                self._needs[s] = version

    def pop(self, seeds: Sequence[int]) -> list[int]:
        """The versions recorded for `seeds` (in order of seed, then of completion) and stop recording them."""
        with self._lock:
            for s in seeds:
                self._needs.pop(s, None)
            return [v for s in seeds for v in self._versions.pop(s, [])]

    def serve(self, version: int) -> None:
        """The engine serves policy `version` from now on (call after `Scheduler.update_params`): requests
        that wait for it go on to the engine."""
        with self._lock:
            self._serving = version
            ready = [w for w in self._waiting if w[0] <= version]
            self._waiting = [w for w in self._waiting if w[0] > version]
        for _, future in ready:
            future.get_loop().call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))

    async def _wait_for_version(self, seed: int) -> None:
        with self._lock:
            need = self._needs.get(seed, 0)
            if need <= self._serving:
                return
            future = asyncio.get_running_loop().create_future()
            self._waiting.append((need, future))
        await future

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[..., None] | None = None) -> Completion:
        if params.seed is not None:
            await self._wait_for_version(params.seed)
        completion = await self._backend.generate(prompt_ids, params, on_token=on_token)
        if params.seed is not None:
            with self._lock:
                if (log := self._versions.get(params.seed)) is not None:
                    log.extend(completion.policy_versions)
        return completion


@dataclasses.dataclass(eq=False)
class Group:
    """One example group. `version`: a lower bound of its tokens' policy versions (the engine's at launch,
    or the one its requests wait for).
    `temperature`: what its rollouts sample at. `owner`: the process that plays it; `task`: plays it (None:
    another process does). `versions` (every token's policy version) and `finished` (rank in finishing
    order over the run, -1 until then): set when it finished; `rollouts`: set then on its owner only."""

    t: int
    job: Job
    version: int
    temperature: float
    task: asyncio.Task | None
    owner: int = 0
    rollouts: list[Rollout] | None = None
    versions: list[int] = dataclasses.field(default_factory=list)
    finished: int = -1

    @property
    def oldest(self) -> int:
        """Policy version of its oldest token (its launch version when no token was recorded)."""
        return min(self.versions, default=self.version)


@dataclasses.dataclass
class Taken:
    """What `Producer.take` gives one step: its groups in launch order and the finished groups dropped
    as stale while it waited."""

    groups: list[Group]
    stale: list[Group]

    def metrics(self, step: int, rollouts_per_example: int, in_flight: int) -> dict[str, float]:
        """`async/staleness_mean` and `async/staleness_max` (policy versions the step's played tokens lag
        version `step`), `async/stale_dropped` (rollouts dropped, in whole groups), `async/in_flight`
        (rollouts launched and not yet trained on once the step's batch was taken, `in_flight` groups:
        `Producer.playing`) and
        `sampling/temperature` (the mean of the step's groups' sampling temperatures)."""
        lag = np.array([step - v for g in self.groups for v in g.versions], np.float64)
        temperatures = [g.temperature for g in self.groups]
        return {"sampling/temperature": float(np.mean(temperatures)) if temperatures else 0.0,
                "async/staleness_mean": float(lag.mean()) if lag.size else 0.0,
                "async/staleness_max": float(lag.max()) if lag.size else 0.0,
                "async/stale_dropped": float(len(self.stale) * rollouts_per_example),
                "async/in_flight": float(in_flight * rollouts_per_example)}


@dataclasses.dataclass(frozen=True)
class ProducerSettings:
    """What a `Producer` launches and when.

    seed_of: first rollout seed of group `t`; rollout i samples with `seed_of(t) + i`.
    temperature_of: the sampling temperature of groups launched for step `step` (0-based: the step the
        producer is filling; `jaxrl.rl.rollouts.temperature_at` of `step + 1`).
    rollouts_per_example, per_step: rollouts of a group; groups a step trains on (all processes).
    in_flight: groups kept launched and not trained on; `per_step` when `max_async_level` is 0.
    max_async_level: policy versions the oldest token of a trained group may lag the trainer.
    last_step: the run's last step (`max_steps`): no group is launched once it is taken (they would be
        played for nothing). None: no end.
    processes, index, gather: with several processes, their count, this one's index and the all-gather
        that agrees on finished groups (`jaxrl.parallel.distributed.Exchange.gather`, blocking; run on a
        thread of its own). Every process must build its producer alike.
    poll_s: seconds between two rounds of `gather` while `take` waits.
    """

    seed_of: Callable[[int], int]
    temperature_of: Callable[[int], float]
    rollouts_per_example: int
    per_step: int
    in_flight: int
    max_async_level: int
    last_step: int | None = None
    processes: int = 1
    index: int = 0
    gather: Callable[[Any], list[Any]] | None = None
    poll_s: float = 0.05

    @classmethod
    def of_run(cls, cfg: RunConfig, processes: int = 1, index: int = 0,
               gather: Callable[[Any], list[Any]] | None = None) -> ProducerSettings:
        """A `jaxrl run`'s: group `t`'s seeds from `(sampling_seed * SEED_MULTIPLIER + t) * rollouts_per_example`,
        `[sampling]`'s temperature schedule, `batch_size / rollouts_per_example` groups a step,
        `in_flight_groups` of them in flight, `max_async_level`, up to `max_steps`."""
        n, seed = cfg.rollouts_per_example, cfg.sampling_seed
        return cls(lambda t: (seed * SEED_MULTIPLIER + t) * n,
                   lambda step: temperature_at(cfg.sampling, step + 1, cfg.max_steps), n, cfg.batch_size // n,
                   in_flight_groups(cfg.batch_size, n, cfg.oversampling_factor), cfg.max_async_level,
                   last_step=cfg.max_steps, processes=processes, index=index, gather=gather)


class Producer:
    """Keeps groups in flight on the running event loop; see the module docstring.

    Args:
        loop: the run's event loop, which plays the groups (it runs whenever the runner waits on it).
        buffer, state: the example buffer and its state (draws of every group launched so far).
        play: `play(job, first_seed, temperature)` plays one group on the loop and never raises
            (`rollouts.collect`).
        log: the `VersionLog` the engine's server answers through.
        settings: what to launch and when (`ProducerSettings`).
        step: the next step to train (policy version `step` is the engine's).
        next_t, resumed: the next group number, and `(t, job)` of groups a checkpoint had in flight,
            launched again first (`checkpoint`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, buffer: Buffer, state: BufferState,
                 play: Callable[[Job, int, float], Awaitable[list[Rollout]]], log: VersionLog,
                 settings: ProducerSettings, step: int, next_t: int, resumed: Sequence[tuple[int, Job]] = ()) -> None:
        st = settings
        if (st.processes > 1) != (st.gather is not None):
            raise ValueError("several processes need a gather, and only they")
        self._loop, self.buffer, self.state, self.log = loop, buffer, state, log
        self._play, self._seed_of, self._temperature_of, self._n = play, st.seed_of, st.temperature_of, \
            st.rollouts_per_example
        self.per_step, self.in_flight = st.per_step, max(st.in_flight, st.per_step)
        self.max_async_level = st.max_async_level
        self.version = self.next_step = step
        log.serve(step)
        self.next_t = next_t
        self.last_step = st.last_step
        self.processes, self.index, self._gather, self.poll_s = st.processes, st.index, st.gather, st.poll_s
        self._gather_thread = ThreadPoolExecutor(1, thread_name_prefix="jaxrl-producer") if st.gather else None
        self.groups: list[Group] = []
        self._resumed = list(resumed)
        self._stale: list[Group] = []
        self._finished = 0
        self.exhausted: BufferExhausted | None = None

    @property
    def playing(self) -> int:
        """Groups launched and not trained on whose requests may reach the engine now: not held for a policy
        newer than the engine's (`refill`), so 0 between two synchronous steps."""
        return sum(g.version <= self.version for g in self.groups)

    def seeds(self, t: int) -> range:
        return range(self._seed_of(t), self._seed_of(t) + self._n)

    # launching ------------------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """The engine serves policy `version` from now on (call right after `Scheduler.update_params`)."""
        self.version = version
        self.log.serve(version)
        self.refill()

    def refill(self) -> None:
        """Launch groups up to `in_flight`; the requests of each wait in the `VersionLog` until the engine's
        policy is recent enough for the next step (`set_version`).
        A `BufferExhausted` from the draw is kept in `exhausted` (until a later draw succeeds: groups in
        flight may still bring an example back into sampling, and may still serve a step)."""
        if self.last_step is not None and self.next_step >= self.last_step:
            return
        need = self.next_step - self.max_async_level  # the oldest policy the next step may train on
        want = self.in_flight - len(self.groups)
        if want <= 0:
            return
        launch, self._resumed = self._resumed[:want], self._resumed[want:]
        if len(launch) < want:
            try:
                jobs, self.state = self.buffer.draw(self.state, want - len(launch))
                self.exhausted = None
            except BufferExhausted as exc:
                self.exhausted = exc
                jobs = []
            launch += [(self.next_t + i, job) for i, job in enumerate(jobs)]
            self.next_t += len(jobs)
        load = [0] * self.processes
        for g in self.groups:
            load[g.owner] += g.finished < 0
        temperature = self._temperature_of(self.next_step)
        for t, job in launch:
            owner = min(range(self.processes), key=lambda p: (load[p], p))
            load[owner] += 1
            task = None
            if owner == self.index:
                self.log.expect(self.seeds(t), need)
                task = self._loop.create_task(self._play(job, self._seed_of(t), temperature))
            self.groups.append(Group(t, job, max(self.version, need), temperature, task, owner))

    # taking ---------------------------------------------------------------------------------------
    async def take(self, step: int, stopping: Callable[[], bool] | None = None) -> Taken | None:
        """Wait for step `step`'s groups (see the module docstring) and hand them over; their places are
        refilled. Cancelling it (one process) leaves every group in flight (a checkpoint then lists them).
        With several processes, `stopping()` true on any of them ends it on all, in the same round,
        with None.

        Raises:
            BufferExhausted: the buffer has no example left and too few groups are in flight to fill the step.
        """
        self.next_step = step
        while True:
            mine = [g for g in sorted(self.groups, key=lambda g: g.t)
                    if g.task is not None and g.task.done() and g.rollouts is None]
            for g in mine:
                g.rollouts, g.versions = g.task.result(), self.log.pop(self.seeds(g.t))
            if self._gather is None:
                done = mine
            else:
                report = {"done": [[g.t, _runs(g.versions)] for g in mine], "stop": bool(stopping and stopping())}
                posts = await self._loop.run_in_executor(self._gather_thread, self._gather, report)
                if any(p["stop"] for p in posts):
                    return None
                by_t = {g.t: g for g in self.groups}
                done = [by_t[t] for p in posts for t, _ in p["done"]]
                for g, (_, runs) in zip(done, [d for p in posts for d in p["done"]], strict=True):
                    g.versions = [v for v, count in runs for _ in range(count)]
            for g in done:
                g.finished, self._finished = self._finished, self._finished + 1
            for g in [g for g in self.groups if g.finished >= 0 and g.oldest < step - self.max_async_level]:
                self.groups.remove(g)  # finished, not taken by an earlier step, and now too old
                self._stale.append(g)
            ready = [g for g in self.groups if g.finished >= 0]
            if len(ready) >= self.per_step:
                taken = sorted(ready, key=lambda g: g.finished)[:self.per_step]
                break
            self.refill()
            if all(g.finished >= 0 for g in self.groups):
                raise self.exhausted or BufferExhausted("no group in flight")
            pending = [g.task for g in self.groups if g.task is not None and not g.task.done()]
            if self._gather is None:
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            elif pending:
                await asyncio.wait(pending, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(self.poll_s)
        self.groups = [g for g in self.groups if all(g is not x for x in taken)]
        stale, self._stale = self._stale, []
        self.next_step = step + 1
        self.refill()
        return Taken(sorted(taken, key=lambda g: g.t), stale)

    def record(self, jobs: Sequence[Job], rewards: Sequence[Sequence[float]]) -> list[bool]:
        """`Buffer.record` on the producer's state: which of a step's groups to train on."""
        keep, self.state = self.buffer.record(self.state, jobs, rewards)
        return keep

    def checkpoint(self) -> dict[str, Any]:
        """What a checkpoint saves of the producer: the next group number and the `(t, env, example)` of
        every group launched and not trained on, which a resumed run launches again first (their
        rollouts are dropped: a resumed run redoes them from its restored policy)."""
        return {"next_group": self.next_t,
                "in_flight": [[g.t, *g.job] for g in self.groups] + [[t, *job] for t, job in self._resumed]}

    @staticmethod
    def resumed(meta: dict[str, Any], step: int, per_step: int) -> tuple[int, list[tuple[int, Job]]]:
        """`(next_t, resumed)` from checkpoint metadata; a checkpoint from before the producer had none
        in flight and `per_step` groups drawn per step."""
        saved = meta.get("producer")
        if saved is None:
            return step * per_step, []
        return int(saved["next_group"]), [(int(t), (int(e), int(x))) for t, e, x in saved["in_flight"]]

    def cancel(self) -> None:
        """Cancel every group in flight (they finish cancelling when the loop runs next)."""
        for g in self.groups:
            if g.task is not None:
                g.task.cancel()
        self.groups = []
        if self._gather_thread is not None:
            self._gather_thread.shutdown(wait=False)


def _runs(versions: Sequence[int]) -> list[list[int]]:
    """`versions` as `[version, count]` runs (a rollout's tokens come in long runs of one version)."""
    return [[v, len(list(run))] for v, run in itertools.groupby(versions)]
