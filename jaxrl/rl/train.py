"""The trainer: an optax optimizer over the trained weights, and the jitted RL train step.

LoRA (`[jax] finetune = "lora"`): the trained tree is `{"base": params, "lora": lora}`, the state of a
`jaxrl.model.modules.Model`. What trains is the nnx filter `modules.trained_filter`: the `LoRAParam`
variables. `optax.multi_transform` gives them AdamW (with global-norm clipping) and every other variable
`optax.set_to_zero()`, which keeps no state (`trainable_labels`); the step splits the module by the same
filter (`nnx.split`) and differentiates the LoRA state only, so base weights stay bit-identical.

Full fine-tuning (`finetune = "full"`): the trained tree is the base params themselves, float32 master
weights in `TrainState.base`, with AdamW (and its clipping) over every leaf; the optimizer moments are
born with the weights' shardings. The forward runs in the trainer's `dtype`; the KL reference is a
frozen copy of the starting weights, passed to the step where LoRA passes the base.

On-policy distillation (`[jax.loss] teacher_tau > 0`): the teacher's logprobs of the sampled tokens come
from a frozen model of its own config (`teacher_cfg`), run in the step on its weights (`step`'s `teacher`,
placed on the mesh by the student's rules) like the KL reference (`jaxrl.rl.scoring.frozen_logprobs`), or
from a server, in the batch (`Batch.teacher_logprobs`).

Gradient accumulation: with `micro_batch_size` m, a batch of B sequences is trained in k = ceil(B / m)
micro-batches of ceil(B / k) rows each, rounded up to a whole number of rows per batch shard (`micro_rows`;
the batch is padded with rows that hold no loss token, fewer than one per micro-batch and shard), and
the step scans over them inside one jitted program
(`accumulate`), so only one micro-batch's activations are live at a time. The loss and its metrics are
means over loss tokens, so micro-batch i is weighted by its share of the batch's loss tokens: the update
and the metrics equal one pass over the whole batch (up to float rounding).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.config.algorithms import LossConfig
from jaxrl.config.schema import RunConfig
from jaxrl.model import modules
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import array_sharding, batch_shards
from jaxrl.rl import cpu, losses
from jaxrl.rl.batch import Batch, loss_positions, loss_width, make_batch  # noqa: F401 - also imported from here
from jaxrl.rl.scoring import frozen_logprobs, sampled_logprobs

TOKENS_PER_SHARD = 4096  # micro-batch where no chip memory is known: tokens a batch shard trains per pass


def default_micro_batch(seq_len: int, batch_shards: int) -> int:
    """Sequences per micro-batch when `[jax] micro_batch_size` is unset and the devices report no memory
    (CPU; on accelerators a run compiles its train step to choose: `jaxrl.compile.report.run_micro_batch`):
    `TOKENS_PER_SHARD` tokens on each of the `batch_shards` devices the batch is split over (data x fsdp x
    expert), and at least one sequence per shard."""
    return batch_shards * max(1, TOKENS_PER_SHARD // seq_len)


def trainable_labels(params: Params) -> Params:
    """The optimizer's mask of a `{"base", "lora"}` tree: "lora" for the variables that
    `modules.trained_filter` selects in a LoRA run (the `LoRAParam`s), "frozen" for every other one."""
    trained = nnx.filterlib.to_predicate(modules.trained_filter(full=False))
    return jax.tree.map(lambda v: "lora" if trained((), v) else "frozen", modules.variables(params),
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(learning_rate: float, max_grad_norm: float = 1.0, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), *, full: bool = False) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019) with global-norm clipping: on the LoRA leaves of a
    `{"base", "lora"}` tree, base leaves frozen; or, with `full`, on every leaf of the tree it is given
    (the base params: full fine-tuning; weight decay then reaches the norms and embeddings too).
    Its state does not depend on the learning rate or schedule (a `Trainer` with a `learning_rate`
    schedule builds it at rate 1), so any run's checkpoint restores into any other's optimizer."""
    tx = optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(learning_rate, b1=betas[0], b2=betas[1], weight_decay=weight_decay))
    return tx if full else optax.multi_transform({"lora": tx, "frozen": optax.set_to_zero()}, trainable_labels)


