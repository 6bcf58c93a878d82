"""Evaluating a model on an environment (`jaxrl eval run`) and optimising an environment's system prompt
with GEPA (`jaxrl gepa run`), outside a training run, against any OpenAI-compatible endpoint: jaxrl's own
in-process server over a local model, or a remote one.

May import: everything below it (`config` ... `export`).
"""
