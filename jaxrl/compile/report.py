"""`jaxrl compile`: a run's programs compiled for a TPU slice, their per-chip memory against the chip's
HBM, and a roofline estimate of step times.

Memory comes from the compiler (`programs`). Full depth can be slow to compile on a small machine, so
`depths=(d1, d2)` compiles the programs at two reduced depths and extrapolates every per-chip byte
count linearly to the model's depth: the layers are one scanned stack, so memory is affine in depth,
exactly for outputs, to the tile padding for arguments and to under 1% for temporaries
(tests/test_compile_hosted.py checks it on a third depth).

The time estimate is a roofline from the model's arithmetic and the chip's published peaks (`roofline`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax.numpy as jnp

from jaxrl.compile import decode_bytes, fit, micro_batch, pool, programs, slices
from jaxrl.compile import depths as depth_rule
from jaxrl.compile.architecture import model_of, teacher_model_of
from jaxrl.compile.context import Context, compiled_context
from jaxrl.compile.cost import Cost, train_cost
from jaxrl.compile.engine_cost import engine_costs
from jaxrl.compile.fit import FIT_SHARE
from jaxrl.compile.programs import Program, Shapes
from jaxrl.compile.roofline import roofline
from jaxrl.config.schema import ConfigError, RunConfig
from jaxrl.kv.pallas import PagedPallas
from jaxrl.kv.ragged import RaggedPaged
from jaxrl.model import moe
from jaxrl.model.config import ModelConfig
from jaxrl.parallel import distributed
from jaxrl.parallel.sharding import MESH_AXES, RULES, make_mesh
from jaxrl.rl.train import loss_config

TERMS = ("weights", "lora_optimizer", "kl_reference", "teacher", "engine_weights", "kv_cache", "temporaries",
         "other")
ADVICE = {
    "weights": "more chips for the weights: a larger slice, or mesh axes fsdp / expert / tensor instead of data",
    "lora_optimizer": "a smaller [jax] lora_rank or fewer lora_targets (finetune = \"lora\" rather than \"full\"), "
                      "or more fsdp / expert chips",
    "kl_reference": "[jax.loss] kl_coef = 0, or finetune = \"lora\" (its reference is the base with the LoRA off: "
                    "no copy), or more fsdp / expert chips",
    "teacher": "a smaller [jax.teacher] model, a server teacher ([jax.teacher] base_url), [jax] dtype = "
               "\"bfloat16\", or more fsdp / expert chips",
    "engine_weights": "an engine over more hosts (--engine-hosts), or a larger slice",
    "kv_cache": "a smaller [jax] kv_cache_tokens (the paged pool; unset on TPU and GPU, the pool that fits), "
                "fewer [jax] decode_slots or a shorter seq_len",
    "temporaries": "[jax] remat = true, a smaller [jax] micro_batch_size, fewer decode_slots, or a larger slice",
    "other": "a smaller batch_size or decode_slots",
}


@dataclasses.dataclass
class Report:
    """Per-chip bytes of each term at full depth, whether the total fits the chip, the roofline
    estimates, and how the numbers were obtained."""

    slice: slices.Slice
    hosts: int
    mesh: dict[str, int]
    engine_hosts: int
    engine_mesh: dict[str, int]
    shapes: Shapes
    depths: tuple[int, ...]
    terms: dict[str, int]
    programs: dict[str, dict[str, Any]]  # "train@2": the compiler's bytes at that depth (extrapolated at full depth)
    train_step_s: float
    decode_step_s: float
    compile_s: float
    engine_hosts_from: str = "set"  # "set" (--engine-hosts, [jax] engine_hosts) or the rule's description
    micro_batch_from: str = "set"  # "set" ([jax] micro_batch_size) or the rule's description
    cost: Cost | None = None  # the compiler's FLOPs and bytes of a train-step, prefill and decode layer
    pool: pool.PoolSize | None = None  # the engine's KV cache in tokens, and the rollouts it runs at once
    context: Context | None = None  # the longest sequences this slice trains
    decode_bytes: decode_bytes.DecodeBytes | None = None  # the decode step's bytes a chip against the ideal
    engine_programs: str = ""  # the engine's programs compiled (`programs.engine_programs`)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    @property
    def hbm(self) -> int:
        return self.slice.chip.hbm_bytes

    @property
    def fits(self) -> bool:
        return self.total <= FIT_SHARE * self.hbm

    @property
    def overflow(self) -> str:
        """The largest term: the one to shrink first."""
        return max(self.terms, key=self.terms.__getitem__)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of one engine with every slot busy."""
        return self.shapes.decode_slots / self.decode_step_s

    def to_json(self) -> dict[str, Any]:
        return {
            "slice": self.slice.name, "topology": self.slice.topology, "chips": self.slice.chips,
            "hosts": self.hosts, "mesh": self.mesh, "engine_hosts": self.engine_hosts,
            "engine_hosts_from": self.engine_hosts_from, "engine_mesh": self.engine_mesh,
            "model_layers": self.shapes.model.num_layers, "compiled_depths": list(self.depths),
            "batch_rows": self.shapes.batch_rows, "seq_len": self.shapes.seq_len,
            "micro_batch_size": self.shapes.micro_batch_size, "micro_batch_from": self.micro_batch_from,
            "decode_slots": self.shapes.decode_slots,
            "cost": None if self.cost is None else dataclasses.asdict(self.cost),
            "context": None if self.context is None else dataclasses.asdict(self.context),
            "bytes_per_chip": {**self.terms, "total": self.total, "hbm": self.hbm},
            "fits": self.fits, "overflow": None if self.fits else self.overflow, "programs": self.programs,
            "train_step_s": self.train_step_s, "decode_step_s": self.decode_step_s,
            "decode_tokens_per_s_per_engine": self.decode_tokens_per_s, "compile_s": self.compile_s,
            "chip": dataclasses.asdict(self.slice.chip), **(self.pool.to_json() if self.pool else {}),
            "decode_bytes": None if self.decode_bytes is None else self.decode_bytes.to_json(),
            "engine_programs": self.engine_programs,
        }

    def text(self) -> str:
        g = 2**30
        s = self.shapes
        lines = [f"{self.slice.name} ({self.slice.topology}): {self.slice.chips} chips on {self.hosts} hosts, "
                 f"mesh {self.mesh}; engine on {self.engine_hosts} host(s) ({self.engine_hosts_from}), "
                 f"mesh {self.engine_mesh}",
                 f"model: {s.model.num_layers} layers; train {s.batch_rows} x {s.seq_len} tokens in micro-batches "
                 f"of {s.micro_batch_size} ({self.micro_batch_from}); {s.decode_slots} decode slots x {s.seq_len}; "
                 "trains "
                 + ("every weight (finetune = \"full\": lora_optimizer is the weights' AdamW state and update)"
                    if s.full else f"LoRA r{s.lora_rank}"),
                 f"compiled at depth {', '.join(map(str, self.depths))}"
                 + (" and extrapolated (memory is affine in depth)" if s.model.num_layers not in self.depths else "")
                 + f" in {self.compile_s:.0f} s",
                 *([f"engine programs: {self.engine_programs}"] if self.engine_programs else []),
                 "per chip, GiB:"]
        lines += [f"  {name:<15}{self.terms[name] / g:8.2f}" for name in TERMS]
        verdict = "fits" if self.fits else (f"does NOT fit: {self.overflow} is the largest term; try "
                                            f"{advice(self.overflow, s, self.mesh, self.micro_batch_from == 'set')}")
        lines.append(f"  {'total':<15}{self.total / g:8.2f}  of {self.hbm / g:.0f} GiB HBM ({FIT_SHARE:.0%} usable): "
                     f"{verdict}")
        lines.append(f"roofline: train step {self.train_step_s:.2f} s, decode step {self.decode_step_s * 1e3:.1f} ms "
                     f"= {self.decode_tokens_per_s:.0f} tok/s per engine ({self.slice.chip.source})")
        lines += self.pool.lines() if self.pool else []
        lines += self.decode_bytes.lines() if self.decode_bytes else []
        if self.cost is not None:
            lines += self.cost.lines(self.slice.chip)
        if self.context is not None:
            lines.append(self.context.line(self.hbm))
        return "\n".join(lines)


