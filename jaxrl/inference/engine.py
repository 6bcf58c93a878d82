"""The inference engine, with JetStream's Engine API (prefill / insert / generate over decode slots).

A decode state holds `B = max_concurrent_decodes` slots. `prefill` runs one prompt (right-padded to a
length bucket) through the model, keeps its key/value cache as a `Prefix` and samples the first token;
`insert` copies a prefix into a free slot; `generate` advances every slot by one token. Sampling runs on
device (`jaxrl.inference.sampling`: temperature, top_p, top_k, min_p, repetition penalty, `min_tokens`,
per-slot PRNG keys), and every sampled token comes with its logprob under the sampling distribution after
temperature, `log_softmax(logits / T)` of the logits as the penalty and `min_tokens`' ban left them (the
trainer recomputes the same quantity from the raw logits; with T = 0, greedy, T = 1 is used for the
logprob). The truncations cut the distribution that is sampled from but not the reported logprob, as in
vLLM's default. `min_tokens` is counted per slot on device (`DecodeState.generated`): while a slot has
sampled fewer, its stop tokens (`DecodeState.stop`) are banned, in the same compiled decode step for
every request. Both jitted steps rebuild the model, `jaxrl.model.modules.Qwen3`, over the engine params'
arrays (`modules.bind`: `nnx.merge`, no copies, so the engine reads the trainer's base weights in place):
prefill calls it (`qwen3.forward`, over the per-layer copy where `prepare` made one), a decode step calls
`Qwen3.decode` (`jaxrl.model.decode`, the same layers with a bandwidth-minded attention over the cache).
The decode state is donated to `insert` and `generate`, so the cache is updated in place.

The method names and arguments follow `jetstream.engine.engine_api.Engine` (google-jetstream 0.2.2) so
that JetStream's orchestrator can drive this engine; `prefill` and `insert` take extra keyword
arguments for the per-request sampling settings, which JetStream's API has no slot for.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.sampling import SlotSampling, mark_seen, sample, sample_unembedded, stop_ban, vocab_blocks
from jaxrl.model import modules, qwen3
from jaxrl.model.decode import chunk_sizes, out_major, split_cache, unstack_layers
from jaxrl.model.qwen3 import KVCache, ModelConfig, OutMajor, Params
from jaxrl.parallel.sharding import array_sharding, mesh_platform


@struct.dataclass
class Prefix:
    """A prefilled prompt: its cache {"k","v"} [L, 1, T_bucket, K, H], the first sampled token and its
    logprob ([1] each), the prompt's true length, the slot's sampling settings and PRNG key, the
    tokens seen so far (prompt and first token; bool [1, V]) for the repetition penalty, and the
    request's stop tokens (bool [1, V]) for `min_tokens`."""

    cache: KVCache
    token: jax.Array
    logprob: jax.Array
    length: jax.Array
    sampling: SlotSampling
    key: jax.Array
    seen: jax.Array
    stop: jax.Array


@struct.dataclass
class DecodeState:
    """All decode slots: cache [L, B, S, K, H] (with `Engine.unstack`, per layer a list of head-major chunks
    of `Engine.chunk_sizes` positions (128, 128, 256, ...): keys [B, K, H, C], values [B, K, C, H],
    `jaxrl.model.decode.split_cache`);
    the next input token [B] and its position [B]; sampling settings; one PRNG key per slot [B]; tokens
    seen per slot, bool [B, V] (kept up to date only while some slot has a repetition penalty: a slot's
    settings are fixed at insert); each slot's stop tokens, bool [B, V], and the tokens it has sampled,
    int32 [B] (the prefill's first one included), for `min_tokens`."""

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
    """One decode step's output: sampled token ids int32 [B] and their logprobs float32 [B]."""

    tokens: jax.Array
    logprobs: jax.Array


def copies_weights(platform: str) -> bool:
    """Whether an engine on devices of `platform` ("cpu", "tpu", "gpu", "cuda", "rocm": `jax.Device.platform`)
    keeps the per-layer copy of the layer weights, output-major (`Engine.prepare`): only on CPU, where it
    was measured to speed up decode (docs/benchmarks.md, issues 4 and 13: a separate array per layer, and
    the projections as `qwen3.OutMajor`, the orientation XLA's CPU dot reads fastest at a few rows). On an
    accelerator the engine reads the training weights in place: the copy would cost a second base
    model's worth of HBM."""
    return platform == "cpu"


