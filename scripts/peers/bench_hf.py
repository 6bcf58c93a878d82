# HF transformers (PyTorch CPU) decode throughput on a saved Qwen3 checkpoint.
import sys
import time

import torch
from transformers import AutoModelForCausalLM

path, B, P, N = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dtype = getattr(torch, sys.argv[5]) if len(sys.argv) > 5 else torch.float32
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
ids = torch.randint(0, 150000, (B, P))


def run(n):
    with torch.inference_mode():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
        )


run(4)
t = time.perf_counter()
out = run(N)
dt = time.perf_counter() - t
assert out.shape == (B, P + N), out.shape
print(f"hf-torch B={B} P={P} N={N} {dtype}: {B * N / dt:.1f} tok/s ({dt:.2f} s) threads={torch.get_num_threads()}")
