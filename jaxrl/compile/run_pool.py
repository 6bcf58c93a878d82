"""The paged KV pool a starting run gives its rollout engine when `[jax] kv_cache_tokens` is unset on an
accelerator: the pool that fits beside the rest of the run, as `jaxrl compile` sizes it for a slice
(`jaxrl.compile.pool.sized`), from what the devices report.

Where the run learns what fits: the chip's memory is `memory_stats()`'s `bytes_limit` (the smallest of this
process's devices: `jaxrl.parallel.distributed.chip_memory`; CPU reports none, and keeps its dense cache),
and what is already held is its `bytes_in_use` once the trainer's weights, LoRA and optimizer state and the
engine's weights are placed (`distributed.memory_in_use`, the engine built next). What the run's programs
will add is their compiled memory analysis: the train step's temporaries, its new LoRA and optimizer state
and its batch, then the larger of the prefill's and decode step's temporaries, the prefill's outputs and
the decode's slot state. `fit.FIT_SHARE` of the chip less all that is the pool's room.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.compile import fit, pool, programs, report
from jaxrl.config.schema import ConfigError, RunConfig
from jaxrl.model.config import ModelConfig
from jaxrl.parallel import distributed
from jaxrl.parallel.sharding import batch_shards
from jaxrl.rl.train import default_micro_batch


def pool_room(chip_bytes: int, in_use: int, train: programs.Program, prefill: programs.Program | None,
              decode: programs.Program | None) -> float:
    """Bytes a chip left for the KV pool (k and v pools and page table): `fit.FIT_SHARE` of `chip_bytes`
    less `in_use` (what is allocated) and what the compiled programs add to it: the train step's temporaries,
    outputs not written over its donated state (its metrics) and batch, the larger of the prefill's and decode's
    temporaries, the prefill's outputs and the decode's slot state (`report.compile_report`'s terms;
    `decode` None: not compiled yet, left out; `prefill` None: the engine runs none, `programs.runs_prefill`)."""
    prefill_temp, prefill_out = (0, 0) if prefill is None else (prefill.temp, prefill.output)
    temp, slots = (prefill_temp, 0) if decode is None else (max(prefill_temp, decode.temp), decode.declared["slots"])
    return (fit.FIT_SHARE * chip_bytes - in_use - train.temp - (train.output - train.alias) - train.declared["batch"]
            - temp - prefill_out - slots)


def fitted_tokens(cfg: RunConfig, model: ModelConfig, mesh: Any, emesh: Any, micro: int, chip_bytes: int,
                  in_use: int) -> int:
    """The pool's positions (`pool.auto_pool_tokens`) for a run of `cfg` whose trainer is on `mesh` with
    `micro` sequences per micro-batch and whose engine is on `emesh`, with chips of `chip_bytes` of which
    `in_use` are held: the train step and prefill (none where the engine runs chunked prefill,
    `programs.runs_prefill`) compiled at full depth, then the decode step with the pool that fits beside them,
    then the pool that fits beside all three (a pool's size leaves the decode step's scratch as it is: its
    kernel reads pages in place). Three compiles (two without a prefill).

    Raises:
        programs.ProgramTooLarge: the compiler refused one of the programs.
    """
    shapes = dataclasses.replace(report.shapes_of(cfg, model), micro_batch_size=micro)
    train = programs.compile_train(shapes, mesh)
    prefill = programs.compile_prefill(shapes, emesh) if programs.runs_prefill(shapes, emesh) else None
    first = pool.sized(shapes, emesh, pool_room(chip_bytes, in_use, train, prefill, None))
    decode = programs.compile_decode(first, emesh)
    return pool.sized(shapes, emesh, pool_room(chip_bytes, in_use, train, prefill, decode)).kv_cache_tokens


def startup_kv_cache_tokens(cfg: RunConfig, model: ModelConfig, mesh: Any, emesh: Any, micro: int | None,
                            say: Any = print) -> int | None:
    """The engine's `kv_cache_tokens`: `[jax] kv_cache_tokens` when set; None where the devices report no
    memory (CPU: its dense cache); else `fitted_tokens` from the devices' `memory_stats()`, saying so with
    `say`, the least over the processes (an engine over several steps one pool; a collective there).

    Raises:
        ConfigError: (key `jax.kv_cache_tokens`) the compiler refused one of the programs.
    """
    chip_bytes = distributed.chip_memory()
    if cfg.jax.kv_cache_tokens is not None or chip_bytes is None:
        return cfg.jax.kv_cache_tokens
    say("kv_cache_tokens unset: compiling the train step, prefill and decode to size the paged KV pool to what "
        "fits (set [jax] kv_cache_tokens to skip this; jaxrl compile prints the value)")
    micro = micro or default_micro_batch(cfg.jax.seq_len, batch_shards(mesh))
    try:
        tokens = fitted_tokens(cfg, model, mesh, emesh, micro, chip_bytes, distributed.memory_in_use())
    except programs.ProgramTooLarge as exc:
        raise ConfigError(cfg.source, [("jax.kv_cache_tokens", f"sizing the KV pool: {exc}; `jaxrl compile` "
                                                               f"says more")]) from None
    tokens = min(distributed.all_gather_objects(tokens))
    say(f"KV pool: {tokens:,} tokens per engine (what fits beside the run, at most decode_slots x seq_len)")
    return tokens
