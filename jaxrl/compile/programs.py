"""A run's programs lowered and compiled with abstract arguments (no weights, no TPU): the train step,
a prefill bucket and the decode program, each on its mesh; per-chip memory from the compiler.

Every argument is a `jax.ShapeDtypeStruct` carrying the `NamedSharding` the run would give it (the
logical-axis rules of `jaxrl.parallel.sharding`), so the compiled programs are the run's own:
`Trainer._step`, `Engine._prefill_forward` then `_prefill_sample`, and `Engine._generate_steps`, lowered with
`.lower(...)` and compiled by the backend of the mesh's devices (libtpu for a TPU topology). An engine that
runs chunked prefill (TPU's ragged pool, `jaxrl.inference.chunked.chunked_prefill`) runs no prefill bucket
(`runs_prefill` is False) and its decode program is the loop of ragged steps (`RaggedSteps._steps`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.config.algorithms import LossConfig
from jaxrl.inference.chunked import PREFILL_CHUNK, RaggedSteps, chunked_prefill
from jaxrl.inference.decode_state import DecodeState
from jaxrl.inference.engine import Engine
from jaxrl.inference.engine_params import EngineParams
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.sampling import SlotSampling
from jaxrl.inference.steps import pin_for
from jaxrl.kv.dense import Dense
from jaxrl.kv.ragged import pack
from jaxrl.model.config import ModelConfig
from jaxrl.model.modules import lora_specs, param_specs
from jaxrl.parallel.sharding import MESH_AXES, array_sharding, mesh_platform, spec_shardings
from jaxrl.parallel.spec import is_spec
from jaxrl.rl.train import Batch, Trainer, TrainState, loss_width, make_optimizer


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the programs are compiled for: the model at some depth, dtypes and the run's sizes."""

    model: ModelConfig
    dtype: Any  # base weights (and activations)
    lora_rank: int
    lora_targets: tuple[str, ...]
    lora_scale: float
    remat: bool
    batch_rows: int  # sequences per train step
    seq_len: int
    micro_batch_size: int | None  # None: the largest that fits, found by compiling (`micro_batch.compiled_micro_batch`)
    decode_slots: int
    full: bool = False  # `[jax] finetune = "full"`: every weight trains (float32 master weights, AdamW over them)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)  # `[jax.loss]`: kl_coef > 0 runs a reference
    unroll: bool = False  # the train step's layers unrolled, not scanned: `cost_analysis()` then counts each
    kv_cache_tokens: int | None = None  # `[jax] kv_cache_tokens`: the engine's paged pool; None, the dense cache
    teacher: ModelConfig | None = None  # `[jax.teacher] model` (teacher_tau > 0): a frozen model run in the step
    decode_steps_per_dispatch: int | None = None  # `[jax] decode_steps_per_dispatch`; None: the engine's default

    @property
    def kl_copy(self) -> bool:
        """Whether the run holds a frozen copy of the starting weights as its KL reference: full fine-tuning
        with `kl_coef > 0` (with LoRA the reference is the base with the LoRA off: no copy)."""
        return self.full and self.loss.kl_coef > 0

    def at_depth(self, layers: int) -> Shapes:
        return dataclasses.replace(self, model=dataclasses.replace(self.model, num_layers=layers))


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program, per chip: the compiler's argument / output / aliased / temporary bytes,
    the bytes of each argument group computed from the declared shapes and their shardings
    (`declared`), the compile time in seconds, and the compiler's `cost_analysis()`: FLOPs and bytes
    accessed (a loop's body counted once, whatever its trip count)."""

    name: str
    argument: int
    output: int
    alias: int
    temp: int
    declared: dict[str, int]
    compile_s: float
    flops: float = 0.0
    bytes_accessed: float = 0.0


def _itemsize(dtype: Any) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 8  # threefry: two uint32 words
    return np.dtype(dtype).itemsize


def shard_bytes(tree: Any) -> int:
    """Bytes of one chip's shards of every leaf (ShapeDtypeStruct; unsharded leaves count whole)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * _itemsize(x.dtype)
    return total


def abstract_params(specs: Any, dims: dict[str, int], mesh: Mesh, dtype: Any) -> Any:
    """ShapeDtypeStructs with the run's NamedShardings for a pytree of `ParamSpec`."""
    shardings = spec_shardings(specs, dims, mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape(dims), dtype, sharding=sh), specs, shardings,
                        is_leaf=is_spec)


