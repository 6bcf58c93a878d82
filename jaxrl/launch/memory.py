"""Per-chip memory of a jaxrl run: base weights, LoRA with its optimizer state, rollout KV cache and
training activations, placed by the logical-axis rules of `jaxrl.parallel.sharding` (standard library only).

`python -m jaxrl.launch.memory` prints a quick table in a blink, without JAX; the compiler's own account
(temporaries, the step's output state, the engine's copy included) is `jaxrl compile`'s, which docs/tpu.md
section 7 shows. The rules, as `jaxrl.parallel.sharding.RULES`
has them: `embed` on `fsdp`; `heads`, `kv_heads`, `mlp`, `vocab` on `tensor`; `experts` on `expert`;
`batch` on (`data`, `fsdp`, `expert`). A dimension the mesh axes do not divide is replicated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Arch:
    """A Qwen3 or GLM-4.5 MoE architecture (HF config.json names in comments). Dense when `experts` is 0."""

    name: str
    layers: int  # num_hidden_layers (L)
    d: int  # hidden_size (D)
    heads: int  # num_attention_heads (N)
    kv_heads: int  # num_key_value_heads (K)
    head_dim: int  # head_dim (H)
    vocab: int  # vocab_size (V)
    mlp: int = 0  # intermediate_size (F), dense models
    experts: int = 0  # num_experts (E)
    top_k: int = 0  # num_experts_per_tok
    moe_mlp: int = 0  # moe_intermediate_size (I)
    tied: bool = False  # tie_word_embeddings
    dense_layers: int = 0  # first_k_dense_replace (GLM-4.5): the first layers have a dense MLP of width `mlp`
    shared_mlp: int = 0  # n_shared_experts x moe_intermediate_size (GLM-4.5): an always-on expert, no LoRA

    @classmethod
    def of(cls, model: Any) -> Arch:
        """The architecture of a `jaxrl.model.config.ModelConfig`, read by its attribute names (this module
        imports nothing but the standard library). Its MoE layers are taken to be all but the first
        `first_k_dense_replace` (as in the Hosted models: no `mlp_only_layers`, `decoder_sparse_step` 1)."""
        dense = getattr(model, "first_k_dense_replace", 0) if model.num_experts else 0
        return cls("", model.num_layers, model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim,
                   model.vocab_size, mlp=model.intermediate_size if dense or not model.num_experts else 0,
                   experts=model.num_experts, top_k=model.num_experts_per_tok, moe_mlp=model.moe_intermediate_size,
                   tied=model.tie_word_embeddings, dense_layers=dense,
                   shared_mlp=getattr(model, "n_shared_experts", 0) * model.moe_intermediate_size)


QWEN3_4B = Arch("Qwen3-4B", 36, 2560, 32, 8, 128, 151936, mlp=9728, tied=True)
QWEN3_30B_A3B = Arch("Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 151936, experts=128, top_k=8, moe_mlp=768)
QWEN3_235B_A22B = Arch("Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 151936, experts=128, top_k=8, moe_mlp=1536)
INTELLECT_3 = Arch("INTELLECT-3", 46, 4096, 96, 8, 128, 151552, mlp=10944, experts=128, top_k=8, moe_mlp=1408,
                   dense_layers=1, shared_mlp=1408)  # GLM-4.5-Air's architecture


@dataclasses.dataclass(frozen=True)
class Mesh:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1

    @property
    def chips(self) -> int:
        return self.data * self.fsdp * self.tensor * self.expert


def _split(dim: int, *sizes: int) -> int:
    """How many ways a dimension of size `dim` is split over mesh axes of `sizes` (1: replicated)."""
    n = math.prod(sizes)
    return n if n > 1 and dim % n == 0 else 1


def _weights(a: Arch, rank: int | None, m: Mesh) -> tuple[float, float]:
    """(elements, elements per chip) of the base weights (`rank` None) or of the LoRA factors at `rank`
    on the seven projections (one adapter per expert)."""
    nh, kh = a.heads * a.head_dim, a.kv_heads * a.head_dim
    tp, fs = m.tensor, m.fsdp
    # (count, input size, its split, output size, its split, expert split)
    proj = [(a.layers, a.d, _split(a.d, fs), nh, _split(a.heads, tp), 1),  # q
            (a.layers, a.d, _split(a.d, fs), kh, _split(a.kv_heads, tp), 1),  # k
            (a.layers, a.d, _split(a.d, fs), kh, _split(a.kv_heads, tp), 1),  # v
            (a.layers, nh, _split(a.heads, tp), a.d, _split(a.d, fs), 1)]  # o
    ex = _split(a.experts, m.expert) if a.experts else 1
    moe_layers = a.layers - a.dense_layers if a.experts else 0
    # (count, width, expert split) of each kind of SwiGLU MLP: dense, routed experts, shared experts
    mlps = [(a.layers - moe_layers, a.mlp, 1), (moe_layers * a.experts, a.moe_mlp, ex)]
    if rank is None:  # the shared expert is not adapted
        mlps.append((moe_layers, a.shared_mlp, 1))
    for count, mlp, split in mlps:
        if count and mlp:
            proj += [(count, a.d, _split(a.d, fs), mlp, _split(mlp, tp), split)] * 2  # gate, up
            proj += [(count, mlp, _split(mlp, tp), a.d, _split(a.d, fs), split)]  # down
    total = per_chip = 0.0
    for n, x, sx, y, sy, se in proj:
        if rank is None:
            total += n * x * y
            per_chip += n * x * y / (sx * sy * se)
        else:  # a [.., X, R] and b [.., R, Y] each keep the weight's expert axis
            total += n * rank * (x + y)
            per_chip += n * rank * (x / sx + y / sy) / se
    if rank is None:
        emb = a.vocab * a.d * (1 if a.tied else 2)
        router = (a.layers - a.dense_layers) * a.d * a.experts if a.experts else 0
        total += emb + router
        per_chip += emb / (_split(a.vocab, tp) * _split(a.d, fs)) + router / _split(a.d, fs)
    return total, per_chip


def param_count(a: Arch) -> tuple[float, float]:
    """(total, active per token) parameters, norms left out (under 0.01%)."""
    total, _ = _weights(a, None, Mesh())
    if not a.experts:
        return total, total
    expert_params = (a.layers - a.dense_layers) * a.experts * 3 * a.d * a.moe_mlp
    return total, total - expert_params * (1 - a.top_k / a.experts)


@dataclasses.dataclass(frozen=True)
class Budget:
    """Per-chip GiB of each part of a run (see `per_chip`)."""

    weights: float
    lora: float
    kv_cache: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.lora + self.kv_cache + self.activations

    @property
    def trainer(self) -> float:
        """What the trainer keeps on the chip whether or not the rollout engine shares it: all but the
        KV cache."""
        return self.weights + self.lora + self.activations


def per_chip(a: Arch, m: Mesh, *, lora_rank: int = 16, decode_slots: int = 256, seq_len: int = 4096,
             train_seqs: int = 256, weight_bytes: int = 2, micro_seqs: int | None = None,
             full: bool = False) -> Budget:
    """GiB per chip:

    weights     = base elements per chip x `weight_bytes` (2: bfloat16)
    lora        = LoRA elements per chip x 20 bytes: float32 factors (4), the previous version the rollout
                  engine still reads while a step runs (4), gradients (4), Adam's two moments (8);
                  `full` (full fine-tuning): the weights are float32 master weights (4 bytes, whatever
                  `weight_bytes`) and this term is 16 bytes per weight element (the previous version,
                  gradients, Adam's moments) in their place
    kv_cache    = 2 (k, v) x L x decode_slots x seq_len x K x H x 2 bytes (bfloat16)
                  / (data x fsdp x expert: slots) / (tensor: kv heads, when it divides K)
    activations = L x (micro-batch sequences x seq_len / (data x fsdp x expert)) x D x 2 bytes: with
                  `remat`, the residual stream saved at each layer boundary for one micro-batch of
                  `micro_seqs` sequences (None: the default `[jax] micro_batch_size`, 4096 tokens per batch
                  shard, as `jaxrl.rl.train.default_micro_batch`); a layer's recomputation, attention's
                  float32 scores and the logit chunks come on top: `jaxrl compile` measures them
    """
    _, w = _weights(a, None, m)
    _, lo = _weights(a, lora_rank, m)
    batch_split = m.data * m.fsdp * m.expert
    kv = 2 * a.layers * decode_slots * seq_len * a.kv_heads * a.head_dim * 2
    kv /= _split(decode_slots, batch_split) * _split(a.kv_heads, m.tensor)
    micro_seqs = min(train_seqs, micro_seqs or batch_split * max(1, 4096 // seq_len))
    act = a.layers * (micro_seqs * seq_len / batch_split) * a.d * 2
    if full:
        return Budget(w * 4 / GIB, w * 16 / GIB, kv / GIB, act / GIB)
    return Budget(w * weight_bytes / GIB, lo * 20 / GIB, kv / GIB, act / GIB)


# (model, slice, HBM GiB per chip, mesh, decode slots, sequences per train step)
LAYOUTS = [
    (QWEN3_4B, "v5litepod-8", 16, Mesh(fsdp=8), 64, 64),
    (QWEN3_4B, "v6e-8", 32, Mesh(fsdp=8), 128, 128),
    (QWEN3_4B, "v5p-8", 95, Mesh(fsdp=4), 256, 128),
    (QWEN3_30B_A3B, "v5litepod-16", 16, Mesh(fsdp=2, expert=8), 128, 128),
    (QWEN3_30B_A3B, "v5litepod-32", 16, Mesh(fsdp=4, expert=8), 256, 256),
    (QWEN3_30B_A3B, "v6e-16", 32, Mesh(fsdp=2, expert=8), 256, 256),
    (QWEN3_30B_A3B, "v5p-16", 95, Mesh(expert=8), 256, 128),
    (QWEN3_235B_A22B, "v5litepod-256", 16, Mesh(fsdp=8, tensor=4, expert=8), 512, 256),
    (QWEN3_235B_A22B, "v5litepod-256", 16, Mesh(fsdp=8, tensor=4, expert=8), 512, 128),
    (QWEN3_235B_A22B, "v6e-64", 32, Mesh(fsdp=4, tensor=2, expert=8), 256, 128),
    (QWEN3_235B_A22B, "v5p-128", 95, Mesh(fsdp=4, tensor=2, expert=8), 512, 256),
    (INTELLECT_3, "v5p-16", 95, Mesh(fsdp=2, expert=4), 256, 256),
]


def table(seq_len: int = 4096, lora_rank: int = 16) -> str:
    """The markdown table of `LAYOUTS` (GiB per chip; "fits" when the total is under 85% of HBM, the
    rest being XLA's scratch space and fragmentation)."""
    rows = ["| model | slice | chips | mesh (data, fsdp, tensor, expert) | slots x seqs | weights | LoRA+Adam "
            "| KV cache | activations | total | HBM | fits |", "|---" * 12 + "|"]
    for a, accel, hbm, m, slots, seqs in LAYOUTS:
        b = per_chip(a, m, lora_rank=lora_rank, decode_slots=slots, seq_len=seq_len, train_seqs=seqs)
        rows.append(f"| {a.name} | {accel} | {m.chips} | {m.data}, {m.fsdp}, {m.tensor}, {m.expert} | {slots} x "
                    f"{seqs} | {b.weights:.1f} | {b.lora:.2f} | {b.kv_cache:.1f} | {b.activations:.1f} | "
                    f"{b.total:.1f} | {hbm} | {'yes' if b.total <= 0.85 * hbm else 'no'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    for arch in (QWEN3_4B, QWEN3_30B_A3B, QWEN3_235B_A22B, INTELLECT_3):
        total, active = param_count(arch)
        lora, _ = _weights(arch, 16, Mesh())
        print(f"{arch.name}: {total / 1e9:.2f}B parameters ({active / 1e9:.2f}B active), "
              f"bf16 {total * 2 / GIB:.1f} GiB; LoRA r16 {lora / 1e6:.1f}M parameters")
    print()
    print(table())
