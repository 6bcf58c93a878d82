"""A decode step's bytes a chip, from its compiled buffers, against the ideal: `jaxrl compile`'s decode
bytes line.

The ideal of a decode step, as the serving engines budget it (vLLM, SGLang and the FlashInfer kernels they
call): the weights read once and the KV cache in use, every slot's keys and values up to its position.

What the step moves is read from the compiled program's memory analysis (its buffer assignment: the
arguments, outputs, aliased outputs and temporaries XLA allocates), not from `cost_analysis()`'s bytes
accessed, which sums every operation's operands and results (each layer's slice of a stacked cache counted
again, docs/tpu.md 7.2) and sees nothing inside a Pallas kernel. Each argument is read once (the KV cache:
what the step's attention reads of it, below), each output not written in place is written once, the KV
written is this step's key and value a slot, and the temporaries are written once and read once: a lower
bound on the program's traffic when each buffer is touched once, and what it cannot do with less. The
program runs `[jax] decode_steps_per_dispatch` steps in a loop (`jaxrl.inference.engine.Engine.generate_steps`):
the line is per step, each step reading the weights and its KV and writing and reading the loop body's
temporaries, the slot state read and the outputs written once a program, their share a step.
The attention reads, per slot: with JAX's Pallas paged-attention kernel (TPU) its pages up to its position,
in the kernel's compute blocks (`jaxrl.kv.pallas.KERNEL_BLOCK` positions); with the dense stacked cache
every position of it (masked); with the paged gather reference (GPU, CPU) the chunks that hold its
position (`jaxrl.kv.chunks.chunk_sizes`), gathered into a dense copy (counted in the temporaries).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from jaxrl.compile.cost import bytes_text
from jaxrl.kv import pallas
from jaxrl.kv.chunks import chunk_sizes


@dataclasses.dataclass(frozen=True)
class DecodeBytes:
    """One decode step of `slots` slots, each at `position` (positions in its cache) of `seq_len`, per chip,
    in bytes, of a program of `steps` steps: what it moves (`moved`, from its compiled buffers) and the
    ideal (`ideal`)."""

    slots: int
    position: int
    seq_len: int
    reads: str  # how the attention reads the cache: "kernel" (paged, Pallas), "dense" or "gather"
    weights: int  # the engine's base weights and LoRA, read once
    kv_read: int  # what the attention reads of the KV cache
    kv_written: int  # this step's key and value of every slot
    state: int  # the step's share of the program's other arguments (tokens, positions, sampling state, [B, V] masks)
    outputs: int  # the step's share of the outputs not written in place (compiled output less aliased bytes)
    temp: int  # the compiled temporaries, written once and read once
    kv_in_use: int  # every slot's keys and values up to `position`: the ideal's KV
    cache: int  # the whole KV cache a chip (the report's kv_cache term)
    steps: int = 1  # decode steps a program (`[jax] decode_steps_per_dispatch`)

    @property
    def moved(self) -> int:
        return self.weights + self.kv_read + self.kv_written + self.state + self.outputs + 2 * self.temp

    @property
    def ideal(self) -> int:
        return self.weights + self.kv_in_use

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "moved": self.moved, "ideal": self.ideal}

    def lines(self) -> list[str]:
        how = {"kernel": "the kernel's pages up to each slot's position",
               "dense": "the whole dense cache, masked",
               "gather": "the chunks that hold each slot's position"}[self.reads]
        return [f"decode step bytes ({self.slots} slots at position {self.position:,} of {self.seq_len:,}, per chip, "
                f"per step of a program of {self.steps}, from its compiled buffers): moves {bytes_text(self.moved)} = "
                f"weights and LoRA "
                f"{bytes_text(self.weights)} + KV read {bytes_text(self.kv_read)} ({how}) + KV written "
                f"{bytes_text(self.kv_written)} + slot state {bytes_text(self.state)} + outputs "
                f"{bytes_text(self.outputs)} + temporaries {bytes_text(self.temp)} written and read; ideal "
                f"{bytes_text(self.ideal)} (weights once + the KV in use, {bytes_text(self.kv_in_use)}): "
                f"ratio {self.moved / self.ideal:.2f}",
                f"  decode temporaries: {bytes_text(self.temp)}, {self.temp / self.cache:.1%} of the KV cache "
                f"({bytes_text(self.cache)})"]


def positions_read(reads: str, position: int, seq_len: int) -> int:
    """Positions a slot at `position` has its attention read (`DecodeBytes.reads`; see the module)."""
    if reads == "kernel":
        return -(-position // pallas.KERNEL_BLOCK) * pallas.KERNEL_BLOCK
    if reads == "gather":
        return next(h for h in itertools.accumulate(chunk_sizes(seq_len)) if h >= position)
    return seq_len


def of(decode: dict[str, int], cache: int, bytes_per_token: float, reads: str, slots: int, position: int,
       seq_len: int, steps: int = 1) -> DecodeBytes:
    """`DecodeBytes` of the compiled decode program's byte counts `decode` (`jaxrl.compile.report`'s, at full
    depth: argument, output, alias, temp and the declared weights, lora and kv_cache), `steps` decode steps
    a program, its cache of `cache` bytes a chip and `bytes_per_token` a cached position, every one of its
    `slots` at `position`."""
    weights = decode["declared_weights"] + decode["declared_lora"]
    position = min(position, seq_len)
    return DecodeBytes(slots, position, seq_len, reads, weights,
                       int(slots * positions_read(reads, position, seq_len) * bytes_per_token),
                       int(slots * bytes_per_token),
                       (decode["argument"] - weights - decode["declared_kv_cache"]) // steps,
                       (decode["output"] - decode["alias"]) // steps, decode["temp"],
                       int(slots * position * bytes_per_token), cache, steps)
