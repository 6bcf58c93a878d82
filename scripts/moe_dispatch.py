"""The two expert-parallel MoE dispatchers (`jaxrl.model.moe.Dispatch`) compiled for TPU slices from this host.

One MoE block of Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert MLP 768), forward and backward as a
LoRA train step runs it (bf16 weights, rank-16 LoRA on the three expert weights, gradients for the LoRA
factors and the hidden states), `--tokens` tokens per batch shard (data x fsdp x expert devices), on each
slice's mesh as the shipped configs use it. Per dispatcher and slice, per chip: the compiler's FLOPs and
bytes accessed (`cost_analysis()`) and the bytes its collectives bring it (every all-gather, reduce-scatter,
all-reduce, all-to-all and ragged all-to-all in the compiled HLO, by result shape and group:
`collective_bytes`), all compiled in one chunk (no loop, which `cost_analysis()` would count once); and the
temporaries (`memory_analysis()`) compiled with the block's default chunks, as a run holds them. The ragged
all-to-all's result is its worst-case receive buffer; what it sends under balanced routing is given apart
("expected"). The figures are in docs/tpu.md ("MoE dispatch").

    nice python scripts/moe_dispatch.py --slices v5p-8:expert=4 v5p-16:fsdp=2,expert=4 \\
        v5litepod-16:expert=16 v5litepod-32:fsdp=4,expert=8
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.compile import slices
from jaxrl.model import catalog, moe
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import RULES, logical_spec, make_mesh

# "%x = <result shape> <op>(... replica_groups={{0,1,...},...}" (an async op's "-start" returns its operand
# too: its "-done" is counted instead)
_COLLECTIVE = re.compile(r"= (.+?) (all-gather|reduce-scatter|all-reduce|all-to-all|ragged-all-to-all|"
                         r"collective-permute)(?:-done)?\((.*)")
_GROUP = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_ARRAY = re.compile(r"(bf16|f32|s32|u32|f16|pred|s8|u8)\[([0-9,]*)\]")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
# bytes a chip receives per byte of the result, in a group of g: an all-gather or all-to-all receives all of its
# result but its own part, a reduce-scatter the g - 1 other parts of its input (each the result's size), a ring
# all-reduce 2 (g - 1) / g; a ragged all-to-all at most its result (the receive buffer, a worst case)
_RECEIVED = {"all-gather": lambda g: (g - 1) / g, "all-to-all": lambda g: (g - 1) / g,
             "reduce-scatter": lambda g: g - 1, "all-reduce": lambda g: 2 * (g - 1) / g,
             "ragged-all-to-all": lambda g: 1.0, "collective-permute": lambda g: 1.0}


def collective_bytes(hlo: str) -> dict[str, float]:
    """Bytes a chip receives through each kind of collective in loop-free compiled HLO text, from each op's
    result shape and group size (`_RECEIVED`; a ragged all-to-all: its whole receive buffer, an upper bound)."""
    out: dict[str, float] = {}
    for line in hlo.splitlines():
        if not (found := _COLLECTIVE.search(line)):
            continue
        shape, op, rest = found.groups()
        group = _GROUP.search(rest)
        g = len(group.group(1).split(",")) if group else 1
        n = 0
        for dtype, dims in _ARRAY.findall(shape):
            size = _BYTES[dtype]
            for dim in filter(None, dims.split(",")):
                size *= int(dim)
            n += size
        out[op] = out.get(op, 0.0) + n * _RECEIVED[op](g)
    return out


def compile_block(model: ModelConfig, mesh, tokens: int, dispatch: moe.Dispatch, per_chunk: int, rank: int = 16):
    """The block's forward and backward on `mesh`, compiled. Returns the compiled executable."""
    shards = mesh.size // mesh.shape["tensor"]
    m, d, e, i = tokens * shards, model.hidden_size, model.num_experts, model.moe_intermediate_size

    def placed(shape, axes, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, logical_spec(axes, shape, mesh, RULES)))

    we = {k: placed((e, *((d, i) if k != "w_down" else (i, d))), moe.EXPERT_AXES[k]) for k in moe.EXPERT_AXES}
    lwe = {k: {"a": placed((e, rank, we[k].shape[1]), (ax[0], None, ax[1])),
               "b": placed((e, rank, we[k].shape[2]), (ax[0], None, ax[2]))}
           for k, ax in moe.EXPERT_AXES.items()}
    h = placed((m, 1, d), ("batch", None, None))
    router = jax.ShapeDtypeStruct((d, e), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))

    def loss(h, lwe, we, router):
        out = moe.moe_block(h, router, we, lwe, top_k=model.num_experts_per_tok, norm_topk_prob=True,
                            lora_scale=2.0, mesh=mesh, assignments_per_chunk=per_chunk, expert_dispatch=dispatch)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, lwe, we, router).compile()


def expected_sent(model: ModelConfig, ep: int, tokens: int, dispatch: moe.Dispatch) -> float:
    """Bytes of hidden states one chip sends across the expert axis per block pass, under balanced routing:
    the all-gather sends its tokens to ep - 1 devices, the all-to-all (ep - 1) / ep of its X rows per token."""
    if dispatch is moe.Dispatch.ALL_GATHER:
        return tokens * (ep - 1) * model.hidden_size * 2
    return tokens * model.num_experts_per_tok * (ep - 1) / ep * model.hidden_size * 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slices", nargs="+", required=True, help="SLICE:AXIS=SIZE,... e.g. v5p-16:fsdp=2,expert=4")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per batch shard")
    p.add_argument("--dispatch", nargs="+", choices=[d.value for d in moe.Dispatch],
                   default=[d.value for d in moe.Dispatch])
    a = p.parse_args()
    model = ModelConfig.from_hf(catalog.HOSTED_MODELS["Qwen/Qwen3-30B-A3B-Instruct-2507"])
    print("slice | mesh | dispatch | GFLOP | bytes accessed GB | collectives GB (by kind) | "
          "expected sent GB (fwd) | temporaries GiB")
    for item in a.slices:
        name, _, axes = item.partition(":")
        shape = {k: int(v) for k, v in (kv.split("=") for kv in axes.split(","))}
        mesh = make_mesh(shape, slices.topology_devices(slices.parse_slice(name)))
        for dispatch in map(moe.Dispatch, a.dispatch):
            try:
                whole = compile_block(model, mesh, a.tokens, dispatch, per_chunk=2**40)
            except jax.errors.JaxRuntimeError as exc:  # XLA refuses the ragged all-to-all on some slices
                print(f"{name} | {axes} | {dispatch.value} | refused: {str(exc).splitlines()[0]}", flush=True)
                continue
            cost = whole.cost_analysis()
            coll = collective_bytes(whole.as_text())
            temp = compile_block(model, mesh, a.tokens, dispatch, moe.ASSIGNMENTS_PER_CHUNK).memory_analysis()
            kinds = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in sorted(coll.items()))
            print(f"{name} | {axes} | {dispatch.value} | {cost['flops'] / 1e9:.1f} | {cost['bytes accessed'] / 1e9:.2f}"
                  f" | {sum(coll.values()) / 1e9:.3f} ({kinds}) | "
                  f"{expected_sent(model, shape['expert'], a.tokens, dispatch) / 1e9:.3f} | "
                  f"{temp.temp_size_in_bytes / 2**30:.2f}", flush=True)


if __name__ == "__main__":
    main()
