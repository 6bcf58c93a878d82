"""The step-time estimate of `jaxrl compile`'s report: a roofline from the model's arithmetic (FLOPs and
bytes per step, `roofline`) and the chip's published peaks (`slices.CHIPS`). The compiler's
`cost_analysis()` is not used for it: it counts the body of a loop once whatever its trip count (a 1-, 2-
and 4-layer scan report the same FLOPs), and every program here loops over layers, logit chunks and
micro-batches (`jaxrl.compile.cost` reads it from programs compiled with their layers unrolled instead).
"""

from __future__ import annotations

from jaxrl.compile import slices
from jaxrl.compile.programs import Shapes
from jaxrl.model.config import ModelConfig


def roofline(m: ModelConfig, s: Shapes, chip: slices.Chip, chips: int, engine_chips: int,
             weights: int, engine_weights: int, kv_cache: int, micro_batches: int,
             expert_chunks: bool = False) -> tuple[float, float]:
    """(train step seconds, decode step seconds): max(FLOPs / peak, bytes / bandwidth) per chip.

    FLOPs per token: 2 per weight of a matmul the token goes through (attention, its MLP or top-k and shared
    experts, the unembedding), plus 4·L·T·N·H for attention over T positions (scores and values, mask included).
    Training multiplies them by 3 (forward, backward) and 4 with remat (the forward again), and the top-k
    experts' by one more when the train step's expert dispatch runs in chunks (`expert_chunks`:
    `jaxrl.model.moe.experts_chunked` recomputes each chunk in the backward). Bytes: a train step reads
    the chip's weights 2x (3x with remat) per micro-batch; a decode step reads the engine's weights and the
    whole KV cache once.
    """
    d, n_h, k_h = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    moe_mlp = (m.num_experts_per_tok + m.n_shared_experts) * 3 * d * m.moe_intermediate_size + d * m.num_experts
    mlp = len(m.moe_layers) * moe_mlp + len(m.mlp_layers) * 3 * d * m.intermediate_size
    matmul = m.num_layers * (2 * d * n_h + 2 * d * k_h) + mlp + m.vocab_size * d
    t = s.seq_len  # the train batch's width (`make_batch`)
    passes = 4 if s.remat else 3
    train_flops = passes * s.batch_rows * t * (2 * matmul + 4 * m.num_layers * t * n_h) / chips
    if expert_chunks:
        experts = len(m.moe_layers) * m.num_experts_per_tok * 3 * d * m.moe_intermediate_size
        train_flops += s.batch_rows * t * 2 * experts / chips
    train_bytes = (3 if s.remat else 2) * micro_batches * weights
    train = max(train_flops / chip.flops, train_bytes / chip.hbm_bandwidth)
    decode_flops = s.decode_slots * (2 * matmul + 4 * m.num_layers * s.seq_len * n_h) / engine_chips
    decode = max(decode_flops / chip.flops, (engine_weights + kv_cache) / chip.hbm_bandwidth)
    return train, decode
