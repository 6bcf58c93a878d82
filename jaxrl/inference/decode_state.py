"""What the inference engine (`jaxrl.inference.engine.Engine`) hands between its programs: a prefilled prompt
(`Prefix`), the decode slots' state (`DecodeState`), and what one decode step (`ResultTokens`) or a dispatch
of several (`ResultSteps`) sampled. Letters as in `jaxrl.model.decoder`.
"""

from __future__ import annotations

import jax
from flax import struct

from jaxrl.inference.sampling import SlotSampling
from jaxrl.model.decoder import KVCache


@struct.dataclass
class Prefix:
    """A prefilled prompt: its cache {"k","v"} [L, 1, T_bucket, K, H] (None: a paged engine's pool holds
    the prompt's pages already, `Engine.prefill_shared`), the first sampled token and its logprob ([1]
    each), the prompt's true length, the slot's sampling settings and PRNG key, the tokens seen so far
    (prompt and first token; bool [1, V]) for the repetition penalty, the request's stop tokens (bool
    [1, V]) for `min_tokens`, and the first token's alternatives (`top_ids` int32 and `top_logprobs`
    float32 [1, top]; top 0 unless the request asked, `Engine.top_for`). `logits` (float32 [1, V]) are
    those after the prompt and `prompt` its token ids (host only: not a leaf), which a paged engine keeps
    with the prompt's pages."""

    cache: KVCache
    token: jax.Array
    logprob: jax.Array
    length: jax.Array
    sampling: SlotSampling
    key: jax.Array
    seen: jax.Array
    stop: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    logits: jax.Array | None = None
    prompt: tuple[int, ...] = struct.field(pytree_node=False, default=())


@struct.dataclass
class DecodeState:
    """All decode slots: the KV cache as the engine's kind declares it (`CacheKind.cache`: [L, B, S, K,
    H] per k and v on TPU and GPU, per-layer chunks on CPU); the next input token [B] and its position [B];
    sampling settings; one PRNG key per slot [B]; tokens seen per slot, bool [B, V] (kept up to date only
    while some slot has a repetition penalty: a slot's settings are fixed at insert); each slot's stop
    tokens, bool [B, V], and the tokens it has sampled, int32 [B] (the prefill's first one included), for
    `min_tokens`."""

    cache: KVCache
    tokens: jax.Array
    positions: jax.Array
    sampling: SlotSampling
    keys: jax.Array
    seen: jax.Array
    stop: jax.Array
    generated: jax.Array


@struct.dataclass
class ResultTokens:
    """One decode step's output: sampled token ids int32 [B], their logprobs float32 [B], and each slot's
    most likely tokens int32 [B, top] with their logprobs float32 [B, top] (top 0: none asked)."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


@struct.dataclass
class ResultSteps:
    """Several decode steps' output (`Engine.generate_steps`, k steps): each step's sampled token ids int32
    [k, B] and their logprobs float32 [k, B], each step's most likely tokens int32 [k, B, top] and their
    logprobs float32 [k, B, top] (top 0: none asked), and how many of the steps each slot ran, int32 [B]:
    slot b's tokens are rows 0 .. counts[b] - 1 of column b, the rest are not tokens."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    counts: jax.Array
