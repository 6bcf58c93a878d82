"""A training batch on the host: `Batch`, packed from a step's samples by `make_batch`, with each row's
loss-token positions (`loss_positions`, of a width from `loss_width`), which the train step
(`jaxrl.rl.train.Trainer`) places on the mesh."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Batch:
    """One padded training batch (numpy, host side). The model reads `inputs` and predicts `targets`
    (inputs shifted by one); the remaining arrays are aligned with `targets`.

    inputs, targets: int32 [B, T]; loss_mask: bool [B, T] (True on sampled tokens);
    inference_logprobs: float32 [B, T] (engine logprobs, 0 elsewhere); advantages: float32 [B];
    temperature: float32 [B] (each row's sampling temperature, which `[sampling.temp_scheduler]` varies
    between rows of one batch; 0 is scored at 1); loss_positions: int32 [B, P],
    each row's loss-token positions in order, padded with T (the train step computes logprobs there
    only; P is the most loss tokens of a row, rounded up by `loss_width`). positions, segment_ids: int32
    [B, T] or None: each input's position (RoPE, causal mask) and which sample of the row it belongs to
    (attention stays within a segment), for rows that pack several samples (SFT, `jaxrl.rl.sft.pack`),
    each with positions from 0; None (RL's `make_batch`): one sample per row, positions 0..T-1.
    teacher_logprobs: float32 [B, T] or None: an external teacher's logprobs of the targets (at loss tokens,
    0 elsewhere; `jaxrl.rl.teacher_client`), for `[jax.loss] teacher_tau`; None: no teacher, or one scored
    in the train step.
    """

    inputs: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    inference_logprobs: np.ndarray
    advantages: np.ndarray
    temperature: np.ndarray
    loss_positions: np.ndarray
    positions: np.ndarray | None = None
    segment_ids: np.ndarray | None = None
    teacher_logprobs: np.ndarray | None = None


def loss_width(n: int) -> int:
    """K for rows of at most `n` loss tokens: the next of 16, 24, 32, 48, 64, 96, ... (2^k and 1.5 x 2^k),
    so that the train step compiles for a handful of K and computes at most a third more than needed."""
    k = 16
    while k < n:
        k = k * 3 // 2 if k & (k - 1) == 0 else k * 4 // 3
    return k


def make_batch(samples: list[tuple[list[int], list[bool], list[float]]], advantages: np.ndarray,
               temperature: float | np.ndarray, pad_to: int,
               teacher_logprobs: list[list[float]] | None = None) -> Batch:
    """Pack (token_ids, sampled_mask, logprobs) triples, each of one length, into a `Batch` of width
    `pad_to`. `temperature`: what each sample was sampled at, one for all or float [samples].
    `teacher_logprobs`: an external teacher's logprob of each sample's tokens, aligned with its token ids
    (`jaxrl.rl.teacher_client.score`), kept at the sampled tokens (`Batch.teacher_logprobs`).

    A sample of n <= `pad_to` + 1 tokens fills n - 1 positions (inputs and their next tokens). The width
    is `pad_to`, not the n - 1 of the longest sample a run pads to (`jaxrl.run.runner.pad_length`: a power
    of two or `seq_len`, at least n), so that it keeps that alignment. On a TPU a width of 2^k - 1 is not
    a whole number of the chip's row tiles, and each [B, T] -> [B * T] flattening of the projections'
    tokens becomes a relayout copy: Qwen3-4B's train step at T = 4095 compiled for v6e-8 to 1.27M
    bundles in 262 s of CPU, at T = 4096 to 0.72M in 143 s (libtpu, 2026-11-24).

    Raises:
        ValueError: a sample has more than `pad_to` + 1 tokens.
    """
    b, t = len(samples), pad_to
    inputs = np.zeros((b, t), np.int32)
    targets = np.zeros((b, t), np.int32)
    mask = np.zeros((b, t), bool)
    logp = np.zeros((b, t), np.float32)
    for i, (ids, sampled, lps) in enumerate(samples):
        n = len(ids)
        if n > pad_to + 1:
            raise ValueError(f"sample {i} has {n} tokens: more than {pad_to} positions")
        inputs[i, : n - 1] = ids[:-1]
        targets[i, : n - 1] = ids[1:]
        mask[i, : n - 1] = sampled[1:]
        logp[i, : n - 1] = lps[1:]
    teacher = None
    if teacher_logprobs is not None:
        teacher = np.zeros((b, t), np.float32)
        for i, lps in enumerate(teacher_logprobs):
            teacher[i, : len(lps) - 1] = lps[1:]
        teacher = np.where(mask, teacher, 0.0).astype(np.float32)
    return Batch(inputs, targets, mask, logp, np.asarray(advantages, np.float32),
                 np.broadcast_to(np.asarray(temperature, np.float32), (b,)).copy(), loss_positions(mask),
                 teacher_logprobs=teacher)


def loss_positions(mask_BT: np.ndarray, most: int | None = None) -> np.ndarray:
    """`Batch.loss_positions` of a bool loss mask [B, T]: int32 [B, P], each row's True positions in order,
    padded with T; P = `loss_width` of the most loss tokens of a row (or of `most`, when given, for one
    width over batches: the step compiles once), at most T."""
    b, t = mask_BT.shape
    counts = mask_BT.sum(axis=1)
    most = int(counts.max(initial=0)) if most is None else max(most, int(counts.max(initial=0)))
    positions = np.full((b, min(loss_width(most), t)), t, np.int32)
    for i in range(b):
        positions[i, : counts[i]] = np.flatnonzero(mask_BT[i])
    return positions