def learning_rate(step: jax.Array | int, peak: float, schedule: str = "constant", warmup_steps: int = 0,
                  total_steps: int = 1) -> jax.Array:
    """The learning rate of optimizer step `step` (0-based, int32) of `total_steps`, float32.

    Warmup: step k < warmup_steps runs at `peak * (k + 1) / warmup_steps`, so the last warmup step
    reaches `peak`. After warmup, with
    `p = (k - warmup_steps) / (total_steps - warmup_steps)` in [0, 1): "constant" `peak`, "linear"
    `peak * (1 - p)`, "cosine" `peak * (1 + cos(pi * p)) / 2` (SGDR, Loshchilov & Hutter 2017). No
    step runs at rate 0.

    Raises:
        ValueError: an unknown `schedule`.
    """
    k = jnp.asarray(step, jnp.float32)
    p = jnp.clip((k - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
    match schedule:
        case "constant":
            decay = jnp.ones_like(p)
        case "linear":
            decay = 1.0 - p
        case "cosine":
            decay = 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        case _:
            raise ValueError(f"unknown learning-rate schedule {schedule!r}")
    warm = jnp.minimum((k + 1.0) / warmup_steps, 1.0) if warmup_steps else 1.0
    return (peak * warm * decay).astype(jnp.float32)


@struct.dataclass
class TrainState:
    """What training changes: the LoRA factors, the optimizer state, the number of optimizer steps taken
    (int32) and, in full fine-tuning only, the base weights.

    With LoRA, `opt_state` is over {"base", "lora"} (the frozen base has none) and the base weights live
    outside the state, shared with the rollout engine; `base` is None. In full fine-tuning `lora` is {}
    (no factors), `base` holds every weight (float32, the structure of `modules.param_specs`) and
    `opt_state` is AdamW's over it."""

    lora: Params
    opt_state: Any
    step: jax.Array
    base: Params | None = None

    @property
    def trained(self) -> Params:
        """The weights the optimizer updates: `base` in full fine-tuning, else `lora`."""
        return self.lora if self.base is None else self.base


@jax.jit
def _copy(x: jax.Array) -> jax.Array:
    return jnp.copy(x)  # a new buffer with `x`'s sharding (jit forwards a bare input unchanged)


def detached(tree: Any, donated: Any = None) -> Any:
    """`tree` with every leaf that is one of `donated`'s arrays (the same object; None: every leaf) replaced
    by a copy of it on the same devices, so it stays readable after `Trainer.step` donates `donated` (a
    `TrainState` part); other leaves (a cast, a copy onto another mesh) are kept as they are."""
    if donated is None:
        return jax.tree.map(_copy, tree)
    ids = {id(x) for x in jax.tree.leaves(donated)}
    return jax.tree.map(lambda x: _copy(x) if id(x) in ids else x, tree)


def loss_config(cfg: RunConfig) -> LossConfig:
    """The run's `[jax.loss]`, Dr.GRPO's `aggregation_length` defaulting to `[sampling] max_tokens`, else
    `[jax] seq_len`."""
    loss = cfg.jax.loss
    if loss.aggregation_length is None:
        loss = loss.model_copy(update={"aggregation_length": cfg.sampling.max_tokens or cfg.jax.seq_len})
    return loss


def trainer_for(cfg: RunConfig, mcfg: ModelConfig, mesh: Mesh, lora_scale: float,
                micro_batch_size: int | None = None, objective: Literal["rl", "sft"] = "rl",
                teacher_cfg: ModelConfig | None = None) -> Trainer:
    """The run's `Trainer`: `[jax.loss]` (`loss_config`), `[jax.optim]` and its schedule over `max_steps`
    from the top-level `learning_rate`. `micro_batch_size`: what the run chose by compiling
    (`jaxrl.compile.report.run_micro_batch`); None: `[jax] micro_batch_size`, else `default_micro_batch`.
    `objective`: `Trainer.objective`. `teacher_cfg`: an in-process teacher's architecture."""
    o, loss = cfg.jax.optim, loss_config(cfg)
    full = cfg.jax.finetune == "full"
    tx = make_optimizer(1.0, o.max_grad_norm, o.weight_decay, (o.beta1, o.beta2), full=full)
    schedule = functools.partial(learning_rate, peak=cfg.learning_rate, schedule=o.schedule,
                                 warmup_steps=o.warmup_steps, total_steps=cfg.max_steps)
    micro = micro_batch_size or cfg.jax.micro_batch_size or default_micro_batch(cfg.jax.seq_len, batch_shards(mesh))
    return Trainer(mcfg, mesh, tx, lora_scale, loss_cfg=loss, remat=cfg.jax.remat, micro_batch_size=micro,
                   learning_rate=schedule, objective=objective, full=full, teacher_cfg=teacher_cfg,
                   dtype=jnp.bfloat16 if cfg.jax.dtype == "bfloat16" else jnp.float32)


@dataclasses.dataclass
class Trainer:
    """Owns the jitted train step for one model, mesh and optimizer.

    `loss_cfg` is `[jax.loss]` (`jaxrl.rl.losses.policy_loss`); with `kl_coef > 0` each step also runs
    the reference policy: with LoRA the base model with the LoRA off, without a copy of its weights; in
    full fine-tuning (`full`) the frozen starting weights given to `step` as its `base`. `objective`
    "sft" trains supervised fine-tuning instead (`jaxrl.rl.sft`): the same step, optimizer and
    accumulation over the negative log-likelihood of the batch's loss tokens.
    `learning_rate`, when set, maps the optimizer step (int32) to its rate (`learning_rate` above): `tx`
    must then be built at rate 1, each update is scaled by it, and it is reported as `optim/lr`.
    `full`: train every base weight (`tx` from `make_optimizer(..., full=True)`), the forward in `dtype`.
    `tuning`: how the step runs its layer stack and output head (None: `jaxrl.rl.cpu.tuning`, from the
    mesh's platform; `cpu.Tuning.plain` forces what a TPU or GPU runs).
    `teacher_cfg`: the architecture of an in-process teacher (`loss_cfg.teacher_tau > 0`; its weights are
    `step`'s `teacher`, its tuning `jaxrl.rl.cpu.tuning` of its own config); None: no teacher, or a
    server's logprobs in the batch.
    """

    cfg: ModelConfig
    mesh: Mesh
    tx: optax.GradientTransformation
    lora_scale: float
    loss_cfg: LossConfig = dataclasses.field(default_factory=LossConfig)
    remat: bool = False
    micro_batch_size: int | None = None  # sequences per pass; None: the whole batch in one pass
    learning_rate: Callable[[jax.Array], jax.Array] | None = None
    objective: Literal["rl", "sft"] = "rl"  # "sft": supervised fine-tuning (`losses.sft_loss`), `loss_cfg` unused
    full: bool = False
    dtype: Any = jnp.float32  # full fine-tuning: what the float32 master weights are cast to for the forward
    tuning: cpu.Tuning | None = None
    unroll: bool = False  # layers unrolled whatever `tuning` says (`jaxrl compile`'s per-layer cost analysis)
    teacher_cfg: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.tuning is None:  # the platform's layer stack and head sizes
            self.tuning = cpu.tuning(self.mesh, self.cfg)
        self.teacher_tuning = None if self.teacher_cfg is None else cpu.tuning(self.mesh, self.teacher_cfg)
        # The state is donated: the new weights, LoRA and moments are written over the old ones. The caller
        # hands the engine a copy of them before the next step (`jaxrl.run.job.Job.engine_params`).
        self._step = jax.jit(self._step_impl, static_argnames=("micro_batches",), donate_argnames=("state",))

    def init_state(self, base: Params, lora: Params | None) -> TrainState:
        """A state at step 0 (arrays placed as they are; the optimizer moments take the weights'
        shardings). In full fine-tuning `base` is the trained weights (float32) and `lora` is ignored.
        The state holds copies of the weights it trains (`detached`): `step` donates them, and the
        caller's `lora` (or full fine-tuning's starting `base`, a KL reference) stays readable."""
        if self.full:
            base, lora = detached(base), {}
        else:
            lora = detached(lora)
        opt_state = self.tx.init(base if self.full else {"base": base, "lora": lora})
        replicated = NamedSharding(self.mesh, PartitionSpec())
        # Scalars (Adam's count, the step) are born on one device; put every leaf on the mesh so that a
        # restored state and a fresh one are placed alike.
        opt_state = jax.tree.map(
            lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated), opt_state)
        return TrainState(lora=lora, opt_state=opt_state, step=jax.device_put(jnp.zeros((), jnp.int32), replicated),
                          base=base if self.full else None)

    def micro_batches(self, rows: int) -> int:
        """How many micro-batches a batch of `rows` sequences is trained in (1 without `micro_batch_size`)."""
        return 1 if self.micro_batch_size is None else -(-rows // self.micro_batch_size)

    def micro_rows(self, rows: int) -> int:
        """Rows of each micro-batch of a batch of `rows` sequences: the batch spread evenly over its
        `micro_batches` (at most `micro_batch_size` each), rounded up to a multiple of the batch shards.
        Not `micro_batch_size` itself: 32 rows in micro-batches of at most 25 are two of 16, not two of 25
        (a third of the computation on padding rows)."""
        k, shards = self.micro_batches(rows), batch_shards(self.mesh)
        return -(-rows // (k * shards)) * shards

    def shard_batch(self, batch: Batch) -> dict[str, jax.Array]:
        """Place a host batch on the mesh, batch axis over (data, fsdp), after padding it with rows that
        hold no loss token to a whole number of micro-batches."""
        rows, k = batch.inputs.shape[0], self.micro_batches(batch.inputs.shape[0])
        pad = k * self.micro_rows(rows) - rows if k > 1 else 0
        out = {}
        for name, arr in dataclasses.asdict(batch).items():
            if arr is None:  # positions / segment ids of unpacked rows: built in the step
                continue
            if isinstance(arr, jax.Array) and not pad:  # already on the mesh (`distributed.global_batch`)
                out[name] = arr
                continue
            # padding rows: no loss token (their loss positions point past the row, as in `make_batch`)
            fill = arr.shape[1] if name == "loss_positions" else 0
            arr = np.pad(arr, [(0, pad)] + [(0, 0)] * (arr.ndim - 1), constant_values=fill)
            axes = ("batch",) + (None,) * (arr.ndim - 1)
            out[name] = jax.device_put(arr, array_sharding(axes, arr.shape, self.mesh))
        return out

    def step(self, state: TrainState, base: Params | None, batch: Batch,
             teacher: Params | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on `batch`. Metrics stay on device (read them late). `state` is donated: its
        arrays are deleted (the new state is written over them), so keep a copy of any that must be read
        later (the engine's weights, a checkpoint in flight). `base`: the frozen base weights with LoRA; in
        full fine-tuning the KL reference's weights (None without `kl_coef`), arrays other than the state's.
        `teacher`: an in-process teacher's weights (of `teacher_cfg`), not changed by the step.

        Raises:
            ValueError: full fine-tuning with `kl_coef > 0` and no reference weights; `teacher_tau > 0` with
                neither teacher weights (and `teacher_cfg`) nor `batch.teacher_logprobs`.
        """
        rl = self.objective == "rl"
        if self.full and base is None and self.loss_cfg.kl_coef > 0 and rl:
            raise ValueError("full fine-tuning with a KL penalty needs the reference weights as `base`")
        in_process = teacher is not None and self.teacher_cfg is not None
        if rl and self.loss_cfg.teacher_tau > 0 and not in_process and batch.teacher_logprobs is None:
            raise ValueError("teacher_tau > 0 needs the teacher's weights (with teacher_cfg) or "
                             "batch.teacher_logprobs")
        return self._step(state, base, self.shard_batch(batch), teacher if in_process else None,
                          micro_batches=self.micro_batches(batch.inputs.shape[0]))

    def loss(self, params: Params, batch: dict[str, jax.Array],
             reference: Params | None = None) -> tuple[jax.Array, dict]:
        """`model_loss` of the `Qwen3` module over `params` (`{"base", "lora"}`, lora None in full
        fine-tuning; `modules.bind`, no copies) and of `reference` (the KL reference's weights, or None)."""
        model = modules.bind(self.cfg, params["base"], params["lora"], self.lora_scale)
        return self.model_loss(model, batch, None if reference is None else modules.bind(self.cfg, reference))

    def model_loss(self, model: modules.Model, batch: dict[str, jax.Array], reference: modules.Model | None = None,
                   teacher: modules.Model | None = None) -> tuple[jax.Array, dict]:
        """The objective of one (micro-)batch under `model` and its metrics: `[jax.loss]`'s policy loss,
        or with `objective = "sft"` the token-mean negative log-likelihood of the loss tokens
        (`losses.sft_loss`). `reference`: the KL reference, run without LoRA; None: `model` with its LoRA
        off (the same base arrays). `teacher`: the in-process teacher (scored at temperature 1, as a
        server's prompt logprobs are); None: the batch's `teacher_logprobs`, when `teacher_tau > 0`."""
        b, t = batch["inputs"].shape
        positions = batch.get("positions", jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
        segments = batch.get("segment_ids")  # None: one sample per row
        scan = not self.unroll and self.tuning.scan_layers
        hidden, _ = model(batch["inputs"], positions, remat=self.remat, mesh=self.mesh, segment_ids=segments,
                          scan_layers=scan)
        sft = self.objective == "sft"
        logp, entropy = sampled_logprobs(model.weights()[0], hidden, batch["targets"], batch["loss_positions"],
                                         batch["temperature"], entropy_grad=not sft and self.loss_cfg.entropy_coef > 0,
                                         w_grad=self.full, **self._head_sizes())
        if sft:
            loss, metrics = losses.sft_loss(logp, batch["loss_mask"])
        else:
            ref_logp = teacher_logp = None
            if self.loss_cfg.kl_coef > 0:  # the reference policy: LoRA off, or the frozen starting weights
                ref = model if reference is None else reference
                ref_logp = frozen_logprobs(ref, batch, positions, batch["temperature"], self.tuning, mesh=self.mesh,
                                           scan_layers=scan)
            if self.loss_cfg.teacher_tau > 0:
                teacher_logp = batch.get("teacher_logprobs") if teacher is None else frozen_logprobs(
                    teacher, batch, positions, jnp.ones_like(batch["temperature"]), self.teacher_tuning,
                    mesh=self.mesh, scan_layers=not self.unroll and self.teacher_tuning.scan_layers)
            loss, metrics = losses.policy_loss(logp, batch["inference_logprobs"], batch["advantages"],
                                               batch["loss_mask"], self.loss_cfg, entropy_BT=entropy,
                                               ref_logp_BT=ref_logp, teacher_logp_BT=teacher_logp)
        entropy = jax.lax.stop_gradient(entropy)
        mask = batch["loss_mask"].astype(jnp.float32)
        metrics["policy/entropy"] = jnp.sum(entropy * mask) / jnp.maximum(mask.sum(), 1.0)
        return loss, metrics

    def _head_sizes(self) -> dict[str, int]:
        """`sampled_logprobs`' chunk and block on the trainer's mesh (`self.tuning`)."""
        return {"chunk": self.tuning.head_chunk, "block": self.tuning.head_block}

    def loss_weight(self, batch: dict[str, jax.Array]) -> jax.Array:
        """A micro-batch's weight in the accumulated loss (float32 scalar): its loss-token count with
        "token_mean" aggregation, its number of sequences with a loss token with "sequence_mean" and
        "sequence_sum" (means over sequences), so the accumulated loss is the one-pass loss. The metrics,
        token means, are weighted alike (exact with "token_mean", by sequence otherwise)."""
        mask = batch["loss_mask"].astype(jnp.float32)
        if self.objective == "sft" or self.loss_cfg.aggregation == "token_mean":
            return mask.sum()
        return (mask.sum(axis=1) > 0).astype(jnp.float32).sum()

    def _step_impl(self, state: TrainState, base: Params | None, batch: dict[str, jax.Array],
                   teacher: Params | None = None, micro_batches: int = 1):
        # The module over the state's weights, split by `modules.trained_filter` into what is
        # differentiated (the LoRA factors, or every weight in full fine-tuning) and the rest: only the
        # trained state is differentiated (see `_optimizer_update`).
        model = modules.bind(self.cfg, state.base if self.full else base, None if self.full else state.lora,
                             self.lora_scale)
        graphdef, trained, frozen = nnx.split(model, modules.trained_filter(self.full), ...)
        reference = None if not self.full or base is None else modules.bind(self.cfg, base)
        teacher_model = None if teacher is None else modules.bind(self.teacher_cfg, teacher)

        def objective(trained, b):
            if self.full:  # float32 master weights, cast for the forward; `base` is the KL reference
                trained = jax.tree.map(lambda w: w.astype(self.dtype), trained)
            return self.model_loss(nnx.merge(graphdef, trained, frozen), b, reference, teacher_model)

        loss_and_grad = jax.value_and_grad(objective, has_aux=True)
        if micro_batches == 1:
            (loss, metrics), grads = loss_and_grad(trained, batch)
        else:
            (loss, metrics), grads = accumulate(loss_and_grad, self.loss_weight, trained,
                                                split_micro_batches(batch, micro_batches, self.mesh))
        grads = nnx.to_pure_dict(grads)["base" if self.full else "lora"]
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = self._optimizer_update(state, base, grads)
        if self.learning_rate is not None:
            lr = self.learning_rate(state.step)
            updates = jax.tree.map(lambda u: u * lr, updates)
            metrics = {**metrics, "optim/lr": lr}
        trained = optax.apply_updates(state.trained, updates)
        # A non-finite loss or gradient skips the step: weights and optimizer state stay as they were.
        trained = jax.tree.map(lambda n, o: jnp.where(finite, n, o), trained, state.trained)
        opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), opt_state, state.opt_state)
        metrics = {**metrics, "loss": loss, "optim/grad_norm": grad_norm,
                   "optim/skipped": 1.0 - finite.astype(jnp.float32)}
        step = state.step + finite.astype(jnp.int32)
        if self.full:
            return TrainState({}, opt_state, step, base=trained), metrics
        return TrainState(trained, opt_state, step), metrics

    def _optimizer_update(self, state: TrainState, base: Params | None, grads: Params) -> tuple[Params, Any]:
        """The optimizer's updates of `state.trained` and its new state. With LoRA the optimizer sees the
        `{"base", "lora"}` tree: XLA does not prune the base gradients of a full-tree grad (measured: a
        third of the step on the tiny model), so only the LoRA is differentiated, and zeros, which the
        frozen branch never reads (and XLA prunes), stand in for the base's gradients."""
        if self.full:
            return self.tx.update(grads, state.opt_state, state.base)
        updates, opt_state = self.tx.update({"base": jax.tree.map(jnp.zeros_like, base), "lora": grads},
                                            state.opt_state, {"base": base, "lora": state.lora})
        return updates["lora"], opt_state


def split_micro_batches(batch: dict[str, jax.Array], k: int, mesh: Mesh) -> dict[str, jax.Array]:
    """Each [B, ...] array as [k, B / k, ...]: micro-batch i takes rows i, i + k, i + 2k, ..., so that each
    micro-batch is spread over the batch shards as the whole batch is (rows are sharded in contiguous
    blocks): when B / k is a multiple of the shard count, no row moves between chips."""

    def one(x):
        x = jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)
        axes = (None, "batch") + (None,) * (x.ndim - 2)
        return jax.lax.with_sharding_constraint(x, array_sharding(axes, x.shape, mesh))

    return jax.tree.map(one, batch)


def accumulate(loss_and_grad: Any, weight: Any, trained: Params,
               micro_kB: dict[str, jax.Array]) -> tuple[tuple[jax.Array, dict], Params]:
    """`((loss, metrics), grads)` of the whole batch from its micro-batches, one at a time (`jax.lax.scan`).

    Args:
        loss_and_grad: `(trained, micro_batch) -> ((loss, metrics), grads)`, each a mean over the micro-batch.
        weight: `micro_batch -> float32 scalar`, how much of the whole batch's mean a micro-batch holds
            (its loss-token count); micro-batch i counts `weight_i / sum(weight)` (0 for every one when
            the sum is 0, as the one-pass mean of no tokens is).
        trained: the differentiated weights (the LoRA, or every weight in full fine-tuning).
        micro_kB: the batch as [k, B / k, ...] arrays (`split_micro_batches`).
    """
    weights_k = jax.vmap(weight)(micro_kB)
    shares_k = weights_k / jnp.maximum(weights_k.sum(), 1.0)
    first = jax.tree.map(lambda x: x[0], micro_kB)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(loss_and_grad, trained, first))

    def body(total, xs):
        micro, share = xs
        out = loss_and_grad(trained, micro)
        return jax.tree.map(lambda t, o: t + share.astype(o.dtype) * o, total, out), None

    total, _ = jax.lax.scan(body, zeros, (micro_kB, shares_k))
    return total
