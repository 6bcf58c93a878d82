"""The async producer's rules (`jaxrl.rl.producer`): what is in flight, which groups a step takes, which are
dropped as stale, what a checkpoint keeps; and the version log in front of the real scheduler."""

import asyncio
import dataclasses
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl.config.envs import BufferConfig
from jaxrl.config.schema import load_config
from jaxrl.envs.loader import Rollout
from jaxrl.inference.engine import Engine
from jaxrl.inference.protocol import Completion, SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.model import modules
from jaxrl.model.config import ModelConfig
from jaxrl.parallel import distributed
from jaxrl.parallel.sharding import make_mesh
from jaxrl.rl.buffer import Buffer, BufferState
from jaxrl.rl.producer import Producer, ProducerSettings, VersionLog, in_flight_groups

N = 2  # rollouts per group


def temperature_of(step: int) -> float:
    """A temperature schedule that tells the steps apart."""
    return 1.0 - 0.25 * step


@dataclasses.dataclass
class Engine1:
    """The engine side as the producer sees it: each request samples one token of the current `version`."""

    version: int = 0
    model_name: str = "m"
    max_model_len: int = 64
    seeds: list[int] = dataclasses.field(default_factory=list)  # of the requests that reached it, in order

    async def generate(self, prompt_ids, params, on_token=None):
        self.seeds.append(params.seed)
        return Completion([5], [0.0], "stop", [self.version])


class Run:
    """A producer over 20 examples whose groups each sample one token per rollout when launched, then
    finish when their gate opens (open by default)."""

    def __init__(self, *, per_step: int, in_flight: int, level: int, step: int = 0, next_t: int = 0,
                 resumed=(), last_step=None, processes=1, index=0, gather=None):
        self.loop = asyncio.new_event_loop()
        self.engine = Engine1(version=step)
        self.log = VersionLog(self.engine)
        self.gates: dict[int, asyncio.Event] = {}
        self.played: list[int] = []
        self.temperatures: dict[int, float] = {}  # what each group's play was asked to sample at
        self.buffer = Buffer((20,), BufferConfig())
        settings = ProducerSettings(lambda t: 1000 + t * N, temperature_of, N, per_step, in_flight, level, last_step,
                                    processes, index, gather, poll_s=0.01)
        self.producer = Producer(self.loop, self.buffer, BufferState.fresh(1), self.play, self.log, settings, step,
                                 next_t, resumed)
        RUNS.append(self)

    def gate(self, t: int) -> asyncio.Event:
        if t not in self.gates:
            self.gates[t] = asyncio.Event()
            self.gates[t].set()
        return self.gates[t]

    async def play(self, job, first_seed, temperature):
        t = (first_seed - 1000) // N
        self.played.append(t)
        self.temperatures[t] = temperature
        for i in range(N):
            await self.log.generate([1], SamplingParams(seed=first_seed + i))
        await self.gate(t).wait()
        return [Rollout([1, 5], [False, True], [0.0, 0.0], float(t), False, True, None, "e", job[1])] * N

    def take(self, step: int, stopping=None):
        return self.loop.run_until_complete(self.producer.take(step, stopping))

    def update(self, version: int) -> None:
        self.engine.version = version
        self.producer.set_version(version)

    def in_flight(self) -> list[int]:
        return [g.t for g in self.producer.groups]

    def close(self) -> None:
        for gate in self.gates.values():
            gate.set()
        self.producer.cancel()
        self.loop.run_until_complete(asyncio.sleep(0.01))
        self.loop.close()


RUNS: list[Run] = []


@pytest.fixture(autouse=True)
def _close_runs():
    yield
    while RUNS:
        RUNS.pop().close()


def test_in_flight_groups_round_up_to_whole_groups():
    assert in_flight_groups(32, 8, 1.0) == 4 and in_flight_groups(32, 8, 2.0) == 8
    assert in_flight_groups(32, 8, 1.1) == 5 and in_flight_groups(8, 4, 1.5) == 3