SMALLER_MICRO_BATCH = ("a smaller [jax] micro_batch_size (or none: `jaxrl compile` and a run then take the "
                       "largest that fits)")


def advice(term: str, shapes: Shapes, mesh: dict[str, int], micro_batch_set: bool = True) -> str:
    """What to change when `term` overflows (`ADVICE`), less what the run already does: for temporaries,
    `remat = true` when remat is on. First, whatever the term, a smaller micro-batch (`SMALLER_MICRO_BATCH`)
    when the run sets one (`micro_batch_set`) of more than one sequence per batch shard (the mesh axes the
    batch is split over, `RULES["batch"]`): the train step's scratch grows with it, and it is the cure
    whenever a smaller one fits. Chosen by compiling, it is never named: the search
    (`jaxrl.compile.micro_batch`) judged the whole program set, so no smaller one fits when it does not."""
    shards = math.prod(mesh.get(a, 1) for a in RULES["batch"])
    micro = [SMALLER_MICRO_BATCH] if micro_batch_set and shapes.micro_batch_size > shards else []
    if term != "temporaries":
        return "; ".join(micro + [ADVICE[term]])
    fixes = ([] if shapes.remat else ["[jax] remat = true"]) + micro
    return ", ".join(fixes + ["fewer decode_slots", "or a larger slice"])


