"""The models: one folder per family over shared blocks, as Flax NNX modules, with their KV-cache decode
step, Hugging Face safetensors in and out, the offline tiny assets and the catalogue of supported models.

  * families (`families.py`, the registry keyed by HF model_type; `family.py`, what one declares):
    `qwen3/` (Qwen3, Qwen3-MoE) and `glm4_moe/` (GLM-4.5, INTELLECT-3), each its config mapping
    (`config.py`), weight names (`weights.py`) and layer kinds (`layers.py`);
  * shared: `config.py` (`ModelConfig`, the blocks' options), `blocks.py` (norms, RoPE, projections,
    LoRA deltas, attention inputs, MLP, feed-forward), `attention.py`, `moe.py`, `decoder.py` (the layer
    stack), `modules.py` (every weight declared once), `decode.py`, `head.py`, `cpu.py`, `hf.py`,
    `hf_lora.py`, `assets.py`, `catalog.py`.

May import: `jaxrl.config`, `jaxrl.parallel`.
"""
