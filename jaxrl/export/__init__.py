"""From a run's checkpoints back to Hugging Face: merged safetensors folders and PEFT adapters.

May import: everything below it (`config` ... `run`).
"""
