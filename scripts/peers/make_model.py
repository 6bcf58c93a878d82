# Save a randomly initialised Qwen3 (dense or MoE) checkpoint in HF format.
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

shape, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
if shape == "0.6b":
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1_000_000, rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype="bfloat16")
    model = Qwen3ForCausalLM(cfg)
elif shape == "small":  # the shape of bench_tunix_grpo.py's model, for end-to-end RL step comparisons
    cfg = Qwen3Config(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      rope_theta=1_000_000, rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
elif shape == "moe-small":
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                         rope_theta=1_000_000, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg)
model.save_pretrained(out)
print(sum(p.numel() for p in model.parameters()) / 1e6, "M params")
