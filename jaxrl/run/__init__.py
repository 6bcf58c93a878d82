"""One `jaxrl run`: the run loop, checkpoints (Orbax, local or `gs://`), recovery and signals, eval/val,
metrics (console, JSONL, W&B) and the environments' CPU share.

May import: everything below it (`config` ... `rl`).
"""