def abstract_weights(s: Shapes, mesh: Mesh, dtype: Any = None) -> tuple[Any, Any]:
    """The base weights (in `dtype`, default `s.dtype`) and the LoRA (None in full fine-tuning)."""
    m = s.model
    base = abstract_params(param_specs(m), m.dims(), mesh, s.dtype if dtype is None else dtype)
    if s.full:
        return base, None
    lora = abstract_params(lora_specs(m, s.lora_rank, s.lora_targets), {**m.dims(), "R": s.lora_rank}, mesh,
                           jnp.float32)
    return base, lora


def _placed(tree: Any, sharding: Any) -> Any:
    """`tree`'s ShapeDtypeStructs with `sharding(leaf)` as their sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x)), tree)


class ProgramTooLarge(ValueError):
    """The compiler refused a program: it needs more memory than one chip's HBM."""


def measure(name: str, lowered: Any, declared: dict[str, int]) -> Program:
    """Compile `lowered` and read its per-chip memory.

    Raises:
        ProgramTooLarge: the compiler ran out of HBM (its message says which buffers and how much).
    """
    return _program(name, *_compile(name, lowered), declared)


def _compile(name: str, lowered: Any) -> tuple[Any, float]:
    """`lowered` compiled, and the seconds it took (`measure`'s errors)."""
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as exc:
        if "RESOURCE_EXHAUSTED" not in str(exc):
            raise
        raise ProgramTooLarge(f"{name}: {str(exc).splitlines()[0]}") from None
    return compiled, time.perf_counter() - t0


def _program(name: str, compiled: Any, seconds: float, declared: dict[str, int]) -> Program:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    return Program(name, int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                   int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes), declared, seconds,
                   float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)))


def _dict_keys(path: tuple) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _optimizer_state(trainer: Trainer, base: Any, lora: Any, replicated: NamedSharding) -> Any:
    """`tx.init`'s state as ShapeDtypeStructs, placed as the run places it: each moment like the LoRA leaf
    (or, in full fine-tuning, `lora` None, the weight) it follows (`zeros_like`), scalars (Adam's count)
    replicated (`Trainer.init_state`)."""
    trained, prefix = (base, ()) if lora is None else (lora, ("lora",))
    by_path = {(*prefix, *_dict_keys(p)): x.sharding for p, x in jax.tree_util.tree_leaves_with_path(trained)}

    def place(path, x):
        keys = _dict_keys(path)
        sharding = next((by_path[keys[i:]] for i in range(len(keys)) if keys[i:] in by_path), None)
        if x.ndim and sharding is None:
            raise ValueError(f"optimizer state leaf {jax.tree_util.keystr(path)} follows no trained leaf")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if x.ndim else replicated)

    tree = base if lora is None else {"base": base, "lora": lora}
    return jax.tree_util.tree_map_with_path(place, jax.eval_shape(trainer.tx.init, tree))


def compile_train(s: Shapes, mesh: Mesh) -> Program:
    """`Trainer._step` at `s`'s shapes on `mesh`: a batch of `batch_rows` rows of `seq_len` positions (the
    widest a run trains, `make_batch`), in micro-batches of `micro_batch_size`, with the run's `[jax.loss]`.
    In full fine-tuning the weights are the float32 master weights (declared as `weights`), and with
    `kl_coef > 0` the step also takes the KL reference, the starting weights in `dtype` on the trainer's
    mesh as the run keeps them (`Run.init_training`; declared as `reference`), and with an in-process teacher
    (`s.teacher`) the teacher's weights in `dtype`, at its own full depth (declared as `teacher`: the same at
    every depth the student is compiled at, so the depth fit keeps it as it is)."""
    if s.micro_batch_size is None:
        raise ValueError("compile_train needs a micro_batch_size (micro_batch.compiled_micro_batch chooses one)")
    trainer = Trainer(s.model, mesh, make_optimizer(1e-5, full=s.full), lora_scale=s.lora_scale, loss_cfg=s.loss,
                      remat=s.remat, micro_batch_size=s.micro_batch_size, full=s.full, dtype=s.dtype,
                      unroll=s.unroll, teacher_cfg=s.teacher)
    base, lora = abstract_weights(s, mesh, jnp.float32 if s.full else None)
    reference = abstract_weights(s, mesh)[0] if s.kl_copy else None
    # an in-process teacher: its own weights in `dtype`, at its full depth whatever depth the student compiles at
    teacher = None if s.teacher is None else abstract_params(param_specs(s.teacher), s.teacher.dims(), mesh, s.dtype)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt = _optimizer_state(trainer, base, lora, replicated)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    state = TrainState({}, opt, step, base=base) if s.full else TrainState(lora, opt, step)
    k = trainer.micro_batches(s.batch_rows)
    rows, t = (k * trainer.micro_rows(s.batch_rows) if k > 1 else s.batch_rows), s.seq_len
    # every row a whole sequence of loss tokens: the widest batch `make_batch` can build
    fields = {"inputs": ((rows, t), jnp.int32), "targets": ((rows, t), jnp.int32), "loss_mask": ((rows, t), bool),
              "inference_logprobs": ((rows, t), jnp.float32), "advantages": ((rows,), jnp.float32),
              "temperature": ((rows,), jnp.float32), "loss_positions": ((rows, min(loss_width(t), t)), jnp.int32)}
    # an RL batch: one sample per row, no packed positions or segment ids (the fields that default to None)
    missing = {f.name for f in dataclasses.fields(Batch) if f.default is dataclasses.MISSING} ^ fields.keys()
    if missing:
        raise ValueError(f"compile_train does not build the train batch fields {sorted(missing)}")
    batch = {n: jax.ShapeDtypeStruct(shape, dt, sharding=array_sharding(("batch",) + (None,) * (len(shape) - 1),
                                                                        shape, mesh))
             for n, (shape, dt) in fields.items()}
    lowered = trainer._step.lower(state, reference if s.full else base, batch, teacher, micro_batches=k)
    declared = {"weights": shard_bytes(base), "lora": shard_bytes(lora), "optimizer": shard_bytes((opt, state.step)),
                "batch": shard_bytes(batch), "reference": shard_bytes(reference), "teacher": shard_bytes(teacher)}
    return measure("train" + (" unrolled" if s.unroll else ""), lowered, declared)


