"""The inference engine, with JetStream's Engine API (prefill / insert / generate over decode slots).

A decode state holds `B = max_concurrent_decodes` slots. `prefill` runs one prompt (right-padded to a
length bucket) through the model, keeps its key/value cache as a `Prefix` and samples the first token;
`insert` copies a prefix into a free slot; `generate` advances every slot by one token. Sampling runs on
device (temperature, top_p, top_k, per-slot PRNG keys), and every sampled token comes with its logprob
under the sampling distribution after temperature, `log_softmax(logits / T)` (the trainer recomputes
the same quantity; with T = 0, greedy, T = 1 is used for the logprob). top_p / top_k truncate the
distribution that is sampled from but not the reported logprob, as in vLLM's default.

The method names and arguments follow `jetstream.engine.engine_api.Engine` (google-jetstream 0.2.2) so
that JetStream's orchestrator can drive this engine; `prefill` and `insert` take extra keyword
arguments for the per-request sampling settings, which JetStream's API has no slot for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl import model
from jaxrl.model import KVCache, ModelConfig, Params
from jaxrl.protocol import SamplingParams
from jaxrl.sharding import array_sharding


@struct.dataclass
class SlotSampling:
    """Sampling settings of each slot: float32 temperature [B], top_p [B], int32 top_k [B] (<= 0: off)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array

    @classmethod
    def of(cls, params: SamplingParams) -> SlotSampling:
        return cls(jnp.array([params.temperature], jnp.float32), jnp.array([params.top_p], jnp.float32),
                   jnp.array([params.top_k], jnp.int32))


@struct.dataclass
class Prefix:
    """A prefilled prompt: its cache {"k","v"} [L, 1, T_bucket, K, H], the first sampled token and its
    logprob ([1] each), the prompt's true length, the slot's sampling settings and PRNG key."""

    cache: KVCache
    token: jax.Array
    logprob: jax.Array
    length: jax.Array
    sampling: SlotSampling
    key: jax.Array


@struct.dataclass
class DecodeState:
    """All decode slots: cache [L, B, S, K, H]; the next input token [B] and its position [B]; sampling
    settings; one PRNG key per slot [B]."""

    cache: KVCache
    tokens: jax.Array
    positions: jax.Array
    sampling: SlotSampling
    keys: jax.Array


@struct.dataclass
class ResultTokens:
    """One decode step's output: sampled token ids int32 [B] and their logprobs float32 [B]."""

    tokens: jax.Array
    logprobs: jax.Array


