# HF transformers + PEFT LoRA (PyTorch CPU) training-step throughput on a saved Qwen3 checkpoint.
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

path, B, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
model = get_peft_model(
    model,
    LoraConfig(
        r=16,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
ids = torch.randint(0, 150000, (B, T))


def step():
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()


step()
t = time.perf_counter()
n = 2
for _ in range(n):
    step()
dt = (time.perf_counter() - t) / n
print(f"hf-torch+peft LoRA r16 B={B} T={T}: {B * T / dt:.1f} tok/s ({dt:.2f} s/step)")