def test_level_0_plays_each_steps_groups_at_its_version_after_its_update():
    run = Run(per_step=2, in_flight=2, level=0)
    run.producer.refill()
    expected_jobs = run.buffer.draw(BufferState.fresh(1), 6)[0]
    for step in range(3):
        taken = run.take(step)
        assert [g.t for g in taken.groups] == [2 * step, 2 * step + 1]
        assert [g.job for g in taken.groups] == expected_jobs[2 * step:2 * step + 2]
        assert all(v == step for g in taken.groups for v in g.versions) and len(taken.groups[0].versions) == N
        assert taken.metrics(step, N, run.producer.playing)["async/staleness_max"] == 0
        # the next step's groups are launched while the step trains (their env work overlaps it), but none of
        # their requests reaches the engine before its update to the next version
        assert run.in_flight() == [2 * step + 2, 2 * step + 3]
        reached = len(run.engine.seeds)
        run.loop.run_until_complete(asyncio.sleep(0.05))
        assert len(run.engine.seeds) == reached
        assert [g.version for g in run.producer.groups] == [step + 1] * 2 and run.producer.playing == 0
        run.update(step + 1)


def test_oversampling_keeps_batch_times_factor_in_flight_and_takes_the_first_to_finish():
    run = Run(per_step=2, in_flight=in_flight_groups(4, N, 2.0), level=2)
    for t in (0, 2):
        run.gate(t).clear()
    run.producer.refill()
    assert run.in_flight() == [0, 1, 2, 3]
    taken = run.take(0)
    assert [g.t for g in taken.groups] == [1, 3]  # finished first; 0 and 2 wait on their gates
    assert run.in_flight() == [0, 2, 4, 5]  # refilled during the step, at version 0
    assert taken.metrics(0, N, run.producer.playing)["async/in_flight"] == 8  # batch_size 4 x 2.0
    run.update(1)
    run.gate(0).set()
    taken = run.take(1)
    assert [g.t for g in taken.groups] == [0, 4]  # 0 finished first, then 4 and 5 (lowest number first)
    assert taken.metrics(1, N, 4)["async/staleness_mean"] == 1.0  # launched at version 0, trained at 1


def test_each_group_samples_at_the_temperature_of_the_step_it_was_started_for():
    """`[sampling.temp_scheduler]`: a group plays at the temperature of the step the producer was filling
    when it launched the group, keeps it when a later step takes it, and the step reports the mean."""
    run = Run(per_step=2, in_flight=4, level=2)
    run.producer.refill()  # groups 0-3, for step 0
    taken = run.take(0)  # then 4 and 5 are launched for step 1
    assert [g.temperature for g in taken.groups] == [temperature_of(0)] * 2
    assert taken.metrics(0, N, 4)["sampling/temperature"] == temperature_of(0)
    run.update(1)
    taken = run.take(1)  # 2 and 3, started for step 0, trained at step 1; then 6 and 7 for step 2
    assert [(g.t, g.temperature) for g in taken.groups] == [(2, temperature_of(0)), (3, temperature_of(0))]
    run.update(2)
    taken = run.take(2)
    assert [(g.t, g.temperature) for g in taken.groups] == [(4, temperature_of(1)), (5, temperature_of(1))]
    assert {t: run.temperatures[t] for t in range(8)} == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 0.75, 5: 0.75,
                                                          6: 0.5, 7: 0.5}


@pytest.mark.parametrize(("table", "max_steps", "want"), [
    (None, 5, [0.7] * 6),  # no schedule: [sampling] temperature
    ({"start_temperature": 1.0, "end_temperature": 0.5}, 5, [1.0, 0.875, 0.75, 0.625, 0.5, 0.5]),
    ({"type": "cosine", "start_temperature": 1.0, "end_temperature": 0.0, "total_steps": 3}, 9,
     [1.0, 0.5, 0.0, 0.0, 0.0, 0.0]),
    ({"start_temperature": 1.0, "end_temperature": 0.5, "total_steps": 1}, 9, [0.5] * 6),
])
def test_the_temperature_schedule_of_the_schema(table, max_steps, want):
    from jaxrl.config.schema import SamplingConfig
    from jaxrl.rl.rollouts import temperature_at

    sampling = SamplingConfig(temperature=0.7, temp_scheduler=table)
    assert [temperature_at(sampling, step, max_steps) for step in range(1, 7)] == pytest.approx(want)


