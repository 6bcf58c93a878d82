"""Scoring sampled tokens: the logprob of each trained target under a model, at the loss positions only
(`sampled_logprobs`, the output head fused with the log-softmax in chunks: `jaxrl.model.head`), and the
same under a frozen model run without LoRA (`frozen_logprobs`): the KL reference policy (the base with
its LoRA off, or the starting weights in full fine-tuning) and the teacher of on-policy distillation (a
model of its own weights and architecture), one more forward pass each over the batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.model import decoder, head, modules
from jaxrl.model.blocks import Params
from jaxrl.rl import cpu


def sampled_logprobs(params: Params, hidden_BTD: jax.Array, targets_BT: jax.Array, positions_BP: jax.Array,
                     temperature_B: jax.Array, *, entropy_grad: bool = False, w_grad: bool = False,
                     chunk: int = head.TOKENS_PER_CHUNK,
                     block: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Logprob of each target under `softmax(logits / T)` and the distribution's entropy at the positions
    the loss reads, computed there only (`jaxrl.model.head`: the projection and log-softmax fused, in
    chunks); float32 [B, T] each, 0 at every other position.

    Args:
        positions_BP: int32 positions into T of each row's loss tokens (`Batch.loss_positions`); entries
            >= T are padding and read nothing.
        temperature_B: float32; 0 (greedy) is scored at 1.
        entropy_grad: (static) whether the entropy is differentiable (a third vocabulary matmul per chunk).
        w_grad: (static) whether the output projection is differentiable (full fine-tuning).
        chunk: (static) tokens per chunk of the head (`jaxrl.rl.cpu.Tuning.head_chunk`).
        block: (static) vocabulary entries per block of the head's online softmax (`Tuning.head_block`;
            None: the whole vocabulary in one block).
    """
    b, t, d = hidden_BTD.shape
    k = positions_BP.shape[1]
    h_BPD = jnp.take_along_axis(hidden_BTD, positions_BP[:, :, None], axis=1, mode="clip")
    y_BP = jnp.take_along_axis(targets_BT, positions_BP, axis=1, mode="clip")
    inv_t_B = 1.0 / jnp.where(temperature_B > 0, temperature_B, 1.0)
    logp, entropy = head.token_logprobs(decoder.unembed_matrix(params), h_BPD.reshape(b * k, d), y_BP.reshape(-1),
                                        jnp.repeat(inv_t_B, k), entropy_grad=entropy_grad, w_grad=w_grad,
                                        chunk=chunk, block=block)
    rows_B1 = jnp.arange(b)[:, None]

    def scatter(x):
        return jnp.zeros((b, t), jnp.float32).at[rows_B1, positions_BP].set(x.reshape(b, k), mode="drop")

    return scatter(logp), scatter(entropy)


def frozen_logprobs(model: modules.Model, batch: dict[str, jax.Array], positions_BT: jax.Array,
                    temperature_B: jax.Array, tuning: cpu.Tuning, *, mesh: jax.sharding.Mesh,
                    scan_layers: bool) -> jax.Array:
    """`sampled_logprobs` of `batch`'s targets under `model` run without its LoRA (the KL reference or the
    teacher), held constant (stop-gradient): float32 [B, T], 0 off the loss positions.

    Args:
        batch: the train step's arrays (`inputs`, `targets` int32 [B, T]; `loss_positions` int32 [B, P];
            `segment_ids` int32 [B, T] when rows are packed).
        positions_BT: int32 position of each input (RoPE, causal mask).
        temperature_B: float32 temperature each row is scored at (0 is scored at 1).
        tuning: the head's chunk and block for `model`'s config (`jaxrl.rl.cpu.tuning`).
        scan_layers: (static) run the layer stack with `lax.scan`.
    """
    hidden, _ = model(batch["inputs"], positions_BT, lora=False, mesh=mesh, segment_ids=batch.get("segment_ids"),
                      scan_layers=scan_layers)
    return jax.lax.stop_gradient(sampled_logprobs(
        model.weights()[0], hidden, batch["targets"], batch["loss_positions"], temperature_B,
        chunk=tuning.head_chunk, block=tuning.head_block)[0])
