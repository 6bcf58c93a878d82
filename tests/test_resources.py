"""`[infrastructure].compute_size` (jaxrl/run/resources.py): the documented table, the loop's worker threads,
and the bound on rollouts in flight, through a real verifiers environment and a real server."""

import asyncio
import threading

import pytest
from tokenizers import Tokenizer

from jaxrl.envs.loader import load_env
from jaxrl.inference.protocol import Completion, SamplingParams
from jaxrl.inference.server import start_server
from jaxrl.rl import rollouts
from jaxrl.run import resources

IM_END = 151_645


@pytest.mark.parametrize(("size", "cores", "threads", "in_flight"), [
    ("S", 1, 1, 8), ("M", 1, 2, 32), ("L", 1, 4, None),
    ("S", 16, 4, 128), ("M", 16, 8, 512), ("L", 16, 16, None),
])
def test_compute_size_table(size, cores, threads, in_flight):
    assert resources.env_resources(size, cores) == resources.EnvResources(threads, in_flight)


def test_compute_size_errors():
    with pytest.raises(ValueError, match="compute_size 'XL'"):
        resources.env_resources("XL", 4)
    with pytest.raises(ValueError, match="cores must be >= 1"):
        resources.env_resources("M", 0)


@pytest.mark.parametrize("threads", [1, 3])
def test_worker_threads_bound_to_thread(threads):
    """`asyncio.to_thread` work (a CPU-bound reward handed off) runs on exactly `threads` workers."""
    running, peak, lock = 0, 0, threading.Lock()
    gate = threading.Barrier(threads, timeout=10)

    def work():
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        gate.wait()  # every worker must be busy at once before any finishes
        with lock:
            running -= 1

    async def go():
        await asyncio.gather(*(asyncio.to_thread(work) for _ in range(4 * threads)))

    loop = asyncio.new_event_loop()
    resources.apply(loop, resources.EnvResources(threads, None))
    try:
        loop.run_until_complete(go())
    finally:
        loop.close()
    assert peak == threads


class CountingBackend:
    """Answers "ok" after holding each request until `expect` requests are running at once (or 2 s);
    records the peak number of concurrent requests."""

    model_name = "policy"
    max_model_len = 1024

    def __init__(self, tokenizer: Tokenizer):
        self.reply = tokenizer.encode("ok", add_special_tokens=False).ids + [IM_END]
        self.running = self.peak = 0
        self.expect = 1
        self.full = threading.Event()  # the server answers on its own thread and loop

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        self.running += 1
        self.peak = max(self.peak, self.running)
        if self.running >= self.expect:
            self.full.set()
        deadline = asyncio.get_running_loop().time() + 2.0
        while not self.full.is_set() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        self.running -= 1
        return Completion(self.reply, [-0.1] * len(self.reply), "stop", [0] * len(self.reply))


@pytest.fixture(scope="module")
def backend_server(qwen3_tokenizer_dir):
    backend = CountingBackend(Tokenizer.from_file(str(qwen3_tokenizer_dir / "tokenizer.json")))
    handle = start_server(backend)
    yield backend, handle
    handle.stop()


@pytest.mark.parametrize(("max_in_flight", "expected_peak"), [(3, 3), (None, 12)])
def test_rollouts_in_flight_are_bounded(backend_server, qwen3_tokenizer_dir, max_in_flight, expected_peak):
    """12 rollouts (3 groups of 4): with a bound of 3 no more than 3 reach the engine at once; without one
    all 12 do. The rollouts still all succeed, in their groups."""
    backend, server = backend_server
    env = load_env("jaxrl/lowercase")
    client = {"base_url": server.base_url, "model_name": "policy", "tokenizer_path": qwen3_tokenizer_dir}

    backend.full, backend.expect, backend.peak = threading.Event(), expected_peak, 0

    async def go():
        in_flight = asyncio.Semaphore(max_in_flight) if max_in_flight else None
        async with env.serving():
            return await rollouts.collect([env], [(0, 0), (0, 1), (0, 2)], 4, client,
                                          SamplingParams(max_tokens=8), 0, 60.0, in_flight)

    groups = asyncio.run(go())
    assert [len(g) for g in groups] == [4, 4, 4] and all(r.ok for g in groups for r in g)
    assert backend.peak == expected_peak