def test_nothing_is_launched_once_the_last_step_is_taken():
    run = Run(per_step=2, in_flight=4, level=2, last_step=2)
    run.producer.refill()
    assert run.in_flight() == [0, 1, 2, 3]
    run.take(0)
    assert run.in_flight() == [2, 3, 4, 5]  # step 1 is still to come
    run.update(1)
    run.take(1)
    run.update(2)
    assert run.in_flight() == [4, 5]  # left over from before, none launched for a step 2 that never runs
    assert run.producer.checkpoint()["next_group"] == 6


def test_a_group_older_than_max_async_level_is_dropped_and_counted():
    run = Run(per_step=1, in_flight=2, level=1)
    run.gate(0).clear()  # group 0 samples its tokens at version 0, then hangs
    run.producer.refill()
    assert [g.t for g in run.take(0).groups] == [1]
    run.update(1)
    assert [g.t for g in run.take(1).groups] == [2]  # launched at version 0 during step 0: lag 1, kept
    run.update(2)
    run.gate(0).set()
    taken = run.take(2)  # group 0 (oldest token 0 < 2 - 1) finishes first and is dropped
    assert [g.t for g in taken.stale] == [0] and [g.t for g in taken.groups] == [3]
    metrics = taken.metrics(2, N, run.producer.playing)
    assert metrics["async/stale_dropped"] == N and metrics["async/staleness_max"] == 1
    assert 0 not in run.in_flight()


def test_a_finished_group_left_for_a_later_step_is_checked_again_at_that_step():
    run = Run(per_step=1, in_flight=2, level=1)
    run.producer.refill()
    assert [g.t for g in run.take(0).groups] == [0]  # group 1 finished too, at version 0
    run.update(1)
    assert [g.t for g in run.take(1).groups] == [1]  # group 2, launched during step 0, finished and waits
    run.update(2)
    taken = run.take(2)  # group 2 was fresh at step 1 (lag 1) but is not at step 2
    assert [g.t for g in taken.stale] == [2] and [g.t for g in taken.groups] == [3]


def test_level_1_holds_what_the_step_after_next_could_not_train_until_the_update():
    run = Run(per_step=1, in_flight=1, level=1)
    run.producer.refill()
    run.take(0)
    assert run.in_flight() == [1]  # version 0 >= step 1 - 1
    run.take(1)  # the trainer took step 1 before step 0's update reached the engine
    assert run.in_flight() == [2]  # launched, but at version 0 < step 2 - 1 it would be stale: held
    reached = list(run.engine.seeds)
    run.loop.run_until_complete(asyncio.sleep(0.05))
    assert run.engine.seeds == reached and 1000 + 2 * N not in reached
    run.update(1)
    assert run.take(2).groups[0].versions == [1] * N


def test_a_checkpoint_lists_the_groups_in_flight_and_a_resume_plays_them_again_first():
    run = Run(per_step=2, in_flight=4, level=2)
    run.producer.refill()
    run.take(0)
    meta = {"producer": run.producer.checkpoint()}
    in_flight = [(g.t, g.job) for g in run.producer.groups]
    assert [t for t, _ in in_flight] == [2, 3, 4, 5]
    next_t, resumed = Producer.resumed(meta, 1, 2)
    assert (next_t, resumed) == (6, in_flight)
    again = Run(per_step=2, in_flight=4, level=2, step=1, next_t=next_t, resumed=resumed)
    again.producer.refill()
    again.loop.run_until_complete(asyncio.sleep(0))
    assert [(g.t, g.job) for g in again.producer.groups] == in_flight and again.played == [2, 3, 4, 5]
    assert Producer.resumed({}, 3, 2) == (6, [])  # a checkpoint from before the producer


