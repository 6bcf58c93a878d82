"""The micro-batch a run trains in when `[jax] micro_batch_size` is unset: the largest whose whole program
set fits a chip, found by compiling. `jaxrl compile` reports it as "the largest that fits (compiled)"; a
run on accelerators chooses it the same way at startup (`jaxrl.compile.report.run_micro_batch`).

Each candidate is judged by the total the report adds up (`fit.memory_terms`): its compiled train step
(arguments, the outputs not written over its donated state, scratch) and what the rollout engine holds
beside it whatever the micro-batch (`EngineSide`): the compiled prefill's and decode step's scratch (the
larger: one runs at a time, beside the train step, which runs in a thread while the engine decodes), the
prefill's outputs, the decode step's slot state, the engine's own copy of the weights where it holds one,
and its KV cache. Until 2026-11-27 the train step was set beside the engine's KV cache alone, so the
programs compiled after it could leave the total over what the search had judged to fit (docs/tpu.md 7.2).

The engine judged is the one the run has at the least: on every host (reading the trainer's weights unless
it must own them, `fit.engine_owns_weights`), or on the hosts set (`[jax] engine_hosts`, `--engine-hosts`).
Its KV cache is the pool `[jax] kv_cache_tokens` sets; unset, the pool that fits is sized after the
micro-batch (`pool.sized`) and the search sets aside the larger of its smallest (one sequence) and the
dense cache of `decode_slots` x `seq_len` (what this rule set aside before the pool was the default), so a
micro-batch never takes the rollouts' room a dense engine would have had.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.compile import fit, pool, programs
from jaxrl.compile.programs import Program, Shapes
from jaxrl.parallel.sharding import batch_shards


@dataclasses.dataclass(frozen=True)
class EngineSide:
    """The rollout engine beside the train step: its `hosts`, its prefill and decode step compiled at the
    search's depths (`prefill`, `decode`: by depth; no prefill where the engine runs chunked prefill,
    `programs.runs_prefill`; the decode step over the pool set, or the smallest that runs), whether it owns
    its weights, and the bytes a chip set aside for its KV cache (`kv_cache`)."""

    hosts: int
    prefill: dict[int, Program]
    decode: dict[int, Program]
    owns_weights: bool
    kv_cache: int
    layers: int  # the model's depth, where `prefill` and `decode` are read (`fit.at_depth`)

    def total(self, train: dict[str, int]) -> int:
        """Bytes a chip of a run whose train step has `train`'s byte counts (`fit.at_depth`) beside this
        engine: the sum of `fit.memory_terms`, the KV cache as set aside here."""
        depths = tuple(sorted(self.decode))
        terms = fit.memory_terms(train, fit.at_depth(self.prefill, depths, self.layers),
                                 fit.at_depth(self.decode, depths, self.layers), self.owns_weights)
        return sum(terms.values()) - terms["kv_cache"] + self.kv_cache


def engine_side(shapes: Shapes, mesh: Any, depths: tuple[int, ...], hosts: int | None = None) -> EngineSide:
    """`EngineSide` of `shapes`' engine on `hosts` hosts of the trainer's `mesh` (None: all of them), its
    prefill and decode step compiled at each of `depths` (two: extrapolated to the model's depth).

    Raises:
        programs.ProgramTooLarge: the compiler refused the prefill or the decode step.
        ValueError: `hosts` does not divide the slice's (`programs.engine_mesh`).
    """
    hosts = hosts or fit.hosts(mesh)
    emesh = programs.engine_mesh(mesh, hosts)
    least = shapes if shapes.kv_cache_tokens is not None else pool.sized(shapes, emesh, 0)  # one sequence
    prefill = ({d: programs.compile_prefill(shapes.at_depth(d), emesh) for d in depths}
               if programs.runs_prefill(shapes, emesh) else {})
    decode = {d: programs.compile_decode(least.at_depth(d), emesh) for d in depths}
    kv = fit.at_depth(decode, depths, shapes.model.num_layers)["declared_kv_cache"]
    if shapes.kv_cache_tokens is None:
        kv = max(kv, programs.engine_declared_bytes(shapes, emesh, own_weights=False))
    return EngineSide(hosts, prefill, decode, fit.engine_owns_weights(shapes, emesh, mesh), kv,
                      shapes.model.num_layers)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The micro-batch chosen (`micro`, sequences), its train step compiled by depth (`train`), the
    engine it was judged beside (`engine`) and that run's total bytes a chip (`total`)."""

    micro: int
    train: dict[int, Program]
    engine: EngineSide
    total: int


def candidates(rows: int, shards: int) -> list[int]:
    """Sequences per micro-batch to choose among for a batch of `rows` on `shards` batch shards: a power of
    two per shard, from 1 up to the batch's share (`ceil(rows / shards)`, itself the last), times `shards`."""
    share = -(-rows // shards)
    per_shard = [1 << i for i in range(share.bit_length()) if 1 << i < share] + [share]
    return [p * shards for p in per_shard]


def compiled_micro_batch(shapes: Shapes, mesh: Any, hbm_bytes: int, depths: tuple[int, ...] | None = None,
                         engine_hosts: int | None = None) -> Choice:
    """The largest of `candidates` whose run fits: its compiled train step beside `engine_side` (on
    `engine_hosts`, None: every host), the sum of the report's terms (`EngineSide.total`) at most
    `fit.FIT_SHARE` of `hbm_bytes` (one chip's); extrapolated from `depths` when two are given (None: full
    depth). The whole batch in one pass is tried first (it can need less than two halves: accumulating keeps
    gradient buffers; the tiny Qwen3 on v5p-16, 16 rows: 318 MB a chip in one pass, 363 MB in two), then the
    rest by bisection (scratch grows with the micro-batch). A candidate whose total is over at the shallower
    depth is over at full depth (memory grows with depth): the deeper is then not compiled. About
    1 + log2(candidates) train steps per depth, and the engine's two programs per depth. The smallest
    candidate, compiled at every depth, when none fits (the report then says what overflows): it fits
    whenever one does.

    Raises:
        programs.ProgramTooLarge: the smallest candidate's train step, or the engine's prefill or decode
            step, does not compile (more than a chip's HBM).
    """
    layers = shapes.model.num_layers
    depths = tuple(depths or (layers,))
    engine = engine_side(shapes, mesh, depths, engine_hosts)
    options = candidates(shapes.batch_rows, batch_shards(mesh))
    tried: dict[int, dict[int, Program] | None] = {}  # its train step by the depths compiled; None: refused

    def fits(i: int) -> bool:
        micro = options[i]
        train = tried.setdefault(micro, {})
        for d in depths:
            if train is None:
                return False
            if d not in train:
                try:
                    train[d] = programs.compile_train(dataclasses.replace(shapes.at_depth(d), micro_batch_size=micro),
                                                      mesh)
                except programs.ProgramTooLarge:
                    if i == 0:
                        raise
                    tried[micro] = train = None
                    return False
            if engine.total(fit.at_depth({d: train[d]}, (d,), d)) > fit.FIT_SHARE * hbm_bytes:
                return False
        return engine.total(fit.at_depth(train, depths, layers)) <= fit.FIT_SHARE * hbm_bytes

    def chosen(i: int) -> Choice:
        train = tried[options[i]]
        for d in (d for d in depths if d not in train):  # the smallest, cut short at a shallower depth
            train[d] = programs.compile_train(dataclasses.replace(shapes.at_depth(d), micro_batch_size=options[i]),
                                              mesh)
        return Choice(options[i], train, engine, engine.total(fit.at_depth(train, depths, layers)))

    last = len(options) - 1
    if fits(last):  # the whole batch in one pass (accumulating costs buffers: it can be smaller than two halves)
        return chosen(last)
    if last == 0 or not fits(0):
        return chosen(0)
    lo, hi = 0, last - 1  # options[lo] fits; the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return chosen(lo)
