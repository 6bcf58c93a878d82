"""Rollout engine benchmark on the Qwen3-0.6B shape with random weights (nothing downloaded).

For each concurrency C (default 8 and 32): C requests of `--prompt` random tokens each, `--tokens`
sampled tokens each (temperature 1, no stop token), all queued at once through the continuous-batching
scheduler. Reports:

  * prefill tokens/s: prompt tokens over the time `Engine.prefill` takes on one prompt (blocking);
  * decode tokens/s: C over the time of one `Engine.generate` step with every slot busy (median of
    `--steps` steps, each read back before the next: the engine alone); through the scheduler (tokens
    after the first over the wall time after the last first token: its decode loop, pipelined); and
    end to end (sampled tokens over wall time, prefills included);
  * time to first token: from queueing to the first sampled token, median and worst over the C requests
    (they arrive together, so the last waits for every prefill before it);
  * the limit: decode step bytes (every weight read once, the unembedding included, plus the whole KV
    cache the step reads) over the memory read bandwidth measured by this script, and the ratio of the
    measured decode rate to it. The compute bound (2 flops per weight per token over the XLA matmul
    rate measured here) is printed beside it, since at 32 slots it is the tighter one on a CPU.

    python scripts/bench_rollout.py                 # 8 and 32 concurrent requests, float32
    python scripts/bench_rollout.py --concurrency 8 --dtype bfloat16 --json out.json
    python scripts/bench_rollout.py --concurrency 8 --cpu-devices 2   # the engine tensor-parallel over 2 CPU devices
    python scripts/bench_rollout.py --concurrency 8 --paged           # over the paged KV cache

`--cpu-devices N` splits the host into N XLA CPU devices (`jax_num_cpu_devices`) and runs the engine on a
mesh of `tensor` N over them: each device's program streams its share of every weight on its own thread
(a lead at the 0.6B shape, not a product setting: docs/benchmarks.md, 2026-11-24 night).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.inference.engine import Engine, pad_prompt
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.model import modules
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import make_mesh, spec_shardings

QWEN3_06B = ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                        num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)


def memory_read_gbps(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best read bandwidth of a jitted XLA sum over `n_bytes` of float32, on all the host's cores (GB/s).

    A one-thread numpy sum read at about half that here (15 vs 35 GB/s on this project's 2-core machine,
    Nov 2026), below what the decode step's own unembedding read: a limit must use every core, as the
    step does."""
    x = jnp.ones(n_bytes // 4, jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return n_bytes / best / 1e9


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best XLA float32 matmul rate on an n x n x n product (GFLOP/s)."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def step_bytes(cfg: ModelConfig, params, slots: int, seq: int, cache_dtype) -> int:
    """Bytes one decode step reads: every weight once (the tied embedding as the unembedding; its row
    gather is negligible) and the whole cache, keys and values."""
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    cache = 2 * cfg.num_layers * slots * seq * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cache_dtype).itemsize
    return weights + cache


