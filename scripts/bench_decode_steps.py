"""Decode steps per dispatch (`[jax] decode_steps_per_dispatch`) on this host: a small engine's tokens/s
through the scheduler at several k, in alternating rounds (k = 1, then each other k, again and again), so
that a machine whose load drifts weighs on every k alike. A regression guard for the default
(`jaxrl.inference.engine.DECODE_STEPS_PER_DISPATCH`), not a device figure: random weights, nothing
downloaded.

Each run: `--concurrency` requests of `--prompt` random tokens, `--tokens` sampled tokens each (temperature
1, seeded, no stop token), queued at once on a fresh scheduler over one engine per k (compiled in a warm-up
run first); tokens/s is every sampled token over the run's wall time, prefills included.

    python scripts/bench_decode_steps.py                          # k = 1 and 8, 4 rounds
    python scripts/bench_decode_steps.py --k 1 4 8 16 --rounds 3 --layers 4 --hidden 512
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import jax
import numpy as np

from jaxrl.inference.engine import Engine
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.model import modules
from jaxrl.model.qwen3 import ModelConfig
from jaxrl.parallel.sharding import make_mesh


def run(engine: Engine, params, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    """(seconds, dispatches) of `prompts` through a fresh scheduler over `engine`, `tokens` each."""
    sched = Scheduler(engine, params, "bench")

    async def go():
        return await asyncio.gather(*[sched.generate(p, SamplingParams(temperature=1.0, max_tokens=tokens, seed=i))
                                      for i, p in enumerate(prompts)])

    try:
        t = time.perf_counter()
        outs = asyncio.run(go())
        wall = time.perf_counter() - t
    finally:
        sched.stop()
    assert all(len(o.token_ids) == tokens for o in outs)
    return wall, sched.dispatches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 8], help="decode steps per dispatch to compare")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8, help="requests, and the engine's decode slots")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=96, help="sampled tokens per request")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256, help="model width (MLP 3x, heads of 64)")
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args(argv)
    d = args.hidden
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=d, intermediate_size=3 * d, num_layers=args.layers,
                      num_heads=d // 64, num_kv_heads=max(1, d // 128), head_dim=64, tie_word_embeddings=True)
    params = {"base": modules.init_params(cfg, jax.random.key(0)), "lora": None}
    mesh = make_mesh({}, jax.devices()[:1])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt).tolist() for _ in range(args.concurrency)]
    engines = {k: Engine(cfg, mesh, args.concurrency, args.prompt + args.tokens, decode_steps_per_dispatch=k)
               for k in args.k}
    for engine in engines.values():  # compile every program the timed runs use
        run(engine, params, prompts, args.tokens)
    rates: dict[int, list[float]] = {k: [] for k in args.k}
    sampled = args.concurrency * args.tokens
    for r in range(args.rounds):
        for k, engine in engines.items():
            wall, dispatches = run(engine, params, prompts, args.tokens)
            rates[k].append(sampled / wall)
            print(f"round {r + 1} k={k:2d}: {sampled / wall:7.1f} tokens/s ({wall:.2f} s, {dispatches} dispatches)",
                  flush=True)
    base = statistics.median(rates[args.k[0]])
    for k, rs in rates.items():
        median = statistics.median(rs)
        print(f"k={k:2d}: median {median:7.1f} tokens/s ({median / base:.2f}x k={args.k[0]}), "
              f"runs {', '.join(f'{x:.0f}' for x in rs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