def blocked_sampling_pays(cfg: ModelConfig, decode_slots: int, platform: str) -> bool:
    """Whether a decode step with neither truncation, penalty nor ban samples with `sample_unembedded`
    (the unembedding and the draw fused over vocabulary blocks) rather than the [B, V] logits and `sample`,
    on devices of `platform` (`jaxrl.parallel.sharding.mesh_platform`).
    Measured on 2 CPU cores (issue 13, A/B in one process, vocabulary 151,936): at hidden 256 and 32 slots
    the unembedding plus sampling took about 0.5x the time; at hidden 1024 (8 or 32 slots) 1.2-1.9x, and
    at hidden 256 and 8 slots about 1x, where XLA's blocked [B, D] x [D, block] products run slower than
    the whole matmul. So only on CPU (not measured elsewhere), for small hidden sizes and many slots."""
    return platform == "cpu" and cfg.hidden_size <= 256 and decode_slots >= 16


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

    Engine params are `{"base": params, "lora": lora_or_None}`, plus, from `prepare`, `"layers"`: the
    per-layer copy that prefills and decode steps read (`jaxrl.model.decode.unstack_layers`, projections
    output-major by `decode.out_major`; several times faster decode on CPU for a second copy of the layer
    weights, with the KV cache per layer likewise, in chunks of `chunk_sizes` positions), and `"unembed"`, the
    unembedding as a `qwen3.OutMajor` [V, D] (a tied embedding read in place); `unstack=False` keeps one
    copy of the weights (the training weights, read in place), a stacked cache, and scans the stack.
    `unstack` None (the default) decides by the mesh's platform (`copies_weights`): the copies only on CPU,
    where memory is plentiful and they were measured faster; never on TPU or GPU, where they would double
    the engine's HBM for weights. LoRA
    products are scaled by `lora_scale` (alpha / rank). `max_seq_len` (S) is the cache length: prompt
    plus sampled tokens. `blocked_sampling` (None: `blocked_sampling_pays`) picks `sample_unembedded` for
    decode steps that only apply a temperature.
    """

    cfg: ModelConfig
    mesh: Mesh
    max_concurrent_decodes: int
    max_seq_len: int
    lora_scale: float = 0.0
    cache_dtype: Any = jnp.float32
    unstack: bool | None = None
    blocked_sampling: bool | None = None

    def __post_init__(self) -> None:
        if self.unstack is None:
            self.unstack = copies_weights(mesh_platform(self.mesh))
        if self.blocked_sampling is None:
            self.blocked_sampling = blocked_sampling_pays(self.cfg, self.max_concurrent_decodes,
                                                          mesh_platform(self.mesh))
        self._base_layers: tuple | None = None  # (the base it was made from, layers, unembed, its blocks)
        self.max_prefill_length = self.max_seq_len - 1
        self.buckets = prefill_buckets(self.max_prefill_length)
        self.chunk_sizes = chunk_sizes(self.max_seq_len)  # positions per chunk of the per-layer cache (`unstack`)
        self.num_chunks = len(self.chunk_sizes)
        self._prefill_forward = jax.jit(self._prefill_forward_impl)
        self._prefill_sample = jax.jit(self._prefill_sample_impl, static_argnames=("truncate",))
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,))
        self._generate = jax.jit(self._generate_impl, donate_argnums=(1,),
                                 static_argnames=("truncate", "penalize", "ban", "chunks"))

    def prepare(self, params: Params) -> Params:
        """Engine params for `prefill` / `generate` from `{"base", "lora"}`: adds the per-layer view with
        its projections output-major (`decode.out_major`) and the unembedding as a `qwen3.OutMajor` [V, D]
        (`"unembed"`: a tied embedding as it is, an untied one transposed), and with `blocked_sampling` its
        rows in blocks (`"unembed_blocks"`: `sampling.vocab_blocks`, a copy), unless `unstack` is off. The
        base's views are reused while the same base object comes back (an RL run swaps only its LoRA)."""
        if not self.unstack:
            return {"base": params["base"], "lora": params.get("lora")}
        base = params["base"]
        if self._base_layers is None or self._base_layers[0] is not base:
            unembed = (qwen3.OutMajor(base["embed"], (self.cfg.vocab_size,)) if "unembed" not in base
                       else qwen3.OutMajor.of(base["unembed"], 1))
            blocks = vocab_blocks(unembed.w_OI) if self.blocked_sampling else ()
            self._base_layers = (base, out_major(self.cfg, unstack_layers(self.cfg, base)), unembed, blocks)
        _, base_layers, unembed, blocks = self._base_layers
        lora_layers = unstack_layers(self.cfg, params.get("lora"))
        layers = [(w, lw, mw, mlw) for (w, mw), (lw, mlw) in zip(base_layers, lora_layers, strict=True)]
        return {"base": base, "lora": params.get("lora"), "layers": layers, "unembed": unembed,
                **({"unembed_blocks": blocks} if self.blocked_sampling else {})}

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
        vec_sh = array_sharding(("batch",), (b,), self.mesh)

        def zeros(shape, axes):
            return jax.jit(lambda: jnp.zeros(shape, self.cache_dtype),
                           out_shardings=array_sharding(axes, shape, self.mesh))()

        if self.unstack:  # per layer, head-major chunks (`jaxrl.model.decode.split_cache`)
            axes, h = ("batch", "kv_heads", None, None), c.head_dim
            cache = {"k": [[zeros((b, c.num_kv_heads, h, n), axes) for n in self.chunk_sizes]
                           for _ in range(c.num_layers)],
                     "v": [[zeros((b, c.num_kv_heads, n, h), axes) for n in self.chunk_sizes]
                           for _ in range(c.num_layers)]}
        else:
            shape = (c.num_layers, b, s, c.num_kv_heads, c.head_dim)
            axes = (None, "batch", None, "kv_heads", None)
            cache = {"k": zeros(shape, axes), "v": zeros(shape, axes)}
        return DecodeState(
            cache=cache,
            tokens=jax.device_put(jnp.zeros((b,), jnp.int32), vec_sh),
            positions=jax.device_put(jnp.zeros((b,), jnp.int32), vec_sh),
            sampling=SlotSampling.neutral(b),
            keys=jax.random.split(jax.random.key(0), b),
            seen=jnp.zeros((b, c.vocab_size), jnp.bool_),
            stop=jnp.zeros((b, c.vocab_size), jnp.bool_),
            generated=jax.device_put(jnp.zeros((b,), jnp.int32), vec_sh),
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
        return self.prefill_shared(params, padded_tokens, true_length, [sampling or SamplingParams()], [key])[0]

    def prefill_shared(self, params: Params, padded_tokens: jax.Array, true_length: int,
                       samplings: list[SamplingParams], keys: list[jax.Array]) -> list[Prefix]:
        """One prefix per request for requests with the same prompt (`prefill`'s arguments): the prompt
        runs through the model once (`_prefill_forward`), then each request samples its first token from
        those logits with its own settings and key (`_prefill_sample`, a program of batch 1: the same
        numbers as a prefill of its own). The prefixes share the cache arrays (`insert` copies them).
        `prefill` is this with one request; `jaxrl.compile.programs.compile_prefill` compiles the same two
        programs."""
        cache, logits_1V = self._prefill_forward(params, jnp.asarray(padded_tokens, jnp.int32), jnp.int32(true_length))
        out = []
        for params_i, key in zip(samplings, keys, strict=True):
            sampling, length = SlotSampling.of(params_i), jnp.int32(true_length)
            parts = self._prefill_sample(logits_1V, jnp.asarray(padded_tokens, jnp.int32), length, sampling, key,
                                         self._stop_tokens(params_i), truncate=params_i.truncates)
            out.append(Prefix(cache, *parts[:2], length, sampling, *parts[2:]))
        return out

    def _stop_tokens(self, sampling: SamplingParams) -> np.ndarray:
        """`sampling`'s stop tokens as bool [V] (ids past the vocabulary dropped: never sampled)."""
        stop_V = np.zeros((self.cfg.vocab_size,), np.bool_)
        stop_V[[t for t in sampling.stop_token_ids if t < self.cfg.vocab_size]] = True
        return stop_V

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Copy `prefix` into decode slot `slot` (the decode state's buffers are donated)."""
        return self._insert(prefix, decode_state, jnp.int32(slot))

    def generate(self, params: Params, decode_state: DecodeState, truncate: bool = True, penalize: bool = True,
                 ban: bool = True, chunks: int | None = None) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot (the decode state's buffers are donated). `truncate=False`
        skips min_p / top_k / top_p, `penalize=False` the repetition penalty and its bookkeeping, and
        `ban=False` the `min_tokens` ban (`stop_ban`): faster, for when no active slot uses them (no
        slot still short of its `min_tokens`, for `ban`). With all three off and `blocked_sampling`, the
        step samples with `sample_unembedded`, over vocabulary blocks without the [B, V] logits.
        `chunks` (with `unstack`; None: all): the step reads and writes only the first `chunks` chunks of
        each layer's cache (`cache_chunks`), so attention reads the positions in use, not `max_seq_len`:
        every slot that matters must be at a position the first `chunks` chunks hold; a slot past it samples
        from a truncated cache. A slot's numbers are the same, bit for bit, for any `chunks` that holds
        its position (`jaxrl.model.decode._attend_chunks`). Each combination compiles once."""
        if not self.unstack or chunks == self.num_chunks:
            chunks = None
        return self._generate(params, decode_state, truncate=truncate, penalize=penalize, ban=ban, chunks=chunks)

    def cache_chunks(self, positions: int) -> int:
        """How many cache chunks a decode step reads (`generate`'s `chunks`) so that it holds positions
        [0, `positions`): the fewest (one compiled step per count: about log2(max_seq_len / 128) + 1 of
        them, `jaxrl.model.decode.chunk_sizes`), at most `num_chunks`."""
        held = itertools.accumulate(self.chunk_sizes)
        return next((n for n, h in enumerate(held, 1) if h >= positions), self.num_chunks)

    # jitted bodies --------------------------------------------------------------------------------
    def _prefill_forward_impl(self, params, tokens_T, true_length):
        """The prompt's cache {"k","v"} [L, 1, T, K, H] and the logits after its last token, [1, V]
        (through the per-layer copy where `prepare` made one, as decode steps)."""
        t = tokens_T.shape[0]
        model = modules.bind(self.cfg, params["base"], params.get("lora"), self.lora_scale)
        hidden_BTD, kv = model(tokens_T[None], jnp.arange(t, dtype=jnp.int32)[None], mesh=self.mesh,
                               layers=params.get("layers"))
        last_BD = jax.lax.dynamic_index_in_dim(hidden_BTD[0], true_length - 1, keepdims=True)
        logits_BV = qwen3.logits(_unembedding(params), last_BD[None])[:, 0]
        return {k: v.astype(self.cache_dtype) for k, v in kv.items()}, logits_BV

    def _prefill_sample_impl(self, logits_BV, tokens_T, true_length, sampling, key, stop_V, *, truncate):
        """The first token and its logprob [1], the slot's next key, seen and stop tokens [1, V]."""
        t = tokens_T.shape[0]
        prompt_T = jnp.where(jnp.arange(t) < true_length, tokens_T, self.cfg.vocab_size)  # padding: dropped
        seen_BV = jnp.zeros((1, self.cfg.vocab_size), jnp.bool_).at[0, prompt_T].set(True, mode="drop")
        key, sub = jax.random.split(key)
        stop_BV = stop_V[None]
        token, logprob = sample(logits_BV, sampling, sub[None], truncate=truncate, seen_BV=seen_BV,
                                ban_BV=stop_ban(stop_BV, jnp.zeros((1,), jnp.int32), sampling.min_tokens))
        token, logprob = self._replicated(token), self._replicated(logprob)
        return token, logprob, key, mark_seen(seen_BV, token), stop_BV

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot):
        def put(dst, src):
            return jax.lax.dynamic_update_slice(dst, src, (0, slot, 0, 0, 0))

        def put1(dst, src):
            return jax.lax.dynamic_update_slice(dst, src, (slot,))

        if self.unstack:  # the head-major chunks (`split_cache`) of the prefix's [L, 1, T, K, H]
            src = split_cache(prefix.cache, self.chunk_sizes)  # the prompt's chunks; those after it keep their data

            def put_chunks(dst, pieces):
                return [jax.lax.dynamic_update_slice(d, x, (slot, 0, 0, 0))
                        for d, x in zip(dst[:len(pieces)], pieces, strict=True)] + dst[len(pieces):]

            cache = {n: [put_chunks(dst, pieces) for dst, pieces in zip(state.cache[n], src[n], strict=True)]
                     for n in ("k", "v")}
        else:
            cache = {n: put(state.cache[n], prefix.cache[n]) for n in ("k", "v")}
        return DecodeState(
            cache=cache,
            tokens=put1(state.tokens, prefix.token),
            positions=put1(state.positions, prefix.length[None]),
            sampling=jax.tree.map(put1, state.sampling, prefix.sampling),
            keys=put1(state.keys, prefix.key[None]),
            seen=jax.lax.dynamic_update_slice(state.seen, prefix.seen, (slot, 0)),
            stop=jax.lax.dynamic_update_slice(state.stop, prefix.stop, (slot, 0)),
            generated=put1(state.generated, jnp.ones((1,), jnp.int32)),
        )

    def _generate_impl(self, params, state: DecodeState, *, truncate, penalize, ban=True, chunks=None):
        model = modules.bind(self.cfg, params["base"], params.get("lora"), self.lora_scale)
        read = state.cache if chunks is None else {n: [layer[:chunks] for layer in state.cache[n]] for n in ("k", "v")}
        hidden_BTD, cache = model.decode(state.tokens, state.positions, read, mesh=self.mesh,
                                         layers=params.get("layers"))
        if chunks is not None:  # the chunks past those read, as they were
            cache = {n: [new + old[chunks:] for new, old in zip(cache[n], state.cache[n], strict=True)]
                     for n in ("k", "v")}
        split = jax.vmap(jax.random.split)(state.keys)
        if truncate or penalize or ban or not self.blocked_sampling:
            logits_BV = qwen3.logits(_unembedding(params), hidden_BTD)[:, 0]
            tokens, logprobs = sample(logits_BV, state.sampling, split[:, 1], truncate=truncate,
                                      seen_BV=state.seen if penalize else None,
                                      ban_BV=stop_ban(state.stop, state.generated, state.sampling.min_tokens)
                                      if ban else None)
        else:  # temperature only: blocked over the vocabulary, no [B, V] logits
            tokens, logprobs = sample_unembedded(hidden_BTD[:, 0], _unembedding_rows(params), state.sampling,
                                                 split[:, 1], blocks=params.get("unembed_blocks"))
        positions = jnp.minimum(state.positions + 1, self.max_seq_len - 1)
        seen = mark_seen(state.seen, tokens) if penalize else state.seen
        new = DecodeState(cache=cache, tokens=tokens, positions=positions, sampling=state.sampling,
                          keys=split[:, 0], seen=seen, stop=state.stop, generated=state.generated + 1)
        return new, ResultTokens(self._replicated(tokens), self._replicated(logprobs))

    def _replicated(self, x: jax.Array) -> jax.Array:
        """`x` (sampled tokens or logprobs) on every device of the mesh: each host reads them from its own
        devices, also when the mesh spans hosts (`jaxrl.inference.lockstep`)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec()))


def _unembedding(params: Params) -> Params:
    """What `qwen3.logits` needs: the prepared `OutMajor` unembedding when `Engine.prepare` made one."""
    return {"unembed": params["unembed"]} if "unembed" in params else params["base"]


def _unembedding_rows(params: Params) -> jax.Array:
    """The unembedding as [V, D] rows, for `sample_unembedded`: the prepared `OutMajor`'s, else the base's
    [D, V] `qwen3.unembed_matrix` transposed (for a tied embedding, XLA cancels the two transposes)."""
    w = qwen3.unembed_matrix(_unembedding(params))
    return w.w_OI if isinstance(w, OutMajor) else w.T


def pad_prompt(prompt_ids: list[int], bucket: int) -> jax.Array:
    """Right-pad `prompt_ids` with zeros to `bucket` tokens (int32 [bucket])."""
    return jnp.asarray(list(prompt_ids) + [0] * (bucket - len(prompt_ids)), jnp.int32)
