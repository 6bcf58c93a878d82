"""The compiler's FLOPs and bytes of one prefill layer and one decode layer, against their ideal.

`cost_analysis()` counts a scanned layer once whatever the depth (`jaxrl.compile.cost`), and the engine's
programs scan their layers. So each is compiled here with its layers unrolled at the two depths of
`jaxrl.compile.depths.cost_depths`, through the same model code the engine runs (`decoder.forward` over
a prompt bucket, as `Engine._prefill_forward`; the decode step of the engine's KV cache kind, its
`decode` (`jaxrl.kv`: on TPU a ragged step over the paged pool read by the Pallas kernel,
`jaxrl.kv.ragged`), without the sampling around them: the difference is one layer.

Ideal, per layer, divided evenly over the engine's chips (a prefill of one sequence is not split over the
batch axes, so its chips repeat each other's work and its ratio shows it):
  * FLOPs: 2 per active weight and token (`cost.active_layer_weights`; Kaplan et al. 2020, "Scaling Laws
    for Neural Language Models", section 2.1), plus attention's two products (QK^T and PV, 2 FLOPs per
    multiply-add): causal in prefill, 2·T²·N·H for T tokens (T²/2 of each product), counted once; in
    decode 4·S·N·H a slot over the S positions it reads (the dense step reads the whole cache, masked:
    S = seq_len, a slot at its last position).
  * Bytes: the layer's weights and LoRA read once, and the KV cache written (prefill: the prompt's k and
    v) or read (decode: the layer's whole cache), as the compiled programs hold them per chip.
Under splash attention (prefill on TPU) and the paged-attention kernel (decode on TPU) the attention is
inside a Pallas kernel, which `cost_analysis()` does not count: `LayerCost.kernel_flops` says how much of
the ideal that is. The compiler's bytes accessed sum every operation's operands and results, and the
unrolled dense decode slices each layer's k and v out of the stacked cache: an upper bound that had to
be explained away (Qwen3-4B, 256 slots x 4096 on v5p-8: 11.01 GiB a layer a chip against 1.05 ideal).
So the decode's line gives FLOPs only, and its bytes are the decode step bytes line's, from the compiled
step's buffers (`jaxrl.compile.decode_bytes`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.compile import depths, programs
from jaxrl.compile.cost import LayerCost, active_layer_weights
from jaxrl.compile.programs import Program, Shapes
from jaxrl.kv.pallas import PagedPallas
from jaxrl.kv.ragged import RaggedPaged
from jaxrl.model import decoder, kernels, modules


def _difference(a: Program, b: Program, da: int, db: int) -> tuple[float, float]:
    return (b.flops - a.flops) / (db - da), (b.bytes_accessed - a.bytes_accessed) / (db - da)


def prefill_cost(shapes: Shapes, mesh: Mesh) -> LayerCost:
    """`LayerCost` of the engine's largest prefill bucket (`seq_len - 1` tokens) on `mesh` (the engine's):
    the prompt through the unrolled model to its hidden states and k, v. Two compiles.

    Raises:
        programs.ProgramTooLarge: the compiler refused one of them.
    """
    m = shapes.model
    bucket = programs.abstract_engine(shapes, mesh)[0].buckets[-1]  # compile_prefill's
    replicated = NamedSharding(mesh, PartitionSpec())
    tokens = jax.ShapeDtypeStruct((1, bucket), jnp.int32, sharding=replicated)
    da, db = depths.cost_depths(m)
    compiled, weights, kv = [], [], []
    for d in (da, db):
        s = shapes.at_depth(d)
        base, lora = programs.abstract_weights(s, mesh)

        def forward(base: Any, lora: Any, tokens_BT: jax.Array, s: Shapes = s) -> Any:
            model = modules.bind(s.model, base, lora, s.lora_scale)
            return model(tokens_BT, jnp.arange(bucket, dtype=jnp.int32)[None], mesh=mesh, scan_layers=False)

        p = programs.measure(f"prefill {bucket} unrolled", jax.jit(forward).lower(base, lora, tokens), {})
        compiled.append(p)
        weights.append(programs.shard_bytes(base) + programs.shard_bytes(lora))
        kv.append(p.output)  # the hidden states (as deep at both depths) and every layer's k and v
    flops, nbytes = _difference(*compiled, da, db)
    chips = mesh.devices.size
    attention = 2 * bucket**2 * m.num_heads * m.head_dim
    kernel = kernels.attention_kernel(kernels.platform_of(mesh), bucket, shapes.dtype, m.head_dim, False) == "splash"
    ideal = (2 * active_layer_weights(m) * bucket + attention) / chips
    ideal_bytes = (weights[1] - weights[0] + kv[1] - kv[0]) / (db - da)
    return LayerCost(f"prefill {bucket} tokens", flops, nbytes, ideal, ideal_bytes,
                     attention / chips if kernel else 0.0)


def decode_cost(shapes: Shapes, mesh: Mesh) -> LayerCost:
    """`LayerCost` of a decode step of `decode_slots` slots over the engine's cache of `seq_len` positions a
    slot on `mesh` (the engine's: a paged pool on TPU, `[jax] kv_cache_tokens` or the pool that fits):
    the engine's cache kind's `decode` with its layers unrolled, the cache donated as the
    engine donates it. Under the Pallas paged-attention kernel the attention is not counted by the compiler
    (`kernel_flops`). Its bytes are the decode step bytes line's (`jaxrl.compile.decode_bytes`), not these
    (`bytes_counted`). Two compiles.

    Raises:
        programs.ProgramTooLarge: the compiler refused one of them.
    """
    m = shapes.model
    da, db = depths.cost_depths(m)
    compiled, read = [], []
    for d in (da, db):
        s = shapes.at_depth(d)
        engine, params = programs.abstract_engine(s, mesh)
        state = programs.abstract_decode_state(engine)

        def step(base: Any, lora: Any, tokens_B: jax.Array, positions_B: jax.Array, cache: Any,
                 s: Shapes = s, kind: Any = engine.kv) -> Any:
            layers = decoder.join_layers(decoder.unstack_layers(s.model, base), decoder.unstack_layers(s.model, lora))
            model = modules.bind(s.model, base, lora, s.lora_scale)
            return kind.decode(model, layers, tokens_B, positions_B, cache, None, mesh)

        lowered = jax.jit(step, donate_argnums=4).lower(params.base, params.lora, state.tokens,
                                                        state.positions, state.cache)
        compiled.append(programs.measure("decode unrolled", lowered, {}))
        read.append(programs.shard_bytes(params.base) + programs.shard_bytes(params.lora)
                    + programs.shard_bytes(state.cache))
    flops, nbytes = _difference(*compiled, da, db)
    chips, slots = mesh.devices.size, shapes.decode_slots
    attention = slots * 4 * shapes.seq_len * m.num_heads * m.head_dim / chips
    ideal = slots * 2 * active_layer_weights(m) / chips + attention
    kernel = isinstance(engine.kv, PagedPallas | RaggedPaged)
    return LayerCost(f"decode {slots} slots x {shapes.seq_len}", flops, nbytes, ideal, (read[1] - read[0]) / (db - da),
                     attention if kernel else 0.0, bytes_counted=False)


def engine_costs(shapes: Shapes, mesh: Mesh) -> tuple[LayerCost, ...]:
    """The prefill's and the decode's `LayerCost` on the engine's `mesh`: four compiles."""
    return prefill_cost(shapes, mesh), decode_cost(shapes, mesh)
