"""The `[jax]` table and its `[jax.mesh]`: everything a local JAX run needs that the Hosted Training schema
does not have (`jaxrl.config.schema.RunConfig.jax`). Its training sub-tables are in `jaxrl.config.algorithms`,
`jaxrl.config.teacher` and `jaxrl.config.sft`."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from jaxrl.config.algorithms import AdvantageConfig, LossConfig, OptimConfig
from jaxrl.config.base import PathStr, Table
from jaxrl.config.sft import SftConfig
from jaxrl.config.teacher import TeacherConfig

LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[str, ...] = get_args(LoraTarget)


class MeshConfig(Table):
    """`[jax.mesh]`: device mesh shape; the product of the axes must equal the device count."""

    data: int = Field(1, ge=1)
    """Data-parallel axis size. Default 1."""
    fsdp: int = Field(1, ge=1)
    """Fully-sharded data-parallel axis size (params sharded, batch split). Default 1."""
    tensor: int = Field(1, ge=1)
    """Tensor-parallel axis size (heads and MLP sharded). Default 1."""
    expert: int = Field(1, ge=1)
    """Expert-parallel axis size (MoE experts sharded). Default 1."""


class JaxConfig(Table):
    """`[jax]`: everything a local JAX run needs that the Hosted Training schema does not have."""

    model_path: PathStr | None = None
    """Local Hugging Face checkpoint folder (relative to the config file), `gs://` URL, or Hugging Face id.
    Default None: `model`, found as such a folder or URL, else in the local Hugging Face cache, else
    downloaded from the Hub (`jaxrl.config.model_path`)."""
    model_revision: str | None = Field(None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,254}$")
    """Branch, tag or commit hash of a Hugging Face id to download (as `owner/name@revision`, which wins
    when the name has one). Default None: "main"."""
    tokenizer_path: PathStr | None = None
    """Tokenizer folder (relative to the config file). Default None: the model folder."""
    mesh: MeshConfig = MeshConfig()
    """Device mesh shape. Default all axes 1."""
    seq_len: int = Field(4096, ge=2)
    """Max tokens of one trajectory (prompt plus completions), the KV cache and training length.
    Default 4096, above the 2048 `max_tokens` of the Hosted Training examples."""
    finetune: Literal["lora", "full"] = "lora"
    """What trains. "lora": LoRA adapters on `lora_targets` (Hu et al. 2021); the base weights stay frozen,
    one copy shared by the trainer, the rollout engine and the KL reference (LoRA off). "full": every base
    weight (full fine-tuning), as float32 master weights with AdamW state sharded like them; the forward
    computes in `dtype`, the engine gets the new weights (in `dtype`) after each step, the KL reference
    (`[jax.loss] kl_coef > 0` only) is a frozen copy of the starting weights, checkpoints hold the
    weights, and `jaxrl export` writes the whole model. With "full", `lora_rank`, `lora_targets`,
    `lora_alpha` and `[adapters]` (PEFT adapters of a LoRA) set away from their defaults are errors. The
    seeds advise learning rates of 1e-6 to 1e-5 for full fine-tuning, 1e-5 to 1e-4 for LoRA. Default
    "lora"."""
    lora_rank: int = Field(16, ge=1)
    """LoRA rank r; the update is scaled by `lora_alpha / lora_rank`. Default 16."""
    lora_targets: list[LoraTarget] = Field(list(LORA_TARGETS), min_length=1)
    """Hugging Face projection names that get LoRA adapters. Default: all seven attention and MLP ones."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the base weights (frozen with LoRA; the engine's copy with `finetune = "full"`) and of the
    activations; LoRA factors, full fine-tuning's master weights and optimizer state stay float32.
    Default "float32"."""
    output_dir: PathStr = "runs"
    """Local folder (relative to the working directory) of each run's metrics and, unless
    `checkpoint_dir` is set, checkpoints: `<output_dir>/<name>/`. Default "runs"."""
    checkpoint_dir: PathStr | None = None
    """Folder or `gs://bucket/path` URL for checkpoints: `<checkpoint_dir>/<name>/<step>`. Default None:
    `<output_dir>/<name>/checkpoints`."""
    rollout_timeout: float = Field(600.0, gt=0)
    """Seconds one rollout (its model calls, environment and reward) may take; a slower one is dropped
    and counted as failed. Default 600."""
    seed: int = Field(0, ge=0)
    """Seed of LoRA initialisation and sampling, >= 0; with `rollouts_per_example`, the run's rollout seeds
    `(seed * 1000003 + group) * rollouts_per_example + i` must fit in 63 bits. Default 0."""
    decode_slots: int = Field(32, ge=1)
    """Max concurrent decodes (KV cache rows) in the rollout engine. Default 32."""
    kv_cache_tokens: int | None = Field(None, ge=1)
    """Positions (tokens) of the rollout engine's paged KV cache (`jaxrl.kv.paged`), per engine: a pool
    of pages of 16 positions handed to the sequences as their tokens arrive and returned when they finish, a
    group's rollouts sharing their prompt's pages; must be >= `seq_len` (one sequence fits), rounded up to
    whole pages. Set, the engine runs a pool of that size on every platform (on CPU instead of its chunked
    dense cache). Default None: on TPU and GPU the paged pool that fits beside the rest of the run, at most
    `decode_slots` x `seq_len` (more is never used): at startup the run reads the chip's memory and what its
    weights and train state hold (`memory_stats()`) and compiles its train step, prefill and decode step to
    learn their scratch (`jaxrl.compile.run_pool`), as `jaxrl compile` does for a slice (it prints the value,
    `kv_pool_tokens`; setting it skips those compiles); on CPU the dense cache of `decode_slots` x `seq_len`
    positions (faster there)."""
    decode_steps_per_dispatch: int | None = Field(None, ge=1)
    """Decode steps the rollout engine runs per program it dispatches (an on-device loop: the host reads the
    sampled tokens, admits requests and applies weight updates once per this many tokens a slot; a slot
    stops on the device at its stop token or its length), as tpu-inference's multi-step decode. Larger
    spends less host time a token; each weight update, streamed chunk and freed slot waits up to this
    many steps. Default None: 8 (`jaxrl.inference.engine.DECODE_STEPS_PER_DISPATCH`; docs/benchmarks.md)."""
    kv_reuse_turns: bool = False
    """With `kv_cache_tokens`: keep a finished rollout's pages for a multi-turn conversation's next turn,
    which then prefills only its new tokens (`Scheduler`'s and `ChunkedScheduler`'s `keep_turns`: the latter
    shares whole pages only, so it feeds again what a partial last page held; dropped at each weight update; not
    in an engine group over processes). Its logprobs then differ from a whole prefill's by float rounding
    (about 1e-6 in float32; with a bfloat16 cache, whose rounding a whole prefill's own keys skip, up to
    5e-2 on the tiny test model): no longer the dense cache's bit for bit. Default false."""
    remat: bool = False
    """Recompute activations in the backward pass to save memory (`jax.checkpoint`). Default false."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Sequences per train pass (all chips together): a step's batch is trained in ceil(rows / this)
    micro-batches whose gradients are accumulated, the same update as one pass with one micro-batch's
    activations in memory; best a multiple of the batch shards (mesh data x fsdp x expert). Default None:
    on accelerators the largest that fits, found by compiling the train step at startup (a power of two
    per batch shard, or the whole batch: `jaxrl.compile.report.run_micro_batch`, what `jaxrl compile`
    prints); on CPU 4096 tokens per batch shard (`jaxrl.rl.train.default_micro_batch`)."""
    engine_hosts: int = Field(0, ge=0)
    """Processes (hosts) that share one rollout engine: its mesh spans their devices and they step it in
    lockstep (`jaxrl.inference.lockstep`); must divide the number of processes. Default 0, the fit rule
    (`jaxrl.parallel.distributed.engine_hosts`): 1, an engine per host, on CPU or with one process; on
    accelerators over several processes the run first compiles its train step and takes the fewest hosts
    whose engine (its weights as its mesh shards them, unless it spans every host and reads the trainer's,
    and its KV cache) fits beside that step's compiled bytes, scratch included, in 90% of a chip's memory:
    1 where the model fits a host (the fastest), more where it does not. The value `jaxrl compile` prints
    for the slice; setting it skips that compile (docs/tpu.md, section 7)."""
    host: str = "127.0.0.1"
    """Address of the rollout server that environments call. Default "127.0.0.1"."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the rollout server; 0 = pick a free port. Default 0."""
    loss: LossConfig = LossConfig()
    """`[jax.loss]`: the policy loss, KL penalty and entropy bonus (`jaxrl.config.algorithms`). Default:
    prime-rl's masked importance sampling, no KL penalty, no entropy bonus."""
    advantage: AdvantageConfig = AdvantageConfig()
    """`[jax.advantage]`: rewards to advantages. Default: the group mean as baseline, nothing else."""
    optim: OptimConfig = OptimConfig()
    """`[jax.optim]`: AdamW and the learning-rate schedule. Default: constant rate, clipped at norm 1."""
    teacher: TeacherConfig | None = None
    """`[jax.teacher]`: the teacher of on-policy distillation, with `[jax.loss] teacher_tau > 0`
    (`jaxrl.config.teacher`). Default None: no teacher."""
    sft: SftConfig | None = None
    """`[jax.sft]`: makes the file a supervised fine-tuning config, trained by `jaxrl sft`
    (`jaxrl.config.sft`). Default None: an RL config (`jaxrl run`)."""
