"""The rollout engine's KV cache in tokens, as `jaxrl compile` sizes it: the positions each engine holds
(`kv_pool_tokens`: the paged pool's `[jax] kv_cache_tokens`, or the dense cache's `decode_slots` x
`seq_len`), what one cached token costs a chip, the largest pool that fits beside the rest of the run, and
how many rollouts of a given mean length run at once on the slice.

A token's bytes a chip come from the cache the engine declares (`EngineLayout.cache`, placed as the run
places it: `programs.abstract_decode_state`): 2 (k, v) x L x K x H x the cache's bytes, over the chips its
kv heads are split across (a paged pool: `tensor` then the batch axes, as many as divide K,
`jaxrl.model.paged.POOL_AXES`; a dense cache: `tensor` for the heads and the batch axes for the slots).
A rollout of n tokens holds about n positions of the pool (whole pages: up to 15 more); decode slots cap
the sequences an engine runs at once, whatever its pool holds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from jaxrl.compile import programs
from jaxrl.compile.programs import Shapes
from jaxrl.model import paged
from jaxrl.model.qwen3 import ModelConfig
from jaxrl.parallel.sharding import MESH_AXES, logical_spec


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """An engine's KV cache in tokens and what the slice runs at once (`of`)."""

    tokens: int  # positions each engine's cache holds (a pool's whole pages, the scratch page left out)
    paged: bool  # a paged pool ([jax] kv_cache_tokens), else the dense cache
    bytes_per_token: float  # bytes a chip of the engine holds per cached token
    fit_tokens: int  # the largest pool per engine whose bytes fit `free` (the HBM the rest of the run leaves)
    engines: int  # rollout engines on the slice
    slots: int  # decode slots per engine
    mean_tokens: int  # the mean rollout length (prompt and completion) the counts are for

    def rollouts(self, tokens: int) -> int:
        """Rollouts of `mean_tokens` one engine runs at once with a cache of `tokens` positions: what its
        memory holds, at most its decode slots."""
        return min(self.slots, tokens // self.mean_tokens)

    def to_json(self) -> dict[str, Any]:
        return {"kv_pool_tokens": self.tokens, "kv_pool_paged": self.paged, "kv_bytes_per_token": self.bytes_per_token,
                "kv_pool_tokens_fit": self.fit_tokens, "engines": self.engines,
                "concurrent_rollouts": {"mean_tokens": self.mean_tokens, "per_engine": self.rollouts(self.tokens),
                                        "per_slice": self.engines * self.rollouts(self.tokens),
                                        "per_slice_fit": self.engines * self.rollouts(self.fit_tokens)}}

    def lines(self) -> list[str]:
        kind = "paged pool ([jax] kv_cache_tokens)" if self.paged else "dense cache (decode_slots x seq_len)"
        return [f"KV cache: {self.tokens:,} tokens per engine, {kind}, {self.bytes_per_token / 2**10:.1f} KiB a "
                f"token a chip; a pool of {self.fit_tokens:,} tokens per engine would fit beside the rest",
                f"  rollouts of {self.mean_tokens:,} tokens at once: {self.rollouts(self.tokens)} per engine, "
                f"{self.engines * self.rollouts(self.tokens)} on the slice ({self.engines} engine(s)); "
                f"{self.engines * self.rollouts(self.fit_tokens)} with the pool that fits "
                f"(at most {self.slots} decode slots per engine)"]


def of(shapes: Shapes, emesh: Any, engines: int, free: int, mean_tokens: int) -> PoolSize:
    """`PoolSize` of `shapes`' engine on `emesh`, `engines` of them on the slice, `free` bytes a chip left
    for the cache (the usable HBM less every other term of the report), for rollouts of `mean_tokens`."""
    engine, _ = programs._engine(shapes, emesh)
    cache = programs.abstract_decode_state(engine).cache
    pool = {n: cache[n] for n in ("k", "v")}  # the pools (a paged cache's page table is not per token)
    paged = engine.pages is not None
    held = engine.pages.num_pages * engine.pages.page if paged else shapes.decode_slots * shapes.seq_len
    per_token = programs.shard_bytes(pool) / held
    fit = max(0, int(free / per_token)) - (engine.pages.page if paged else 0)  # less the scratch page
    if paged:
        fit -= fit % engine.pages.page
    tokens = held - engine.pages.page if paged else held  # a pool's usable positions: its pages less scratch
    return PoolSize(tokens, paged, per_token, max(0, fit), engines, shapes.decode_slots, mean_tokens)


def token_bytes(cfg: ModelConfig, mesh_shape: dict[str, int], itemsize: int) -> float:
    """Bytes a device holds per token of a paged pool (`jaxrl.model.paged`) of `cfg` on a mesh of
    `mesh_shape` (no devices needed: `jaxrl models`): 2 (k, v) x L x K x H x `itemsize`, over the devices
    the pool's kv heads are split across (`POOL_AXES`)."""
    mesh = jax.sharding.AbstractMesh(tuple(int(mesh_shape.get(a, 1)) for a in MESH_AXES), MESH_AXES)
    shape = paged.pool_shape(cfg.num_kv_heads, cfg.num_layers, 1, 1, cfg.head_dim)
    heads = logical_spec(paged.POOL_AXES, shape, mesh)[0]
    split = math.prod(mesh.shape[a] for a in (() if heads is None else (heads,) if isinstance(heads, str) else heads))
    return 2 * math.prod(shape) * itemsize / split