def abstract_engine(s: Shapes, mesh: Mesh, dense: bool = False) -> tuple[Engine, EngineParams]:
    """The engine of `s` on `mesh` (`dense`: with the dense cache, `jaxrl.kv.dense.Dense`, whatever the
    platform) and its abstract params."""
    kv = Dense(s.model, s.decode_slots, s.seq_len) if dense else None
    steps = {} if s.decode_steps_per_dispatch is None else {"decode_steps_per_dispatch": s.decode_steps_per_dispatch}
    engine = Engine(s.model, mesh, s.decode_slots, s.seq_len, lora_scale=s.lora_scale, cache_dtype=s.dtype,
                    kv=kv, kv_cache_tokens=s.kv_cache_tokens, **steps)
    base, lora = abstract_weights(s, mesh)
    return engine, EngineParams(base=base, lora=lora)


def runs_prefill(s: Shapes, mesh: Mesh) -> bool:
    """Whether a run of `s` whose engine is on `mesh` runs prefill buckets (`compile_prefill`): not where it
    feeds prompts through its ragged step (`jaxrl.inference.chunked.chunked_prefill`)."""
    return not chunked_prefill(abstract_engine(s, mesh)[0])


def decode_steps(s: Shapes, mesh: Mesh) -> int:
    """Decode steps in one of the decode programs (`lower_decode`) of a run of `s` whose engine is on `mesh`:
    the engine's `decode_steps_per_dispatch`."""
    return abstract_engine(s, mesh)[0].decode_steps_per_dispatch


def engine_programs(s: Shapes, mesh: Mesh) -> str:
    """The programs a run of `s` whose engine is on `mesh` runs for its rollouts, as `jaxrl compile` names
    them (the ones it compiles: `runs_prefill`, `lower_decode`)."""
    engine = abstract_engine(s, mesh)[0]
    if chunked_prefill(engine):
        return (f"the ragged step of chunked prefill ({RaggedSteps(engine, s.decode_slots + PREFILL_CHUNK).tokens} "
                f"tokens a step: the {s.decode_slots} slots' and prompt chunks) and the decode program of "
                f"{engine.decode_steps_per_dispatch} of those steps, no prefill bucket")
    return (f"the largest prefill bucket ({engine.buckets[-1]} tokens) and the decode program of "
            f"{engine.decode_steps_per_dispatch} steps")