def compiled_engine_hosts(shapes: Shapes, mesh: Any, hbm_bytes: int, trainer: int) -> int:
    """The fewest hosts per rollout engine, a divisor of the slice's that `programs.engine_mesh` can lay
    the engine on, at which `trainer` (the compiled train step's bytes per chip, scratch included:
    `fit.trainer_bytes`) plus the engine's declared bytes per chip on its mesh (`programs.engine_declared_bytes`:
    its weights' shards as placed there, replication included, and its KV cache) is at most `FIT_SHARE` of
    `hbm_bytes` (one chip's); all the hosts when none is. The engine's own scratch is left to the compiled
    report. On Qwen3-235B-A22B at v5p-128 it picks 8 hosts where arithmetic on the weights and cache alone
    (no scratch, no replication) had picked 2 (docs/tpu.md, section 7)."""
    hosts = fit.hosts(mesh)
    for k in (k for k in range(1, hosts + 1) if hosts % k == 0):
        try:
            emesh = programs.engine_mesh(mesh, k)
        except ValueError:
            continue
        own = fit.engine_owns_weights(shapes, emesh, mesh)
        if trainer + programs.engine_declared_bytes(shapes, emesh, own) <= FIT_SHARE * hbm_bytes:
            return k
    return hosts


def run_engine_hosts(cfg: RunConfig, model: ModelConfig, mesh: Any, hbm_bytes: int,
                     micro_batch_size: int | None = None) -> int:
    """Hosts per rollout engine for a run of `cfg` whose trainer's mesh is `mesh` (the run's own devices)
    and whose chips have `hbm_bytes` each, when `[jax] engine_hosts` is 0 on accelerators over several
    processes (`jaxrl.parallel.distributed.engine_hosts`): the train step compiled for `mesh` at full depth
    at the run's widest batch (`shapes_of`), then `compiled_engine_hosts` beside it. The same choice as
    `jaxrl compile` for that slice, so a seed TOML with `engine_hosts = 0` gets an engine group that fits.
    Costs one compile of the train step (the run compiles its own, at the batch's real width, later).
    `micro_batch_size`: the run's (`run_micro_batch`); None: `[jax] micro_batch_size`, else chosen here.

    Raises:
        programs.ProgramTooLarge: the compiler refused the train step (it needs more than a chip's HBM).
    """
    shapes = shapes_of(cfg, model)
    layers = model.num_layers
    micro = micro_batch_size or shapes.micro_batch_size
    if micro is None:
        chosen = micro_batch.compiled_micro_batch(shapes, mesh, hbm_bytes)
        micro, train = chosen.micro, chosen.train[layers]
    else:
        train = programs.compile_train(dataclasses.replace(shapes, micro_batch_size=micro), mesh)
    shapes = dataclasses.replace(shapes, micro_batch_size=micro)
    return compiled_engine_hosts(shapes, mesh, hbm_bytes, fit.trainer_bytes(fit.at_depth({layers: train}, (layers,),
                                                                                          layers)))


def run_micro_batch(cfg: RunConfig, model: ModelConfig, mesh: Any, hbm_bytes: int) -> int:
    """Sequences per micro-batch of a run of `cfg` on `mesh` (its own devices, `hbm_bytes` a chip):
    `[jax] micro_batch_size` when set, else `jaxrl.compile.micro_batch.compiled_micro_batch` at full depth beside
    the engine on `[jax] engine_hosts` (0: every host), the rule `jaxrl compile` applies (there at its depths)."""
    if cfg.jax.micro_batch_size:
        return cfg.jax.micro_batch_size
    return micro_batch.compiled_micro_batch(shapes_of(cfg, model), mesh, hbm_bytes,
                                           engine_hosts=cfg.jax.engine_hosts or None).micro


