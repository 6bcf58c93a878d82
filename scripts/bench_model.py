"""Model throughput on this machine: forward and LoRA train-step tokens/s for the Qwen3-0.6B shape with
random weights, the FLOP/s achieved, and their ratio to this machine's measured matmul peak.

    python scripts/bench_model.py                      # 0.6B shape, B=4 x T=256, LoRA r16 on all 7 projections
    python scripts/bench_model.py --batch 4 --seq 256 --layers 28 --dtype float32
    python scripts/bench_model.py --compile-only       # compile time: scanned vs unrolled layer stack
    python scripts/bench_model.py --train-only --finetune full   # the full fine-tuning step instead of LoRA

FLOPs counted: the forward pass is 2 x (weights touched per token) + attention (4 x T x N x H per token for
QK^T and PV, causal half not subtracted) + the unembedding over the whole vocabulary. The LoRA train step
adds the backward pass through the activations (again 2 x forward matmul FLOPs): the frozen base weights
need no weight gradients, so a LoRA step is ~2x a forward, not the 3x of full fine-tuning (`--finetune full`:
every weight's gradient and AdamW over float32 master weights, `[jax] finetune = "full"`'s step). The peer
figure for the same work (transformers + peft, scripts/peers/bench_hf_train.py) is measured against it, in
alternating runs, by scripts/bench_peers.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl.model import decoder as model  # noqa: E402
from jaxrl.model import modules  # noqa: E402
from jaxrl.model.config import ModelConfig  # noqa: E402
from jaxrl.parallel.sharding import make_mesh, spec_shardings  # noqa: E402
from jaxrl.rl.train import Trainer, make_batch, make_optimizer  # noqa: E402

QWEN3_06B = ModelConfig(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                        num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def matmul_peak(dtype, n: int = 2048, reps: int = 5) -> float:
    """Best-of-`reps` FLOP/s of one jitted n x n @ n x n matmul."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_time(lambda: f(a).block_until_ready()) for _ in range(reps))
    return 2 * n**3 / best


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def forward_flops_per_token(cfg: ModelConfig, t: int) -> float:
    d, f, n, k, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = d * (n * h + 2 * k * h) + n * h * d + 3 * d * f
    return 2 * cfg.num_layers * per_layer + cfg.num_layers * 4 * t * n * h + 2 * d * cfg.vocab_size


def build(cfg: ModelConfig, dtype, rank: int):
    mesh = make_mesh({}, jax.devices()[:1])
    base = jax.jit(lambda k: modules.init_params(cfg, k, dtype),
                   out_shardings=spec_shardings(modules.param_specs(cfg), cfg.dims(), mesh))(jax.random.key(0))
    lora = modules.init_lora(cfg, rank, TARGETS, jax.random.key(1))
    return mesh, base, lora


def bench_forward(cfg, base, b: int, t: int, reps: int) -> float:
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 150_000, (b, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    @jax.jit
    def fwd(params, tokens):
        hidden, _ = model.forward(cfg, params, tokens, positions)
        return model.logits(params, hidden).sum()

    fwd(base, tokens).block_until_ready()
    return min(_time(lambda: fwd(base, tokens).block_until_ready()) for _ in range(reps))


def bench_train(cfg, mesh, base, lora, b: int, t: int, rank: int, reps: int, full: bool = False, dtype=None) -> float:
    """Best-of-`reps` seconds of one train step on B=`b` rows of `t` tokens: LoRA of `rank` over the frozen
    `base`, or with `full` every weight of `base` (float32 master weights, the forward in `dtype`)."""
    if full:
        trainer = Trainer(cfg, mesh, make_optimizer(1e-6, full=True), lora_scale=0.0, full=True, dtype=dtype)
        state, base = trainer.init_state(base, None), None
    else:
        trainer = Trainer(cfg, mesh, make_optimizer(1e-4), lora_scale=16 / rank)
        state = trainer.init_state(base, lora)
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 150_000, t + 1).tolist(), [True] * (t + 1), [-1.0] * (t + 1)) for _ in range(b)]
    batch = make_batch(samples, rng.standard_normal(b), 1.0, t)  # t positions: t + 1 tokens a row
    state, metrics = trainer.step(state, base, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, base, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return min(times)


def compile_times(cfg: ModelConfig, b: int, t: int, rank: int) -> dict[str, float]:
    """Seconds to lower + compile the LoRA forward+backward with a scanned and an unrolled layer stack."""
    base = jax.eval_shape(lambda: modules.init_params(cfg, jax.random.key(0)))
    lora = jax.eval_shape(lambda: modules.init_lora(cfg, rank, TARGETS, jax.random.key(1)))
    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
    out = {}
    for scan in (True, False):
        def loss(lora, base, tokens, scan=scan):
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            hidden, _ = model.forward(cfg, base, tokens, positions, lora=lora, lora_scale=1.0, scan_layers=scan)
            return jnp.mean(hidden.astype(jnp.float32) ** 2)

        t0 = time.perf_counter()
        jax.jit(jax.grad(loss)).lower(lora, base, tokens).compile()
        out["scan" if scan else "unrolled"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--compile-only", action="store_true", help="only time compilation, scan vs unrolled")
    p.add_argument("--train-only", action="store_true", help="only the train step (scripts/bench_peers.py)")
    p.add_argument("--finetune", choices=["lora", "full"], default="lora",
                   help="the train step's kind: LoRA (default) or full fine-tuning ([jax] finetune)")
    args = p.parse_args(argv)
    cfg = dataclasses.replace(QWEN3_06B, num_layers=args.layers)
    dtype = jnp.dtype(args.dtype)
    b, t = args.batch, args.seq
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} x{len(jax.devices())}; Qwen3-0.6B shape, "
          f"{cfg.num_layers} layers, {args.dtype}, B={b} T={t}, "
          + (f"LoRA r{args.rank} on {len(TARGETS)} projections" if args.finetune == "lora" else "full fine-tuning"))

    if args.compile_only:
        for name, s in compile_times(cfg, b, t, args.rank).items():
            print(f"compile LoRA fwd+bwd, {name:8s}: {s:6.1f} s")
        return 0

    peak = matmul_peak(dtype)
    print(f"matmul peak (jitted 2048^3, {args.dtype}): {peak / 1e9:.1f} GFLOP/s")
    full = args.finetune == "full"
    mesh, base, lora = build(cfg, jnp.dtype(jnp.float32) if full else dtype, args.rank)  # full: float32 masters
    fwd_flops = forward_flops_per_token(cfg, t) * b * t

    if not args.train_only:
        s = bench_forward(cfg, base, b, t, args.reps)
        print(f"forward (logits for every position): {b * t / s:7.1f} tokens/s, {s:.2f} s, "
              f"{fwd_flops / s / 1e9:.1f} GFLOP/s = {fwd_flops / s / peak:.0%} of peak")

    s = bench_train(cfg, mesh, base, lora, b, t, args.rank, args.reps, full=full, dtype=dtype)
    train_flops = (3 if full else 2) * fwd_flops
    print(f"{'full' if full else 'LoRA'} train step (RL loss, AdamW): {b * t / s:7.1f} tokens/s, {s:.2f} s, "
          f"{train_flops / s / 1e9:.1f} GFLOP/s = {train_flops / s / peak:.0%} of peak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