def compile_prefill(s: Shapes, mesh: Mesh, bucket: int | None = None) -> Program:
    """What a run's prefill of one prompt bucket (default the largest, `seq_len - 1` tokens) runs on `mesh`
    (`Engine.prefill_shared`): `Engine._prefill_forward`, the prompt through the model to its cache and
    last logits [1, V] float32, then `Engine._prefill_sample` on those logits, placed as the first program
    leaves them (truncating sampling: the larger variant). Compiled each and reported as one program, as
    they run one after the other: their arguments, outputs and aliases add up (the logits are the first's
    output and the second's argument, declared as `logits`), their temporaries do not (one program's
    scratch at a time: the larger)."""
    engine, params = abstract_engine(s, mesh)
    bucket = bucket or engine.buckets[-1]
    replicated = NamedSharding(mesh, PartitionSpec())
    tokens = jax.ShapeDtypeStruct((bucket,), jnp.int32, sharding=replicated)
    length = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    name = f"prefill {bucket}"
    compiled, forward_s = _compile(name, engine._prefill_forward.lower(params, tokens, length))
    forward = _program(name, compiled, forward_s, {})
    logits = jax.eval_shape(engine._prefill_forward, params, tokens, length)[1]
    logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=compiled.output_shardings[1])
    sampling, key = _placed(jax.eval_shape(lambda: (SlotSampling.of(SamplingParams()), jax.random.key(0))),
                            lambda x: replicated)
    stop = jax.ShapeDtypeStruct((s.model.vocab_size,), jnp.bool_, sharding=replicated)
    sample = measure(name, engine._prefill_sample.lower(logits, tokens, length, sampling, key, stop, truncate=True),
                      {})
    declared = {"weights": shard_bytes(params.base), "lora": shard_bytes(params.lora),
                "logits": shard_bytes(logits)}
    return Program(name, forward.argument + sample.argument, forward.output + sample.output,
                   forward.alias + sample.alias, max(forward.temp, sample.temp), declared,
                   forward.compile_s + sample.compile_s)


def abstract_decode_state(engine: Engine) -> DecodeState:
    """The decode state `Engine.init_decode_state` makes, as ShapeDtypeStructs: the cache its kind declares
    (`jaxrl.kv.kind.CacheKind.cache`, placed by the same logical axes: on an accelerator one buffer
    [L, B, S, K, H] per k and v, or a paged pool [K, L, P, page, H] per k and v and its page table), every
    per-slot array split over the slots' batch axis as the cache is."""
    c, b = engine.cfg, engine.max_concurrent_decodes
    cache = engine.kv.cache(lambda shape, axes, dtype=None: jax.ShapeDtypeStruct(
        shape, dtype or engine.cache_dtype, sharding=array_sharding(axes, shape, engine.mesh)))
    vec_sh = array_sharding(("batch",), (b,), engine.mesh)
    slot_vocab_sh = array_sharding(("batch", None), (b, c.vocab_size), engine.mesh)
    per_slot = _placed(jax.eval_shape(lambda: (SlotSampling.neutral(b), jax.random.split(jax.random.key(0), b))),
                       lambda x: vec_sh)
    return DecodeState(
        cache=cache,
        tokens=jax.ShapeDtypeStruct((b,), jnp.int32, sharding=vec_sh),
        positions=jax.ShapeDtypeStruct((b,), jnp.int32, sharding=vec_sh),
        sampling=per_slot[0],
        keys=per_slot[1],
        seen=jax.ShapeDtypeStruct((b, c.vocab_size), jnp.bool_, sharding=slot_vocab_sh),
        stop=jax.ShapeDtypeStruct((b, c.vocab_size), jnp.bool_, sharding=slot_vocab_sh),
        generated=jax.ShapeDtypeStruct((b,), jnp.int32, sharding=vec_sh),
    )


def lower_decode(engine: Engine, params: EngineParams, state: DecodeState) -> Any:
    """`Engine._generate_steps` lowered for `state` (`abstract_decode_state`): the engine's
    `decode_steps_per_dispatch` decode steps in one program (`Engine.generate_steps`), truncating sampling and
    the repetition penalty on (the largest variant). Where its scheduler runs chunked prefill (a ragged pool,
    TPU's: `chunked_prefill`) the program it decodes with instead (`_ragged_steps`)."""
    if chunked_prefill(engine):
        return _ragged_steps(engine, params, state)
    budget = jax.ShapeDtypeStruct((engine.max_concurrent_decodes,), jnp.int32,
                                  sharding=NamedSharding(engine.mesh, PartitionSpec()))
    return engine._generate_steps.lower(params, state, budget, steps=engine.decode_steps_per_dispatch, truncate=True,
                                        penalize=True, pin=pin_for(params, engine.mesh))