def startup_micro_batch(cfg: RunConfig, model: ModelConfig, mesh: Any, say: Any = print) -> int | None:
    """A starting run's sequences per micro-batch: `[jax] micro_batch_size`; else, where the devices report
    their memory (`jaxrl.parallel.distributed.chip_memory`: accelerators), `run_micro_batch`, saying so with
    `say` first; else None (`jaxrl.rl.train.default_micro_batch`).

    Raises:
        ConfigError: (key `jax.micro_batch_size`) the compiler refuses even one sequence per batch shard.
    """
    chip_bytes = distributed.chip_memory()
    if cfg.jax.micro_batch_size or chip_bytes is None:
        return cfg.jax.micro_batch_size
    say("micro_batch_size unset: compiling the train step to choose the largest micro-batch that fits "
        "(set [jax] micro_batch_size to skip this; jaxrl compile prints the value)")
    try:
        return run_micro_batch(cfg, model, mesh, chip_bytes)
    except programs.ProgramTooLarge as exc:
        raise ConfigError(cfg.source, [("jax.micro_batch_size", f"one sequence per batch shard does not fit: "
                                                                f"{exc}; `jaxrl compile` says more")]) from None


def longest_context(shapes: Shapes, mesh: Any, hbm_bytes: int, depths: tuple[int, ...]) -> Context:
    """`jaxrl.compile.context.compiled_context`: the longest sequences `shapes`' run trains on `mesh`, found
    by compiling the train step at about log2(model length / 1024) lengths per depth."""
    return compiled_context(shapes, mesh, hbm_bytes, depths)


