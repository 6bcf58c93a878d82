"""Ahead-of-time compilation of a run's programs for a TPU slice on any machine (`jaxrl compile`): the
slice's devices from libtpu's topology description (no TPU attached), abstract weights, and the XLA TPU
compiler's per-chip memory report, checked against the chip's HBM.

May import: everything below it (`config` ... `rl`).
"""