class Posts:
    """An all-gather among the producers of threads in this process, with the Exchange's contract."""

    def __init__(self, count: int) -> None:
        self.barrier, self.posts = threading.Barrier(count, timeout=30), [None] * count

    def gather(self, index: int):
        def gather(obj):
            self.posts[index] = obj
            self.barrier.wait()
            out = list(self.posts)
            self.barrier.wait()
            return out
        return gather


def _each(runs, fn):
    """`fn(run)` for each run at once, one thread each (their takes gather together); the results."""
    out = [None] * len(runs)

    def work(i):
        out[i] = fn(runs[i])
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(runs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    return out


def test_several_processes_agree_on_the_groups_each_plays_its_own():
    posts = Posts(2)
    runs = [Run(per_step=2, in_flight=4, level=1, processes=2, index=i, gather=posts.gather(i)) for i in range(2)]
    for run in runs:
        run.producer.refill()
    assert [[g.owner for g in run.producer.groups] for run in runs] == [[0, 1, 0, 1]] * 2  # least loaded
    runs[1].gate(1).clear()  # process 1's first group hangs after sampling its tokens at version 0
    taken = _each(runs, lambda run: run.take(0))
    assert [[g.t for g in tk.groups] for tk in taken] == [[0, 2]] * 2
    assert sorted(runs[0].played + runs[1].played) == list(range(6)) and set(runs[0].played) == {0, 2, 4, 5}
    assert [g.rollouts is None for g in taken[1].groups] == [True, True]  # played by process 0
    assert taken[1].groups[0].versions == [0] * N  # its tokens' versions, reported through the gather
    assert runs[0].producer.checkpoint() == runs[1].producer.checkpoint()
    for run in runs:
        run.update(1)
    assert [[g.t for g in tk.groups] for tk in _each(runs, lambda run: run.take(1))] == [[3, 4]] * 2
    for run in runs:
        run.update(2)
    runs[1].gate(1).set()
    taken = _each(runs, lambda run: run.take(2))  # group 1 (version 0 < 2 - 1) is dropped on both
    assert [[g.t for g in tk.stale] for tk in taken] == [[1, 5]] * 2  # 5 finished at version 0, left by step 1
    assert runs[0].producer.checkpoint() == runs[1].producer.checkpoint()


def test_a_stop_asked_on_one_process_ends_the_take_on_every_process_in_the_same_round():
    posts = Posts(2)
    runs = [Run(per_step=1, in_flight=2, level=1, processes=2, index=i, gather=posts.gather(i)) for i in range(2)]
    stop = threading.Event()
    for run in runs:
        for t in range(2):
            run.gate(t).clear()  # nothing finishes: the take waits until process 1 is asked to stop
        run.producer.refill()
    threading.Timer(0.2, stop.set).start()
    assert _each(runs, lambda run: run.take(0, stopping=stop.is_set if run is runs[1] else None)) == [None, None]
    saved = [run.producer.checkpoint() for run in runs]
    assert saved[0] == saved[1] and [t for t, _, _ in saved[0]["in_flight"]] == [0, 1]


def _tiny_scheduler():
    """The real scheduler (its own thread) over a tiny random Qwen3 with 2 slots, and its params."""
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    params = {"base": modules.init_params(cfg, jax.random.key(0)), "lora": None}
    engine = Engine(cfg, make_mesh({}, jax.devices()[:1]), max_concurrent_decodes=2, max_seq_len=48)
    return Scheduler(engine, params, "tiny"), params


def test_version_log_records_expected_seeds_through_the_real_scheduler():
    sched, params = _tiny_scheduler()
    log = VersionLog(sched)
    log.expect([7])

    async def turns():
        first = await log.generate([1, 2, 3], SamplingParams(max_tokens=4, seed=7))
        sched.update_params(params, version=3)
        second = await log.generate([1, 2, 3, 4], SamplingParams(max_tokens=5, seed=7))  # the next turn
        other = await log.generate([1, 2], SamplingParams(max_tokens=3, seed=8))
        return first, second, other

    try:
        first, second, other = asyncio.run(turns())
    finally:
        sched.stop()
    assert len(first.token_ids) == 4 and len(second.token_ids) == 5 and len(other.token_ids) == 3
    assert log.pop([7, 8]) == [0] * 4 + [3] * 5  # seed 8 was never expected
    assert log.pop([7]) == [] and np.all(np.array(other.policy_versions) == 3)


def test_version_log_holds_a_request_until_another_thread_serves_its_version():
    """The synchronous loop's overlap: a group launched while the trainer trains renders and sends its
    requests, and the log holds them until the runner's thread has updated the engine and said so
    (`serve`), so every token is of the new policy (the real scheduler, its own thread)."""
    sched, params = _tiny_scheduler()
    log = VersionLog(sched)
    log.expect([7], version=1)
    log.expect([8])  # not held: no version asked

    def publish():  # the runner, after its train step
        sched.update_params(params, version=1)
        log.serve(1)

    async def requests():
        free = await log.generate([1, 2], SamplingParams(max_tokens=3, seed=8))
        held = asyncio.ensure_future(log.generate([1, 2, 3], SamplingParams(max_tokens=4, seed=7)))
        await asyncio.sleep(0.3)
        waited = not held.done()
        thread = threading.Thread(target=publish)
        thread.start()
        thread.join()
        log.expect([9], version=1)  # already served: not held
        late = await asyncio.wait_for(log.generate([1], SamplingParams(max_tokens=1, seed=9)), 60)
        return free, waited, await asyncio.wait_for(held, 60), late

    try:
        free, waited, held, late = asyncio.run(requests())
    finally:
        sched.stop()
    assert waited and free.policy_versions == [0] * 3 and held.policy_versions == [1] * 4
    assert log.pop([7, 8]) == [1] * 4 + [0] * 3
    assert late.policy_versions == [1]


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "configs" / "examples").glob("*.toml")),
                         ids=lambda p: p.stem)
