"""The longest context a slice trains, found by compiling: `jaxrl compile`'s "context" line.

A run's sequences can be as long as the train step at one sequence per batch shard (the smallest
micro-batch) fits on a chip beside the engine's KV cache at that length. Both grow with the length: the
KV cache exactly (`decode_slots` x length positions a layer), the train step's arguments (the batch) and
its scratch (the layer inputs remat keeps, splash attention's per-block statistics, the logit chunks)
about linearly. So the lengths tried are powers of two, bisected as `micro_batch.compiled_micro_batch`
bisects micro-batches, each one's train step compiled (at the report's depths, extrapolated) and judged
by the fit rule: its bytes a chip, scratch included, plus the least an engine adds (its KV cache at that
length, on all the hosts) at most `fit.FIT_SHARE` of HBM. Prefill's and decode's scratch are left out
(two more compiles a length; the micro-batch rule, `micro_batch`, compiles them once for its one length):
the report of a run at that length (`jaxrl compile` with `[jax] seq_len` set to it) adds them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.compile import fit, programs
from jaxrl.compile.programs import Shapes
from jaxrl.parallel.sharding import batch_shards

SHORTEST = 1024  # the first length tried


@dataclasses.dataclass(frozen=True)
class Context:
    """The longest context found: `tokens` a sequence (0: not even `SHORTEST` fits), its bytes a chip
    (the train step's and the engine's KV cache), the next length tried and its bytes (None: it was the
    model's `max_position_embeddings`, or the compiler refused it), and the lengths compiled."""

    tokens: int
    bytes: int
    longer: int | None
    longer_bytes: int | None
    max_position_embeddings: int
    compiled: tuple[int, ...]

    def line(self, hbm: int) -> str:
        """The report's line."""
        g = 2**30
        if not self.tokens:
            return f"context: not even {SHORTEST} tokens a sequence fit at one sequence per batch shard"
        head = (f"context: trains sequences of up to {self.tokens:,} tokens here, one per batch shard "
                f"({self.bytes / g:.2f} of {hbm / g:.0f} GiB a chip with the KV cache at that length)")
        if self.tokens >= self.max_position_embeddings:
            return head + f"; the model's longest (max_position_embeddings {self.max_position_embeddings:,})"
        more = "refused by the compiler" if self.longer_bytes is None else f"{self.longer_bytes / g:.2f} GiB"
        return head + f"; {self.longer:,} does not fit ({more})"


def candidates(max_position_embeddings: int) -> list[int]:
    """Lengths to try: powers of two from `SHORTEST`, and the model's longest when it is not one."""
    out = [SHORTEST << i for i in range(max_position_embeddings.bit_length())
           if SHORTEST << i < max_position_embeddings]
    return out + [max_position_embeddings]


def compiled_context(shapes: Shapes, mesh: Any, hbm_bytes: int, depths: tuple[int, ...] | None = None) -> Context:
    """The longest of `candidates` at which `shapes`' run trains on `mesh` (`hbm_bytes` a chip), by
    bisection (fitting shrinks with length): about log2(len(candidates)) compiles of the train step per
    depth (`depths`, as `report.compile_report`'s; None: full depth). The run's `batch_rows`, `decode_slots`,
    LoRA and remat are kept; `micro_batch_size` is the batch shards' count and `seq_len` each candidate.

    Raises:
        programs.ProgramTooLarge: never; a length the compiler refuses does not fit.
    """
    layers = shapes.model.num_layers
    depths = tuple(depths or (layers,))
    emesh = programs.engine_mesh(mesh, fit.hosts(mesh))
    own = fit.engine_owns_weights(shapes, emesh, mesh)
    lengths = candidates(shapes.model.max_position_embeddings)
    sized: dict[int, int | None] = {}  # length -> bytes a chip (None: refused by the compiler)

    def bytes_at(i: int) -> int | None:
        t = lengths[i]
        if t not in sized:
            # a pool set by [jax] kv_cache_tokens holds at least one sequence of the length tried
            pool = None if shapes.kv_cache_tokens is None else max(shapes.kv_cache_tokens, t)
            at = dataclasses.replace(shapes, seq_len=t, micro_batch_size=batch_shards(mesh), kv_cache_tokens=pool)
            try:
                train = {d: programs.compile_train(at.at_depth(d), mesh) for d in depths}
            except programs.ProgramTooLarge:
                sized[t] = None
            else:
                sized[t] = (fit.trainer_bytes(fit.at_depth(train, depths, layers))
                            + programs.engine_declared_bytes(at, emesh, own))
        return sized[t]

    def fits(i: int) -> bool:
        b = bytes_at(i)
        return b is not None and b <= fit.FIT_SHARE * hbm_bytes

    lo, hi = -1, len(lengths) - 1  # lengths[lo] fits (-1: none known), the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    if lo < 0:
        return Context(0, 0, SHORTEST, sized.get(SHORTEST), shapes.model.max_position_embeddings, tuple(sorted(sized)))
    longer = lengths[lo + 1] if lo + 1 < len(lengths) else None
    if longer is not None and longer not in sized:
        bytes_at(lo + 1)
    return Context(lengths[lo], sized[lengths[lo]], longer, None if longer is None else sized[longer],
                   shapes.model.max_position_embeddings, tuple(sorted(sized)))