def compile_report(model: ModelConfig, mesh_shape: dict[str, int], slice_: slices.Slice, shapes: Shapes,
                   depths: tuple[int, ...] | None = None, engine_hosts: int | None = None,
                   cost: bool = False, rollout_tokens: int | None = None, context: bool = False,
                   name: str = "the model") -> Report:
    """Compile the train step and the engine's programs (the largest prefill bucket and the decode program, or
    the ragged step of chunked prefill alone: `programs.engine_programs`) for `slice_` and report.

    Args:
        shapes: the run's sizes; its model is replaced by `model` at each compiled depth.
        depths: two reduced depths to compile and extrapolate from; None compiles at full depth. The smaller
            must leave every scan of layers but the last whole and the last at 2 trips or more
            (`jaxrl.compile.depths.smallest`: 2 for a Qwen3, 3 for INTELLECT-3).
        engine_hosts: hosts per rollout engine; None: `compiled_engine_hosts`, beside the train step (which
            is compiled first).
        cost: also compile the train step, the prefill and the decode step unrolled at `depths.cost_depths`
            for the compiler's per-layer FLOPs and bytes (`train_cost`, `engine_costs`; six more compiles).
        rollout_tokens: the mean length of the rollouts counted at once (`pool.PoolSize`; default seq_len / 2).
        context: also find the longest sequences the slice trains (`longest_context`; more compiles).
        name: the model's name, for errors.
    A `shapes.micro_batch_size` of None is chosen by compiling (`jaxrl.compile.micro_batch.compiled_micro_batch`).
    Raises:
        ProgramTooLarge: the compiler refused a program (it needs more than a chip's HBM).
        ValueError: `depths` are too shallow for the model's scans (`jaxrl.compile.depths.check`, before
            any compile), the mesh does not use every chip of the slice, or the engine's hosts do not
            divide the slice's.
        RuntimeError: libtpu is missing.
    """
    depth_rule.check(model, tuple(depths or ()), name)
    mesh = make_mesh(mesh_shape, slices.topology_devices(slice_))
    hosts = fit.hosts(mesh)
    shapes = dataclasses.replace(shapes, model=model)
    depths = tuple(depths or (model.num_layers,))
    t0 = time.perf_counter()
    shapes, micro_from, compiled, g = _compile_programs(shapes, mesh, slice_.chip.hbm_bytes, depths, engine_hosts)
    emesh = programs.engine_mesh(mesh, g)
    train, prefill, decode = (fit.at_depth(compiled[n], depths, model.num_layers)
                              for n in ("train", "prefill", "decode"))
    terms = fit.memory_terms(train, prefill, decode, fit.engine_owns_weights(shapes, emesh, mesh))
    auto = shapes.kv_cache_tokens is None  # the pool that fits, beside the decode step's scratch and slot state too
    if auto:  # (a pool's size leaves them as they are: the kernel reads its pages in place)
        shapes = pool.sized(shapes, emesh, FIT_SHARE * slice_.chip.hbm_bytes - sum(terms.values()) + terms["kv_cache"])
        terms["kv_cache"] = programs.engine_declared_bytes(shapes, emesh, own_weights=False)
    k = -(-shapes.batch_rows // shapes.micro_batch_size)
    # the tokens an expert group dispatches per micro-batch: a batch shard's, times the expert axis
    shards = math.prod(mesh.shape[a] for a in RULES["batch"])
    group = shapes.micro_batch_size * shapes.seq_len // shards * mesh.shape["expert"]
    chunked = model.is_moe and moe.chunk_count(group, model.num_experts_per_tok, moe.ASSIGNMENTS_PER_CHUNK) > 1
    train_s, decode_s = roofline(model, shapes, slice_.chip, mesh.devices.size, emesh.devices.size,
                                 terms["weights"], decode["declared_weights"], terms["kv_cache"], k, chunked)
    layer_cost = dataclasses.replace(train_cost(shapes, mesh), engine=engine_costs(shapes, emesh)) if cost else None
    free = int(FIT_SHARE * slice_.chip.hbm_bytes) - sum(terms.values()) + terms["kv_cache"]  # the cache's room
    kv = pool.of(shapes, emesh, hosts // g, free, rollout_tokens or shapes.seq_len // 2,
                 auto and shapes.kv_cache_tokens is not None)
    step = decode_bytes.of(decode, terms["kv_cache"], kv.bytes_per_token, _reads(shapes, emesh), shapes.decode_slots,
                           kv.mean_tokens, shapes.seq_len, programs.decode_steps(shapes, emesh))
    raw = {f"{n}@{d}": dataclasses.asdict(p) for n, ps in compiled.items() for d, p in sorted(ps.items())}
    full = {n: p for n, p in (("train", train), ("prefill", prefill), ("decode", decode)) if compiled[n]}
    return Report(slice_, hosts, dict(mesh.shape), g, dict(emesh.shape), shapes, depths, terms,
                  {**raw, **({f"{n}@{model.num_layers}": v for n, v in full.items()} if len(depths) > 1 else {})},
                  train_s, decode_s, time.perf_counter() - t0,
                  "set" if engine_hosts else "the fewest that fit beside the compiled train step", micro_from,
                  layer_cost, kv, longest_context(shapes, mesh, slice_.chip.hbm_bytes, depths) if context else None,
                  step, programs.engine_programs(shapes, emesh))


def _reads(shapes: Shapes, emesh: Any) -> str:
    """How `shapes`' engine on `emesh` reads its KV cache in a decode step (`decode_bytes.DecodeBytes.reads`)."""
    engine = programs.abstract_engine(shapes, emesh)[0]
    if engine.pages is None:
        return "dense"
    return "kernel" if isinstance(engine.kv, PagedPallas | RaggedPaged) else "gather"


def _compile_programs(shapes: Shapes, mesh: Any, hbm_bytes: int, depths: tuple[int, ...],
                      engine_hosts: int | None) -> tuple[Shapes, str, dict[str, dict[int, Program]], int]:
    """`compile_report`'s compiles: the train step at each of `depths` first (the micro-batch, when
    `shapes` has none, chosen by compiling beside the engine's prefill and decode step on `engine_hosts`,
    else on every host: `jaxrl.compile.micro_batch.compiled_micro_batch`), then, on the engine's hosts
    (`engine_hosts`, else `compiled_engine_hosts` beside the train step's compiled bytes), the largest
    prefill bucket and the decode step (with no `kv_cache_tokens`, over the paged pool that fits beside the
    train step and prefill: `pool.sized`; `compile_report` then sizes it beside the decode step too), or
    the search's own where its engine is on those hosts (its decode step then over the smallest pool: the
    step's scratch, slot state and outputs do not depend on the pool's size, and `compile_report` sizes it).
    Returns the shapes with their micro-batch, where that micro-batch came from ("set" or the rule), the
    programs by name ("train", "prefill", "decode") and depth, and the hosts per engine.

    Raises:
        ProgramTooLarge: the compiler refused a program, naming the depth and what to change.
    """
    compiled: dict[str, dict[int, Program]] = {"train": {}, "prefill": {}, "decode": {}}

    def run(name: str, depth: int, compile_one: Any) -> None:
        try:
            compiled[name][depth] = compile_one()
        except programs.ProgramTooLarge as exc:
            raise programs.ProgramTooLarge(f"does NOT fit at {depth} layers, the {exc}; try "
                                           f"{ADVICE['temporaries']}, or tensor > 1 (attention scores are split "
                                           f"by heads)") from None

    # The train step first: the engine group rule sets its compiled bytes, scratch included, beside the engine.
    micro_from, searched = "set", None
    if shapes.micro_batch_size is None:  # the largest that fits, by compiling
        searched = micro_batch.compiled_micro_batch(shapes, mesh, hbm_bytes, depths, engine_hosts)
        compiled["train"] = searched.train
        shapes = dataclasses.replace(shapes, micro_batch_size=searched.micro)
        micro_from = "the largest that fits (compiled)"
    for depth in (d for d in depths if d not in compiled["train"]):
        run("train", depth, lambda d=depth: programs.compile_train(shapes.at_depth(d), mesh))
    train = fit.at_depth(compiled["train"], depths, shapes.model.num_layers)
    g = engine_hosts or compiled_engine_hosts(shapes, mesh, hbm_bytes, fit.trainer_bytes(train))
    if searched is not None and searched.engine.hosts == g:
        compiled.update(prefill=searched.engine.prefill, decode=searched.engine.decode)
        return shapes, micro_from, compiled, g
    emesh = programs.engine_mesh(mesh, g)
    for depth in depths if programs.runs_prefill(shapes, emesh) else ():
        run("prefill", depth, lambda d=depth: programs.compile_prefill(shapes.at_depth(d), emesh))
    prefill = fit.at_depth(compiled["prefill"], depths, shapes.model.num_layers)
    own = programs.engine_weight_bytes(shapes, emesh) if fit.engine_owns_weights(shapes, emesh, mesh) else 0
    room = fit.FIT_SHARE * hbm_bytes - fit.trainer_bytes(train) - prefill["temp"] - prefill["output"] - own
    decoded = pool.sized(shapes, emesh, room) if shapes.kv_cache_tokens is None else shapes
    for depth in depths:
        run("decode", depth, lambda d=depth: programs.compile_decode(decoded.at_depth(d), emesh))
    return shapes, micro_from, compiled, g


def shapes_of(cfg: RunConfig, model: ModelConfig) -> Shapes:
    """The sizes a run of `cfg` compiles for: `batch_size` sequences of `[jax] seq_len` tokens (one sample
    per rollout, the widest batch), `[jax] micro_batch_size` (None: chosen by compiling,
    `jaxrl.compile.micro_batch.compiled_micro_batch`)."""
    j = cfg.jax
    return Shapes(model, jnp.bfloat16 if j.dtype == "bfloat16" else jnp.float32, j.lora_rank, tuple(j.lora_targets),
                  cfg.lora_alpha / j.lora_rank, j.remat, cfg.batch_size, j.seq_len, j.micro_batch_size,
                  j.decode_slots, full=j.finetune == "full", loss=loss_config(cfg), kv_cache_tokens=j.kv_cache_tokens,
                  teacher=teacher_model_of(cfg), decode_steps_per_dispatch=j.decode_steps_per_dispatch)


def compile_run(cfg: RunConfig, slice_name: str, depths: tuple[int, ...] | None = None,
                engine_hosts: int | None = None, cost: bool = False, context: bool = False) -> Report:
    """`compile_report` for a run config on the slice `slice_name` (`slices.parse_slice`), counting rollouts
    of `[sampling] max_tokens` (else half of `[jax] seq_len`) at once.

    Raises:
        ConfigError: the slice name, the mesh (its product must be the slice's chip count) or the model
            (see `model_of`) is wrong.
        ValueError: `depths` too shallow for the model's scans (`jaxrl.compile.depths.check`), naming the
            smallest valid pair; raised before anything compiles.
    """
    try:
        slice_ = slices.parse_slice(slice_name)
    except ValueError as exc:
        raise ConfigError(cfg.source, [("--topology", str(exc))]) from None
    model = model_of(cfg)
    shape = cfg.jax.mesh.model_dump()
    sizes = [shape[a] for a in MESH_AXES]
    if math.prod(sizes) == 1:
        shape = {"fsdp": slice_.chips}
    elif math.prod(sizes) != slice_.chips:
        raise ConfigError(cfg.source, [("jax.mesh", f"{shape} has {math.prod(sizes)} devices; {slice_.name} has "
                                                    f"{slice_.chips} chips")])
    # --engine-hosts, else the run's own `[jax] engine_hosts` (0: `compiled_engine_hosts`, as a run decides)
    return compile_report(model, shape, slice_, shapes_of(cfg, model), depths,
                          engine_hosts or cfg.jax.engine_hosts or None, cost, cfg.sampling.max_tokens, context,
                          cfg.model)
