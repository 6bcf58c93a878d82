"""The peer a GPU user would reach for: PyTorch + transformers + PEFT, on the same shapes as
jaxrl's scripts/device_check.py (random weights, bf16). Prints one JSON line a figure.
  train: LoRA r16 on the 7 projections, gradient checkpointing, SDPA attention, AdamW, rows x T tokens
  decode: transformers' generate, greedy, dynamic cache (--static: the static one, which compiles),
          prompt 512 tokens, the new tokens' steps timed
"""

import json
import math
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "qwen3-0.6b": dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}
T7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
dev = "cuda" if torch.cuda.is_available() else "cpu"
smoke = "--smoke" in sys.argv


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def model_for(name):
    cfg = Qwen3Config(**SHAPES[name], attn_implementation="sdpa", max_position_embeddings=40960)
    torch.manual_seed(0)
    with torch.device(dev):
        m = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    return m, cfg


def train(name, rows, T, reps=3):
    m, cfg = model_for(name)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.enable_input_require_grads()
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules=T7))
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (rows, T), device=dev)

    def step():
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    sync()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        step()
        sync()
        best = min(best, time.perf_counter() - t)
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0
    print(
        json.dumps(
            {
                "peer": "torch+peft",
                "what": f"train {name} lora {rows}x{T}",
                "step_s": best,
                "tokens_per_s": rows * T / best,
                "peak_gib": mem,
            }
        ),
        flush=True,
    )
    step = m = opt = None  # free the model and the optimizer state before emptying the CUDA cache
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@torch.no_grad()
def decode(name, slots, prompt=512, new=64):
    m, cfg = model_for(name)
    m.eval()
    ids = torch.randint(0, cfg.vocab_size, (slots, prompt), device=dev)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    if "--static" in sys.argv:
        kw["cache_implementation"] = "static"
    m.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
    sync()
    t = time.perf_counter()
    m.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    sync()
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    m.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    sync()
    tn = time.perf_counter() - t
    step = (tn - t1) / (new - 1)
    print(
        json.dumps(
            {
                "peer": "transformers generate (" + ("static" if "--static" in sys.argv else "dynamic") + " cache)",
                "what": f"decode {name} {slots} slots",
                "step_s": step,
                "tokens_per_s": slots / step,
            }
        ),
        flush=True,
    )
    del m
    if dev == "cuda":
        torch.cuda.empty_cache()


if "--decode-only" in sys.argv and not smoke:
    for name, slots in (("qwen3-0.6b", 64), ("qwen3-4b", 64)):
        decode(name, slots, prompt=int(sys.argv[sys.argv.index("--prompt") + 1]) if "--prompt" in sys.argv else 512)
    sys.exit(0)
if "--train-only" in sys.argv and not smoke:
    for name in ("qwen3-0.6b", "qwen3-4b"):
        train(name, 8, 2048)
    sys.exit(0)
if smoke:
    train("smoke", 2, 64, reps=1)
    decode("smoke", 4, prompt=16, new=4)
else:
    for name in ("qwen3-0.6b", "qwen3-4b"):
        try:
            train(name, 8, 2048)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"peer": "torch+peft", "what": f"train {name}", "error": repr(e)[:300]}), flush=True)
    for name, slots in (("qwen3-0.6b", 64), ("qwen3-0.6b", 256), ("qwen3-4b", 64), ("qwen3-4b", 256)):
        try:
            decode(name, slots)
        except Exception as e:  # noqa: BLE001
            print(
                json.dumps({"peer": "transformers generate", "what": f"decode {name} {slots}", "error": repr(e)[:300]}),
                flush=True,
            )
