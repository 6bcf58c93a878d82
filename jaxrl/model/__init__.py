"""The Qwen3 and Qwen3-MoE models: weights, forward pass, KV cache decode step, Hugging Face
safetensors in and out, the offline tiny assets and the catalogue of supported models.

May import: `jaxrl.config`, `jaxrl.parallel`.
"""