def test_every_seed_example_runs_its_async_settings_on_two_processes(path):
    """Issue 12, item 4: each seed example's step and async settings, unchanged (the schema's defaults
    `max_async_level = 2` and `oversampling_factor = 2`, or full.toml's level 4), on two producers that
    agree over a gather as a 2-process run's do (`Run.start`): each step both take the same `batch_size /
    rollouts_per_example` groups, each group played by one process, none dropped while the engine keeps
    up, and both would checkpoint the same state. tests/test_distributed_async.py runs level 2 with
    oversampling 2 on two real processes; nothing else in the config or run path depends on the process
    count (the engine group's rule: one engine per process on CPU)."""
    cfg = load_config(path)
    per_step = cfg.batch_size // cfg.rollouts_per_example
    in_flight = in_flight_groups(cfg.batch_size, cfg.rollouts_per_example, cfg.oversampling_factor)
    assert distributed.engine_hosts(cfg.jax.engine_hosts, 2, distributed.chip_memory(), fit=lambda _: 2) == 1
    posts = Posts(2)
    runs = [Run(per_step=per_step, in_flight=in_flight, level=cfg.max_async_level, last_step=cfg.max_steps,
                processes=2, index=i, gather=posts.gather(i)) for i in range(2)]
    for run in runs:
        run.producer.refill()
    assert [len(run.in_flight()) for run in runs] == [in_flight] * 2
    for step in range(3):
        taken = _each(runs, lambda run, step=step: run.take(step))
        assert [g.t for g in taken[0].groups] == [g.t for g in taken[1].groups]
        assert len(taken[0].groups) == per_step
        assert [tk.stale for tk in taken] == [[], []]
        assert runs[0].producer.checkpoint() == runs[1].producer.checkpoint()
        for run in runs:
            run.update(step + 1)
    assert not set(runs[0].played) & set(runs[1].played)  # each group played once, by its owner
