"""One `jaxrl run` or `jaxrl sft`: what both share (`job.Job`, with `placement` and `serving`), the RL loop
(`runner.Run`) and the SFT loop (`sft.SftRun`), checkpoints (Orbax, local or `gs://`), recovery and signals,
eval/val, metrics (console, JSONL, W&B) and the environments' CPU share.

May import: everything below it (`config` ... `compile`).
"""