def sample(logits_BV: jax.Array, sampling: SlotSampling, keys_B: jax.Array,
           truncate: bool) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row; return (tokens int32 [B], logprobs float32 [B]).

    Draws by inverse CDF with one uniform per row (one pass over the vocabulary, no per-token random
    numbers). `truncate` (static) enables top_p / top_k, which need a sort of each row.
    """
    greedy = sampling.temperature <= 0.0
    t = jnp.where(greedy, 1.0, sampling.temperature)
    scaled_BV = logits_BV.astype(jnp.float32) / t[:, None]
    logp_BV = jax.nn.log_softmax(scaled_BV, axis=-1)
    u_B = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_B)
    if truncate:
        v = logits_BV.shape[-1]
        order_BV = jnp.argsort(-scaled_BV, axis=-1)
        sorted_p_BV = jnp.exp(jnp.take_along_axis(logp_BV, order_BV, axis=-1))
        rank_V = jnp.arange(v)
        top_k = jnp.where(sampling.top_k > 0, sampling.top_k, v)
        before_BV = jnp.cumsum(sorted_p_BV, axis=-1) - sorted_p_BV
        keep_BV = (rank_V[None] < top_k[:, None]) & (before_BV < sampling.top_p[:, None])
        kept_BV = jnp.where(keep_BV, sorted_p_BV, 0.0)
        cdf_BV = jnp.cumsum(kept_BV, axis=-1)
        idx_B = jnp.sum(cdf_BV < (u_B * cdf_BV[:, -1])[:, None], axis=-1)
        idx_B = jnp.minimum(idx_B, jnp.sum(keep_BV, axis=-1) - 1)
        sampled_B = jnp.take_along_axis(order_BV, idx_B[:, None], axis=-1)[:, 0]
    else:
        cdf_BV = jnp.cumsum(jnp.exp(logp_BV), axis=-1)
        sampled_B = jnp.sum(cdf_BV < (u_B * cdf_BV[:, -1])[:, None], axis=-1)
        sampled_B = jnp.minimum(sampled_B, logits_BV.shape[-1] - 1)
    tokens_B = jnp.where(greedy, jnp.argmax(logits_BV, axis=-1), sampled_B).astype(jnp.int32)
    return tokens_B, jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]


def prefill_buckets(max_prefill_length: int, smallest: int = 16) -> tuple[int, ...]:
    """Padded prompt lengths: powers of two from `smallest` up to `max_prefill_length` (included)."""
    out, n = [], smallest
    while n < max_prefill_length:
        out.append(n)
        n *= 2
    return (*out, max_prefill_length)


@dataclasses.dataclass
class Engine:
    """JetStream-style engine over a Qwen3 params pytree.

    Engine params are `{"base": params, "lora": lora_or_None}`; LoRA products are scaled by
    `lora_scale` (alpha / rank). `max_seq_len` (S) is the cache length: prompt plus sampled tokens.
    """

    cfg: ModelConfig
    mesh: Mesh
    max_concurrent_decodes: int
    max_seq_len: int
    lora_scale: float = 0.0
    cache_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        self.max_prefill_length = self.max_seq_len - 1
        self.buckets = prefill_buckets(self.max_prefill_length)
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("truncate",))
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,))
        self._generate = jax.jit(self._generate_impl, donate_argnums=(1,), static_argnames=("truncate",))

    # JetStream Engine API -------------------------------------------------------------------------
    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def colocated_cpus(self) -> None:
        return None

    def get_prefix_destination_sharding(self) -> Any:
        return NamedSharding(self.mesh, PartitionSpec())

    def get_tokenizer(self) -> None:
        """Tokenization stays with the client (verifiers' renderer); the engine sees token ids only."""
        return None

    def init_decode_state(self) -> DecodeState:
        """Empty slots: zero cache, token 0 at position 0, greedy sampling."""
        c = self.cfg
        b, s = self.max_concurrent_decodes, self.max_seq_len
        shape = (c.num_layers, b, s, c.num_kv_heads, c.head_dim)
        cache_sh = array_sharding((None, "batch", None, "kv_heads", None), shape, self.mesh)
        vec_sh = array_sharding(("batch",), (b,), self.mesh)
        zeros = jax.jit(lambda: jnp.zeros(shape, self.cache_dtype), out_shardings=cache_sh)
        return DecodeState(
            cache={"k": zeros(), "v": zeros()},
            tokens=jax.device_put(jnp.zeros((b,), jnp.int32), vec_sh),
            positions=jax.device_put(jnp.zeros((b,), jnp.int32), vec_sh),
            sampling=SlotSampling(jnp.zeros((b,), jnp.float32), jnp.ones((b,), jnp.float32),
                                  jnp.zeros((b,), jnp.int32)),
            keys=jax.random.split(jax.random.key(0), b),
        )

    def bucket(self, length: int) -> int:
        """The smallest prefill bucket that holds `length` tokens.

        Raises:
            ValueError: `length` exceeds `max_prefill_length`.
        """
        for b in self.buckets:
            if length <= b:
                return b
        raise ValueError(f"prompt of {length} tokens exceeds the engine's {self.max_prefill_length}")

    def prefill(self, *, params: Params, existing_prefix: Prefix | None = None, padded_tokens: jax.Array,
                true_length: int, sampling: SamplingParams | None = None,
                key: jax.Array | None = None) -> Prefix:
        """Run a right-padded prompt `padded_tokens` int32 [T_bucket] of `true_length` real tokens.

        Raises:
            NotImplementedError: `existing_prefix` is given (prefix caching is not built).
        """
        if existing_prefix is not None:
            raise NotImplementedError("prefill on top of an existing prefix is not supported")
        key = jax.random.key(0) if key is None else key
        sampling = sampling or SamplingParams()
        truncate = sampling.top_p < 1.0 or sampling.top_k > 0
        return self._prefill(params, jnp.asarray(padded_tokens, jnp.int32), jnp.int32(true_length),
                             SlotSampling.of(sampling), key, truncate=truncate)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Copy `prefix` into decode slot `slot` (its buffers are donated)."""
        return self._insert(prefix, decode_state, jnp.int32(slot))

    def generate(self, params: Params, decode_state: DecodeState,
                 truncate: bool = True) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot. `truncate=False` skips top_p / top_k (faster) when no active
        slot uses them."""
        return self._generate(params, decode_state, truncate=truncate)

    # jitted bodies --------------------------------------------------------------------------------
    def _forward(self, params, tokens_BT, positions_BT, cache=None):
        return model.forward(self.cfg, params["base"], tokens_BT, positions_BT, lora=params.get("lora"),
                             lora_scale=self.lora_scale, cache=cache, mesh=self.mesh)

    def _prefill_impl(self, params, tokens_T, true_length, sampling, key, *, truncate):
        t = tokens_T.shape[0]
        hidden_BTD, kv = self._forward(params, tokens_T[None], jnp.arange(t, dtype=jnp.int32)[None])
        last_BD = jax.lax.dynamic_index_in_dim(hidden_BTD[0], true_length - 1, keepdims=True)
        logits_BV = model.logits(params["base"], last_BD[None])[:, 0]
        key, sub = jax.random.split(key)
        token, logprob = sample(logits_BV, sampling, sub[None], truncate)
        kv = {k: v.astype(self.cache_dtype) for k, v in kv.items()}
        return Prefix(kv, token, logprob, true_length, sampling, key)

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot):
        def put(dst, src):
            return jax.lax.dynamic_update_slice(dst, src, (0, slot, 0, 0, 0))

        def put1(dst, src):
            return jax.lax.dynamic_update_slice(dst, src, (slot,))

        return DecodeState(
            cache=jax.tree.map(put, state.cache, prefix.cache),
            tokens=put1(state.tokens, prefix.token),
            positions=put1(state.positions, prefix.length[None]),
            sampling=jax.tree.map(put1, state.sampling, prefix.sampling),
            keys=put1(state.keys, prefix.key[None]),
        )

    def _generate_impl(self, params, state: DecodeState, *, truncate):
        hidden_BTD, cache = self._forward(params, state.tokens[:, None], state.positions[:, None], state.cache)
        logits_BV = model.logits(params["base"], hidden_BTD)[:, 0]
        split = jax.vmap(jax.random.split)(state.keys)
        tokens, logprobs = sample(logits_BV, state.sampling, split[:, 1], truncate)
        positions = jnp.minimum(state.positions + 1, self.max_seq_len - 1)
        new = DecodeState(cache=cache, tokens=tokens, positions=positions, sampling=state.sampling,
                          keys=split[:, 0])
        return new, ResultTokens(tokens, logprobs)


def pad_prompt(prompt_ids: list[int], bucket: int) -> jax.Array:
    """Right-pad `prompt_ids` with zeros to `bucket` tokens (int32 [bucket])."""
    return jnp.asarray(list(prompt_ids) + [0] * (bucket - len(prompt_ids)), jnp.int32)