def _ragged_steps(engine: Engine, params: EngineParams, state: DecodeState) -> Any:
    """The decode program of chunked prefill (`jaxrl.inference.chunked`: ragged steps of the slots and
    `PREFILL_CHUNK` more flat tokens) lowered with `state`: `RaggedSteps._steps`, the engine's
    `decode_steps_per_dispatch` steps in one loop (what runs while no prompt is fed), or where that is 1
    `RaggedSteps._step` (every dispatch); their `Ragged` placement, tokens, the slots' last tokens, flags and
    budgets replicated; truncating sampling, the repetition penalty and the `min_tokens` ban on. A dispatch that
    feeds a prompt runs `_step`, the loop's body alone."""
    steps = RaggedSteps(engine, engine.max_concurrent_decodes + PREFILL_CHUNK)
    m, b, k = steps.tokens, engine.max_concurrent_decodes, engine.decode_steps_per_dispatch
    replicated = NamedSharding(engine.mesh, PartitionSpec())
    batch = _placed(jax.eval_shape(lambda: pack([], m, b)), lambda x: replicated)
    tokens, last, emit, budget = _placed(jax.eval_shape(lambda: (
        jnp.zeros((m,), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.bool_),
        jnp.zeros((b,), jnp.int32))), lambda x: replicated)
    flags = {"truncate": True, "penalize": True, "ban": True, "top": 0}
    if k == 1:
        return steps._step.lower(params, state, tokens, batch, last, emit, **flags)
    return steps._steps.lower(params, state, batch, last, budget, steps=k, pin=pin_for(params, engine.mesh), **flags)


def compile_decode(s: Shapes, mesh: Mesh) -> Program:
    """The decode program (`lower_decode`) for `decode_slots` slots of `seq_len` tokens on `mesh`."""
    engine, params = abstract_engine(s, mesh)
    if not engine.weights.reads_training_weights:  # the CPU's: weight copies made from real arrays
        raise ValueError(f"decode is compiled for an accelerator mesh, not {mesh_platform(mesh)}")
    state = abstract_decode_state(engine)
    declared = {"weights": shard_bytes(params.base), "lora": shard_bytes(params.lora),
                "kv_cache": shard_bytes(state.cache), "slots": shard_bytes(dataclasses.replace(state, cache={}))}
    return measure("decode", lower_decode(engine, params, state), declared)


def engine_declared_bytes(s: Shapes, mesh: Mesh, own_weights: bool) -> int:
    """Per chip, what a rollout engine on `mesh` holds by its declared shapes and shardings (nothing is
    compiled): its KV cache, and with `own_weights` its copy of the base weights and LoRA (an engine on
    fewer hosts than the trainer; one on all of them reads the trainer's). The decode step's scratch is
    not in it. With no `kv_cache_tokens` the pool is sized to what is left once the rules that read this
    have chosen (`jaxrl.compile.pool.sized`): it counts here as the dense cache of `decode_slots` x
    `seq_len` as the mesh shards it (slots over the batch axes, which a pool's pages cannot be), what these
    rules reserved before the pool was the default."""
    engine, params = abstract_engine(s, mesh, dense=s.kv_cache_tokens is None)
    weights = shard_bytes(params.base) + shard_bytes(params.lora) if own_weights else 0
    return weights + shard_bytes(abstract_decode_state(engine).cache)


def engine_weight_bytes(s: Shapes, mesh: Mesh) -> int:
    """Per chip, the base weights and LoRA of an engine of `s` on `mesh` by their declared shapes and shardings
    (what a prefill or decode program declares as `weights` and `lora`)."""
    params = abstract_engine(s, mesh)[1]
    return shard_bytes(params.base) + shard_bytes(params.lora)


def engine_mesh(mesh: Mesh, hosts: int) -> Mesh:
    """The mesh of an engine on the first `hosts` hosts of `mesh` (the whole mesh when `hosts` is all of
    them): their devices, with the mesh's leading axes (data, then fsdp, expert, tensor) shrunk by
    `process count / hosts`, as the hosts are laid out along them.

    Raises:
        ValueError: `hosts` does not divide the process count, or the axes cannot be shrunk by that factor.
    """
    processes = sorted({d.process_index for d in mesh.devices.flat})
    if len(processes) % hosts:
        raise ValueError(f"an engine of {hosts} hosts does not divide the slice's {len(processes)} hosts")
    factor = len(processes) // hosts
    sizes = dict(mesh.shape)
    for axis in ("data", "fsdp", "expert", "tensor"):
        g = math.gcd(sizes[axis], factor)
        sizes[axis] //= g
        factor //= g
    if factor != 1:
        raise ValueError(f"mesh {dict(mesh.shape)} cannot be split into engines of {hosts} hosts")
    devices = [d for d in mesh.devices.flat if d.process_index in processes[:hosts]]
    return Mesh(np.array(devices).reshape([sizes[a] for a in MESH_AXES]), MESH_AXES)