def bench(cfg: ModelConfig, params, dtype, slots: int, prompt_len: int, n_tokens: int, steps: int,
          devices: int = 1, paged: bool = False) -> dict:
    mesh = make_mesh({"tensor": devices} if devices > 1 else {}, jax.devices()[:devices])
    params = jax.device_put(params, spec_shardings(modules.param_specs(cfg), cfg.dims(), mesh))
    seq = prompt_len + n_tokens
    engine = Engine(cfg, mesh, max_concurrent_decodes=slots, max_seq_len=seq, cache_dtype=dtype,
                    kv_cache_tokens=slots * seq if paged else None)
    p = engine.prepare({"base": params, "lora": None})
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, size=prompt_len).tolist() for _ in range(slots)]
    sampling = SamplingParams(temperature=1.0, max_tokens=n_tokens)

    # prefill, blocking, after one compile
    padded = pad_prompt(prompts[0], engine.bucket(prompt_len))
    prefill = lambda i: engine.prefill(params=p, padded_tokens=padded, true_length=prompt_len,  # noqa: E731
                                       sampling=sampling, key=jax.random.key(i))
    jax.block_until_ready(prefill(0))
    times = []
    for i in range(3):
        t = time.perf_counter()
        jax.block_until_ready(prefill(i))
        times.append(time.perf_counter() - t)
    prefill_s = statistics.median(times)

    # decode steps with every slot busy (positions mid-way, so attention spans a realistic length)
    state = engine.init_decode_state()
    prefix = prefill(0)
    for slot in range(slots):
        state = engine.insert(prefix, state, slot)
    state, res = engine.generate(p, state, truncate=False, penalize=False, ban=False)
    res.tokens.block_until_ready()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, res = engine.generate(p, state, truncate=False, penalize=False, ban=False)
        np.asarray(res.tokens)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    del state

    # end to end through the scheduler (its engine compiles the same shapes again: warm it first)
    sched = Scheduler(engine, {"base": params, "lora": None}, "bench")

    async def run(ps, max_tokens):
        return await asyncio.gather(*[sched.generate(q, SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                                                          seed=i)) for i, q in enumerate(ps)])

    try:
        asyncio.run(run(prompts[:2], 2))
        t = time.perf_counter()
        outs = asyncio.run(run(prompts, n_tokens))
        wall = time.perf_counter() - t
    finally:
        sched.stop()
    sampled = sum(len(o.token_ids) for o in outs)
    ttft = sorted(o.ttft_s for o in outs)
    return {
        "concurrency": slots, "prompt_tokens": prompt_len, "sampled_tokens": n_tokens,
        "prefill_s": prefill_s, "prefill_tokens_per_s": prompt_len / prefill_s,
        "decode_step_s": step_s, "decode_step_s_all": times, "decode_tokens_per_s": slots / step_s,
        "end_to_end_s": wall, "end_to_end_tokens_per_s": sampled / wall,
        "scheduler_decode_tokens_per_s": (sampled - slots) / (wall - ttft[-1]),
        "ttft_median_s": statistics.median(ttft), "ttft_max_s": ttft[-1],
        "step_bytes": step_bytes(cfg, params, slots, seq, dtype),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=128, help="sampled tokens per request")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and KV cache")
    ap.add_argument("--layers", type=int, default=28, help="decoder layers of the 0.6B shape (fewer: less memory)")
    ap.add_argument("--cpu-devices", type=int, default=1,
                    help="split the host into this many XLA CPU devices; the engine runs tensor-parallel over them")
    ap.add_argument("--paged", action="store_true",
                    help="the paged KV cache (jaxrl.kv.paged, a pool of concurrency x seq positions)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.cpu_devices > 1:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before the CPU backend starts
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    cfg = dataclasses.replace(QWEN3_06B, num_layers=args.layers)

    t = time.perf_counter()
    # unsafe_rbg: random weights in seconds rather than threefry's half minute; values do not matter here
    params = jax.jit(lambda k: modules.init_params(cfg, k, dtype))(jax.random.key(0, impl="unsafe_rbg"))
    jax.block_until_ready(params)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"Qwen3-0.6B shape, {cfg.num_layers} layers, random {args.dtype} weights: {n_params / 1e6:.0f}M params "
          f"({time.perf_counter() - t:.0f} s to build); {os.cpu_count()} CPUs, jax {jax.__version__}, "
          f"engine on {args.cpu_devices} device(s)", flush=True)

    results = []
    for c in args.concurrency:
        r = bench(cfg, params, dtype, c, args.prompt, args.tokens, args.steps, args.cpu_devices, args.paged)
        bw = memory_read_gbps()  # measured right after, under the same load
        flops = matmul_gflops()
        limit_mem = c / (r["step_bytes"] / (bw * 1e9))
        limit_flops = c / (2 * n_params * c / (flops * 1e9))
        r |= {"read_gbps": bw, "matmul_gflops": flops, "limit_tokens_per_s": limit_mem,
              "compute_bound_tokens_per_s": limit_flops, "ratio_to_limit": r["decode_tokens_per_s"] / limit_mem}
        results.append(r)
        print(f"C={c:3d}: prefill {r['prefill_tokens_per_s']:6.0f} tok/s | decode {r['decode_tokens_per_s']:6.1f} "
              f"tok/s ({r['decode_step_s'] * 1e3:.0f} ms/step), in the scheduler "
              f"{r['scheduler_decode_tokens_per_s']:6.1f} tok/s | end to end {r['end_to_end_tokens_per_s']:6.1f} "
              f"tok/s | TTFT median {r['ttft_median_s']:.2f} s, max {r['ttft_max_s']:.2f} s | step reads "
              f"{r['step_bytes'] / 1e9:.2f} GB at {bw:.1f} GB/s -> limit {limit_mem:.1f} tok/s, ratio "
              f"{r['ratio_to_limit']:.0%} | compute bound at {flops:.0f} GFLOP/s: {limit_flops:.1f} tok/s",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "dtype": args.dtype, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
