"""The models jaxrl trains: supported architectures and the Hosted Training model names (where a model name
is found on this machine: `jaxrl.config.model_path`).

Nothing here imports JAX, so `jaxrl validate` stays fast. The architecture facts below are those of each
model's published `config.json`; a checkpoint's own `config.json` always wins when it is loaded.
"""

from __future__ import annotations

from typing import Any

from jaxrl.model.families import FAMILIES

ARCHITECTURES = {arch: line for family in FAMILIES.values() for arch, line in family.architectures.items()}
"""HF architecture class -> a line for `jaxrl models`, from every registered family."""

_QWEN3_4B: dict[str, Any] = {
    "model_type": "qwen3", "vocab_size": 151_936, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": True, "rope_theta": 5_000_000.0, "max_position_embeddings": 262_144,
}
_QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe", "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "rope_theta": 10_000_000.0, "max_position_embeddings": 262_144,
}
_QWEN3_235B_A22B: dict[str, Any] = {
    "model_type": "qwen3_moe", "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 12_288,
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "rope_theta": 5_000_000.0, "max_position_embeddings": 262_144,
}
# GLM-4.5-Air's architecture (PrimeIntellect/INTELLECT-3 is its fine-tune): a dense first layer, then 45
# layers of 128 sigmoid-routed experts (top 8) plus one shared expert, q/k/v biases, RoPE on half of each
# head; its multi-token-prediction layer (layer 46 of the checkpoint) is not run.
_GLM45_AIR: dict[str, Any] = {
    "model_type": "glm4_moe", "vocab_size": 151_552, "hidden_size": 4096, "intermediate_size": 10_944,
    "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": False, "n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    "n_group": 1, "topk_group": 1, "attention_bias": True, "use_qk_norm": False, "partial_rotary_factor": 0.5,
    "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131_072,
    "num_nextn_predict_layers": 1,
}

# Hosted Training model name -> its HF config.json architecture fields.
HOSTED_MODELS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-4B-Instruct-2507": _QWEN3_4B,
    "Qwen/Qwen3-4B-Thinking-2507": _QWEN3_4B,
    "Qwen/Qwen3-30B-A3B-Instruct-2507": _QWEN3_30B_A3B,
    "Qwen/Qwen3-30B-A3B-Thinking-2507": _QWEN3_30B_A3B,
    "Qwen/Qwen3-235B-A22B-Instruct-2507": _QWEN3_235B_A22B,
    "Qwen/Qwen3-235B-A22B-Thinking-2507": _QWEN3_235B_A22B,
    "PrimeIntellect/INTELLECT-3": _GLM45_AIR,
}


# The longest sequences a Hosted model has been compiled to train, by `jaxrl compile` for a TPU slice at a
# Hosted batch (256 rows of that length, LoRA r16, bfloat16, remat, one sequence per batch shard in a
# micro-batch, the train step, a prefill of the whole length and the decode step beside each other):
# model -> (tokens, slice, mesh, decode_slots). Lower bounds where longer was not compiled; the rows that
# tests/test_compile_hosted.py compiles and how the others were: docs/tpu.md section 7.
COMPILED_CONTEXT: dict[str, tuple[int, str, str, int]] = {
    "Qwen/Qwen3-4B-Instruct-2507": (32_768, "v5p-8", "tensor 4", 16),
    "Qwen/Qwen3-30B-A3B-Instruct-2507": (32_768, "v5p-16", "fsdp 2, expert 4", 32),  # narrowly: 84.67 of 85.5 GiB
    # `jaxrl compile --depths 3,4` at 4096 tokens (2026-11-26, 81.79 of 95 GiB a chip; longer not compiled)
    "PrimeIntellect/INTELLECT-3": (4_096, "v5p-16", "fsdp 2, expert 4", 64),
}


def compiled_context(model: str) -> tuple[int, str, str, int] | None:
    """`COMPILED_CONTEXT` of `model`, or of the Hosted model with the same architecture (the Instruct and
    Thinking variants share one); None when none was compiled."""
    facts = HOSTED_MODELS.get(model)
    return next((c for name, c in COMPILED_CONTEXT.items() if HOSTED_MODELS[name] is facts), None)
