"""The trainer's CPU tuning, behind one seam: how a train step lays out its work on the mesh's platform.

The train step (`jaxrl.rl.train.Trainer`) reads one `Tuning`, chosen once from its mesh by `tuning`: on
TPU and GPU the plain one (`Tuning.plain`: the layer stack scanned, the output head in chunks of
`head.TOKENS_PER_CHUNK` tokens over the whole vocabulary in one block, whose axis may be sharded over
`tensor`: slicing it in a loop would gather it). On CPU (`cpu_tuning`) XLA's CPU backend was measured
faster with a shallow stack unrolled, the head's vocabulary in blocks that stay in cache, and chunks sized
by the core's L2 cache (read from Linux's sysfs, `l2_bytes`). The figures are in docs/benchmarks.md
(2026-11-23 .. 2026-11-25; gathered in 2026-11-26).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from jax.sharding import Mesh

from jaxrl.model import head
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import mesh_platform

# The deepest stack a train step on CPU unrolls: faster unrolled at 4 layers (the small shape of the RL step
# against Tunix), slower at 28 (Qwen3-0.6B); 8 lies between (docs/benchmarks.md, 2026-11-26).
UNROLLED_LAYERS = 8
# Vocabulary entries per block of the head's online softmax on CPU: the [chunk, block] logits and the
# [block, D] rows stay in cache (docs/benchmarks.md, 2026-11-26).
HEAD_BLOCK = 2048


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How a train step runs on its platform.

    scan_layers: run the layer stack with `lax.scan` (`decoder.decoder_stack`); False unrolls it.
    head_chunk: tokens per chunk of the output head (`jaxrl.rl.train.sampled_logprobs`).
    head_block: vocabulary entries per block of the head's online softmax (the whole vocabulary: one block).
    """

    scan_layers: bool
    head_chunk: int
    head_block: int

    @classmethod
    def plain(cls, cfg: ModelConfig) -> Tuning:
        """What a TPU or GPU runs: the stack scanned, chunks of `head.TOKENS_PER_CHUNK`, one vocabulary block."""
        return cls(scan_layers=True, head_chunk=head.TOKENS_PER_CHUNK, head_block=cfg.vocab_size)


def tuning(mesh: Mesh, cfg: ModelConfig) -> Tuning:
    """The train step's tuning on `mesh` (`mesh_platform`: the mesh's devices decide, so `jaxrl compile`'s
    TPU programs traced on a CPU host are the plain ones): `cpu_tuning` on CPU, else `Tuning.plain`."""
    return cpu_tuning(cfg) if mesh_platform(mesh) == "cpu" else Tuning.plain(cfg)


def cpu_tuning(cfg: ModelConfig, l2: int | None = None) -> Tuning:
    """The CPU's tuning for `cfg`: stacks of at most `UNROLLED_LAYERS` unrolled (XLA's CPU backend fills a
    scan's stacked per-layer outputs with zeros before the loop); the head in blocks of `HEAD_BLOCK` and in
    chunks of at least the hidden size and 256 tokens per MiB of a core's L2 cache (`l2` bytes, default
    `l2_bytes()`; 256 when unknown), 256 to 1024: more rows do more per block read while the [chunk, block]
    logits fit in cache (measured on 1 and 2 MiB L2s, docs/benchmarks.md)."""
    l2 = l2_bytes() if l2 is None else l2
    by_cache = min(1024, max(head.TOKENS_PER_CHUNK, head.TOKENS_PER_CHUNK * (l2 or 0) // 2**20))
    return Tuning(scan_layers=cfg.num_layers > UNROLLED_LAYERS, head_chunk=max(by_cache, cfg.hidden_size),
                  head_block=HEAD_BLOCK)


@functools.cache
def l2_bytes() -> int | None:
    """Bytes of CPU 0's level-2 cache (one core's on the x86 machines measured), from Linux's sysfs, read
    once; None where it is not there."""
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip()
                return int(size[:-1]) * {"K": 2**10, "M": 2**20}[size[-1]] if size[-1] in "KM" else int(size)
        except (OSError, ValueError):
            return None
    return None
