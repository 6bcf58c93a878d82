"""The rollout engine's KV cache in tokens, as `jaxrl compile` and a starting run size it: the positions
each engine holds (`kv_pool_tokens`: the paged pool's `[jax] kv_cache_tokens`; unset on TPU and GPU, the
pool that fits, `fit_pool_tokens`; the CPU's dense cache, `decode_slots` x `seq_len`), what one cached token
costs a chip, the largest pool that fits beside the rest of the run, and how many rollouts of a given mean
length run at once on the slice.

A token's bytes a chip come from the cache the engine declares (`jaxrl.kv.kind.CacheKind.cache`, placed as the run
places it: `programs.abstract_decode_state`): 2 (k, v) x L x K x H x the cache's bytes, over the chips its
kv heads are split across (a paged pool: `tensor` then the batch axes, as many as divide K,
`jaxrl.kv.paged.POOL_AXES`; a dense cache: `tensor` for the heads and the batch axes for the slots).
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
from jaxrl.kv import paged
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import MESH_AXES, logical_spec


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """An engine's KV cache in tokens and what the slice runs at once (`of`)."""

    tokens: int  # positions each engine's cache holds (a pool's whole pages, the scratch page left out)
    paged: bool  # a paged pool ([jax] kv_cache_tokens, or sized to fit: `auto`), else the dense cache
    bytes_per_token: float  # bytes a chip of the engine holds per cached token
    fit_tokens: int  # the largest pool per engine whose bytes fit `free` (the HBM the rest of the run leaves)
    engines: int  # rollout engines on the slice
    slots: int  # decode slots per engine
    mean_tokens: int  # the mean rollout length (prompt and completion) the counts are for
    auto: bool = False  # [jax] kv_cache_tokens unset on an accelerator: the pool that fits (`fit_pool_tokens`)

    def rollouts(self, tokens: int) -> int:
        """Rollouts of `mean_tokens` one engine runs at once with a cache of `tokens` positions: what its
        memory holds, at most its decode slots."""
        return min(self.slots, tokens // self.mean_tokens)

    def to_json(self) -> dict[str, Any]:
        return {"kv_pool_tokens": self.tokens, "kv_pool_paged": self.paged, "kv_pool_auto": self.auto,
                "kv_bytes_per_token": self.bytes_per_token,
                "kv_pool_tokens_fit": self.fit_tokens, "engines": self.engines,
                "concurrent_rollouts": {"mean_tokens": self.mean_tokens, "per_engine": self.rollouts(self.tokens),
                                        "per_slice": self.engines * self.rollouts(self.tokens),
                                        "per_slice_fit": self.engines * self.rollouts(self.fit_tokens)}}

    def lines(self) -> list[str]:
        kind = ("paged pool sized to fit ([jax] kv_cache_tokens unset; at most decode_slots x seq_len)" if self.auto
                else "paged pool ([jax] kv_cache_tokens)" if self.paged else "dense cache (decode_slots x seq_len)")
        return [f"KV cache: {self.tokens:,} tokens per engine, {kind}, {self.bytes_per_token / 2**10:.1f} KiB a "
                f"token a chip; a pool of {self.fit_tokens:,} tokens per engine would fit beside the rest",
                f"  rollouts of {self.mean_tokens:,} tokens at once: {self.rollouts(self.tokens)} per engine, "
                f"{self.engines * self.rollouts(self.tokens)} on the slice ({self.engines} engine(s)); "
                f"{self.engines * self.rollouts(self.fit_tokens)} with the pool that fits "
                f"(at most {self.slots} decode slots per engine)"]


def of(shapes: Shapes, emesh: Any, engines: int, free: int, mean_tokens: int, auto: bool = False) -> PoolSize:
    """`PoolSize` of `shapes`' engine on `emesh`, `engines` of them on the slice, `free` bytes a chip left
    for the cache (the usable HBM less every other term of the report, the page table included), for
    rollouts of `mean_tokens`; `auto`: its pool is the one that fits (`fit_pool_tokens`)."""
    paged, held, per_token, table, page = _cache_of(shapes, emesh)
    fit = fit_pool_tokens(free, per_token, table, page) if paged else max(0, int(free / per_token))
    tokens = held - page if paged else held  # a pool's usable positions: its pages less the scratch page
    return PoolSize(tokens, paged, per_token, fit, engines, shapes.decode_slots, mean_tokens, auto)


def sized(shapes: Shapes, emesh: Any, free: float) -> Shapes:
    """`shapes` with `kv_cache_tokens` the pool of `auto_pool_tokens` for `free` bytes a chip (what the rest
    of the run leaves for the cache, page table included): what an engine on `emesh` (an accelerator's)
    runs when `[jax] kv_cache_tokens` is unset. `shapes` itself where that engine's cache is dense (CPU)."""
    paged, _, per_token, table, page = _cache_of(dataclasses.replace(shapes, kv_cache_tokens=None), emesh)
    if not paged:
        return shapes
    tokens = auto_pool_tokens(fit_pool_tokens(free, per_token, table, page), shapes.decode_slots, shapes.seq_len,
                              page)
    return dataclasses.replace(shapes, kv_cache_tokens=tokens)


def _cache_of(shapes: Shapes, emesh: Any) -> tuple[bool, int, float, int, int]:
    """(paged, positions held with a pool's scratch page, bytes a chip per position, the page table's bytes
    a chip, positions per page: 1 for a dense cache) of the cache `shapes`' engine declares on `emesh`."""
    engine, _ = programs.abstract_engine(shapes, emesh)
    cache = programs.abstract_decode_state(engine).cache
    pool = {n: x for n, x in cache.items() if n != "pages"}  # the pools (a paged cache's page table is not per token)
    paged = engine.pages is not None
    held = engine.pages.num_pages * engine.pages.page if paged else shapes.decode_slots * shapes.seq_len
    table = programs.shard_bytes(cache) - programs.shard_bytes(pool)
    return paged, held, programs.shard_bytes(pool) / held, table, engine.pages.page if paged else 1


def fit_pool_tokens(free: float, bytes_per_token: float, table_bytes: int, page: int) -> int:
    """The most positions, in whole pages of `page`, of a paged pool whose bytes a chip fit `free` (bytes a
    chip the rest of the run leaves: `fit.FIT_SHARE` of HBM less every other term), beside its page table
    (`table_bytes` a chip) and its scratch page: floor((free - table) / bytes_per_token) - page, rounded
    down to pages, at least 0. E.g. 1 GiB free, 24 KiB a token, a 64 KiB table, pages of 16:
    floor((2**30 - 2**16) / 24576) = 43,688 positions, less 16 = 43,672, whole pages 43,664."""
    fit = max(0, int((free - table_bytes) // bytes_per_token)) - page
    return max(0, fit - fit % page)


def auto_pool_tokens(fit: int, slots: int, seq_len: int, page: int) -> int:
    """`[jax] kv_cache_tokens` when unset on an accelerator: the pool that fits (`fit`, from
    `fit_pool_tokens`), at most `slots` x `seq_len` in whole pages (what every slot at its longest holds:
    more would never be used), at least one sequence's whole pages (the smallest pool that runs; a run
    with less room then does not fit, and `jaxrl compile` says so). E.g. 256 slots of 8,192 with pages of
    16 and room for 1,343,168 positions: 1,343,168 (under 2,097,152); room for 3,000,000: 2,097,152."""
    sequence = -(-seq_len // page) * page
    return max(sequence, min(fit, slots * sequence))


def token_bytes(cfg: ModelConfig, mesh_shape: dict[str, int], itemsize: int) -> float:
    """Bytes a device holds per token of a paged pool (`jaxrl.kv.paged`) of `cfg` on a mesh of
    `mesh_shape` (no devices needed: `jaxrl models`): 2 (k, v) x L x K x H x `itemsize`, over the devices
    the pool's kv heads are split across (`POOL_AXES`)."""
    mesh = jax.sharding.AbstractMesh(tuple(int(mesh_shape.get(a, 1)) for a in MESH_AXES), MESH_AXES)
    shape = paged.pool_shape(cfg.num_kv_heads, cfg.num_layers, 1, 1, cfg.head_dim)
    heads = logical_spec(paged.POOL_AXES, shape, mesh)[0]
    split = math.prod(mesh.shape[a] for a in (() if heads is None else (heads,) if isinstance(heads, str) else heads))
    return 2 * math.prod(shape) * itemsize / split
