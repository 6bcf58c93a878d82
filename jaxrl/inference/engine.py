"""The inference engine, with JetStream's Engine API (prefill / insert / generate over decode slots).

A decode state holds `B = max_concurrent_decodes` slots. `prefill` runs one prompt (right-padded to a length
bucket) through the model, keeps its key/value cache as a `Prefix` and samples the first token; `insert`
copies a prefix into a free slot; `generate` advances every slot by one token, `generate_steps` by up to
`decode_steps_per_dispatch` in one program (an on-device loop; each slot stops at its stop token or budget).
Sampling runs on device (`jaxrl.inference.sampling`: temperature, top_p, top_k, min_p, repetition penalty,
`min_tokens`, per-slot PRNG keys), and every sampled token comes with its logprob under the sampling
distribution after temperature, `log_softmax(logits / T)` of the logits as the penalty and `min_tokens`' ban
left them (the trainer recomputes the same quantity from the raw logits; with T = 0, greedy, T = 1 is used
for the logprob), and, for a request that asks for `top_logprobs`, the most likely tokens of that same distribution
(`sampling.sample_with_top`, in a variant of each step compiled with `top`; ordinary steps neither compile
nor run it). The truncations cut the distribution that is sampled from but not the reported logprob, as in
vLLM's default. `min_tokens` is counted per slot on device (`DecodeState.generated`): while a slot has
sampled fewer, its stop tokens (`DecodeState.stop`) are banned, in the same compiled decode step for every
request. Both jitted steps rebuild the model, `jaxrl.model.modules.Model`, over the engine params' arrays
(`modules.bind`: `nnx.merge`, no copies, so the engine reads the trainer's base weights in place): prefill
calls it (`decoder.forward`), a decode step calls `Model.decode` (`jaxrl.model.decode`, the same layers with a
bandwidth-minded attention over the cache). How the engine holds its KV cache is its `kv`, a kind of
`jaxrl.kv` (picked once by `jaxrl.kv.pick`); how it holds its weights and samples its `weights`
(`jaxrl.inference.engine_params.EngineWeights`: the trainer's arrays in place on TPU and GPU, the CPU's
copies, `jaxrl.inference.cpu`, beside the CPU's cache). The decode state is donated to `insert` and
`generate`, so the cache is updated in place.

The method names and arguments follow `jetstream.engine.engine_api.Engine` (google-jetstream 0.2.2) so
that JetStream's orchestrator can drive this engine; `prefill` and `insert` take extra keyword
arguments for the per-request sampling settings, which JetStream's API has no slot for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.inference.cpu import CpuWeights
from jaxrl.inference.decode_state import DecodeState, Prefix, ResultSteps, ResultTokens
from jaxrl.inference.engine_params import EngineParams, EngineWeights, PlainWeights
from jaxrl.inference.protocol import MAX_TOP_LOGPROBS, SamplingParams
from jaxrl.inference.sampling import SlotSampling, mark_seen, sample_with_top, stop_ban
from jaxrl.inference.steps import pin_for, run_steps
from jaxrl.kv.kind import CacheKind
from jaxrl.kv.pick import pick
from jaxrl.model import kernels, modules
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.decoder import KVCache
from jaxrl.parallel.sharding import array_sharding

# decode steps an engine's scheduler dispatches as one program (`Engine.generate_steps`; `[jax]
# decode_steps_per_dispatch`): the host's work between steps (reading tokens, admitting, dispatching) is paid
# once per this many tokens a slot; figures and the choice: docs/benchmarks.md (2026-11-27)
DECODE_STEPS_PER_DISPATCH = 8


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

    Engine params (`EngineParams`) are what `prepare` makes of `{"base": params, "lora": lora_or_None}`
    (`weights`': the training arrays themselves on TPU and GPU; on CPU with its per-layer copies). LoRA
    products are scaled by `lora_scale` (alpha / rank). `max_seq_len` (S) is the cache length: prompt plus
    sampled tokens. `kv` (None: `jaxrl.kv.pick.pick`, from the mesh's platform and `kv_cache_tokens`: given,
    a paged cache of that many positions, `jaxrl.kv.paged`) is the KV cache's kind (`jaxrl.kv.kind.CacheKind`);
    `weights` (None: `PlainWeights` where the kind reads the trainer's weights, else `CpuWeights`) holds the
    weights and samples (`EngineWeights`). `decode_steps_per_dispatch` (k, `[jax] decode_steps_per_dispatch`)
    is the decode steps of one `generate_steps` program.

    Raises:
        ValueError: a given `kv` is for another model, slot count or cache length; k below 1.
    """

    cfg: ModelConfig
    mesh: Mesh
    max_concurrent_decodes: int
    max_seq_len: int
    lora_scale: float = 0.0
    cache_dtype: Any = jnp.float32
    kv: CacheKind | None = None
    kv_cache_tokens: int | None = None
    weights: EngineWeights | None = None
    decode_steps_per_dispatch: int = DECODE_STEPS_PER_DISPATCH

    def __post_init__(self) -> None:
        if self.decode_steps_per_dispatch < 1:
            raise ValueError(f"decode_steps_per_dispatch {self.decode_steps_per_dispatch}: must be >= 1")
        if self.kv is None:
            self.kv = pick(self.cfg, self.mesh, self.max_concurrent_decodes, self.max_seq_len, self.kv_cache_tokens)
        got = (self.kv.cfg, self.kv.slots, self.kv.max_seq_len)
        if got != (self.cfg, self.max_concurrent_decodes, self.max_seq_len):
            raise ValueError(f"KV cache for (model, slots, max_seq_len) {got[1:]} given to an engine of "
                             f"{(self.max_concurrent_decodes, self.max_seq_len)} (or another model)")
        if self.weights is None:
            self.weights = (PlainWeights(self.cfg) if self.kv.reads_training_weights
                            else CpuWeights(self.cfg, self.max_concurrent_decodes))
        self.pages = self.kv.allocator()  # the host side of a paged cache (`jaxrl.kv.pages`); None: dense
        self.search = kernels.sampler_search(kernels.platform_of(self.mesh))  # the sampler's thresholds' search
        self.max_prefill_length = self.max_seq_len - 1
        self.buckets = prefill_buckets(self.max_prefill_length)
        self._prefill_forward = jax.jit(self._prefill_forward_impl)
        self._prefill_sample = jax.jit(self._prefill_sample_impl, static_argnames=("truncate", "top"))
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,))
        self._copy_pages = jax.jit(self._copy_pages_impl, donate_argnums=(0,))
        self._extend_forward = jax.jit(self._extend_forward_impl)
        self._score = jax.jit(self._score_impl)
        self.prefills = 0  # prompts run through the model (a group's shared prompt once)
        self.prefill_tokens = 0  # positions they ran (a conversation's next turn: those after its kept pages)
        self._generate = jax.jit(self._generate_impl, donate_argnums=(1,),
                                 static_argnames=("truncate", "penalize", "ban", "chunks", "top"))
        self._generate_steps = jax.jit(self._generate_steps_impl, donate_argnums=(1,),
                                       static_argnames=("steps", "truncate", "penalize", "ban", "chunks", "top", "pin"))

    def prepare(self, params: Params) -> EngineParams:
        """Engine params for `prefill` / `generate` from `{"base", "lora"}` (`EngineWeights.prepare`)."""
        return self.weights.prepare(params)

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
        b = self.max_concurrent_decodes
        vec_sh = array_sharding(("batch",), (b,), self.mesh)

        def zeros(shape, axes, dtype=None):
            return jax.jit(lambda: jnp.zeros(shape, dtype or self.cache_dtype),
                           out_shardings=array_sharding(axes, shape, self.mesh))()

        cache = self.kv.cache(zeros)
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

    def score(self, params: EngineParams, token_ids: list[int]) -> list[tuple[float, int]]:
        """Each token's logprob given the tokens before it, at temperature 1 (the raw logits' log-softmax, as
        vLLM's `prompt_logprobs`), and its rank among the vocabulary (1: the most likely): the prompt run
        through the model once, padded to its prefill bucket, no cache kept. The first token has no context:
        (0.0, 1). Thread-safe beside the scheduler's steps (it reads `params`, writes nothing).

        Raises:
            ValueError: more tokens than `max_prefill_length`.
        """
        padded = pad_prompt(token_ids, self.bucket(len(token_ids)))
        logp_T, rank_T = jax.device_get(self._score(params, padded))
        return [(0.0, 1)] + [(float(lp), int(r)) for lp, r in zip(logp_T[:len(token_ids) - 1],
                                                                  rank_T[:len(token_ids) - 1], strict=True)]

    def prefill(self, *, params: EngineParams, existing_prefix: Prefix | None = None, padded_tokens: jax.Array,
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

    def prefill_shared(self, params: EngineParams, padded_tokens: jax.Array, true_length: int,
                       samplings: list[SamplingParams], keys: list[jax.Array],
                       pool: KVCache | None = None) -> list[Prefix]:
        """One prefix per request for requests with the same prompt (`prefill`'s arguments): the prompt
        runs through the model once (`_prefill_forward`, counted in `prefills`), then each request samples
        its first token from those logits with its own settings and key (`_prefill_sample`, a program of
        batch 1: the same numbers as a prefill of its own). The prefixes share the cache arrays (`insert`
        copies them). With a paged cache whose pool still holds this prompt's pages (a slot inserted from
        an earlier prefill of it, say an earlier rollout of the group), the forward does not run: the
        prefixes sample from that prefill's logits and share its pages (`Prefix.cache` None). Given the
        decode state's paged `pool`, a prompt that extends a kept sequence's tokens (`PageAllocator.match`:
        a conversation's next turn) runs only its positions after them (`_extend_forward`, reading the kept
        pages). `prefill` is this with one request; `jaxrl.compile.programs.compile_prefill` compiles the
        same two programs."""
        tokens_T, prompt, cache, logits_1V = jnp.asarray(padded_tokens, jnp.int32), (), None, None
        if self.pages is not None:  # the key of the prompt's pages
            prompt = tuple(int(t) for t in np.asarray(jax.device_get(tokens_T))[:true_length])
            logits_1V = self.pages.held(prompt)
        if logits_1V is None and pool is not None and (start := self.pages.match(prompt)):
            cache, logits_1V = self._extend(params, pool, prompt, start)
        elif logits_1V is None:
            cache, logits_1V = self._prefill_forward(params, tokens_T, jnp.int32(true_length))
            self.prefills += 1
            self.prefill_tokens += true_length
        out = []
        for params_i, key in zip(samplings, keys, strict=True):
            sampling, length = SlotSampling.of(params_i), jnp.int32(true_length)
            parts = self._prefill_sample(logits_1V, tokens_T, length, sampling, key, self._stop_tokens(params_i),
                                         truncate=params_i.truncates, top=self.top_for([params_i]))
            out.append(Prefix(cache, *parts[:2], length, sampling, *parts[2:], logits=logits_1V, prompt=prompt))
        return out

    def _extend(self, params: EngineParams, pool: KVCache, prompt: tuple[int, ...],
                start: int) -> tuple[KVCache, jax.Array]:
        """`prompt`'s cache {"k","v"} [L, 1, S, K, H] (S: whole pages over the smallest bucket that holds
        it) and its logits [1, V], from the pages `PageAllocator.match` pinned for its first `start`
        positions and a forward over the rest, padded to a bucket (counted in `prefills`, `prefill_tokens`)."""
        page, new = self.pages.page, len(prompt) - start
        n = -(-self.bucket(len(prompt)) // page)
        read = np.zeros((n,), np.int32)
        pinned = self.pages.pinned(prompt)
        read[:len(pinned)] = pinned
        tokens = pad_prompt(list(prompt[start:]), self.bucket(new))
        self.prefills += 1
        self.prefill_tokens += new
        return self._extend_forward(params, {n: x for n, x in pool.items() if n != "pages"}, jnp.asarray(read), tokens,
                                    jnp.int32(start), jnp.int32(new))

    @staticmethod
    def top_for(samplings: list[SamplingParams]) -> int:
        """The `top` to compile a prefill or decode step with for requests with `samplings`: 0 when none asks
        for `top_logprobs`, else `MAX_TOP_LOGPROBS` (one variant for any k; each request keeps its first k)."""
        return MAX_TOP_LOGPROBS if any(p.top_logprobs for p in samplings) else 0

    def _stop_tokens(self, sampling: SamplingParams) -> np.ndarray:
        """`sampling`'s stop tokens as bool [V] (ids past the vocabulary dropped: never sampled)."""
        stop_V = np.zeros((self.cfg.vocab_size,), np.bool_)
        stop_V[[t for t in sampling.stop_token_ids if t < self.cfg.vocab_size]] = True
        return stop_V

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Copy `prefix` into decode slot `slot` (the decode state's buffers are donated). With a paged
        layout the slot's old pages are returned and the prompt's assigned (`PageAllocator.assign`: shared
        with the slots that hold the same prompt's pages, else written from the prefix's cache, but for the
        whole pages of a kept sequence it extends, `prefill_shared`, which are shared).

        Raises:
            PoolExhausted: a paged cache's pool has too few free pages for the prompt.
            ValueError: a prefix without its cache whose prompt's pages are no longer held.
        """
        pages = None
        if (alloc := self.pages) is not None:
            length = int(prefix.length)
            whole = len(prefix.prompt) == length  # JetStream's rewound prefix is not its prompt's: not shared
            if prefix.cache is None and alloc.held(prefix.prompt) is None:
                raise ValueError(f"a prefix of {length} tokens shares pages that were released since its prefill; "
                                 "prefill it again")
            bucket = self.bucket(length) if prefix.cache is None else jax.tree.leaves(prefix.cache)[0].shape[2]
            pages = jnp.asarray(alloc.assign(slot, length, bucket, prefix.prompt if whole else None, prefix.logits))
        prefix = prefix.replace(logits=None, prompt=())
        if prefix.top_ids.shape[1]:  # not inserted: dropped, so that one compiled insert serves every prefix
            prefix = prefix.replace(top_ids=prefix.top_ids[:, :0], top_logprobs=prefix.top_logprobs[:, :0])
        return self._insert(prefix, decode_state, jnp.int32(slot), pages)

    def metrics(self) -> dict[str, float]:
        """`engine/prefills` (prompts run through the model, since the start) and, with a paged cache,
        `engine/prefix_hits` (inserts that shared a prompt's pages or a kept sequence's, since the start),
        `engine/prefill_tokens` (positions prefills ran) and `engine/prefix_tokens` (prompt positions
        inserts shared instead, since the start), `engine/kv_pages` (pages slots hold now) and
        `engine/kv_kept_pages` (pages kept sequences hold now, `PageAllocator.retire`)."""
        if (alloc := self.pages) is None:
            return {"engine/prefills": float(self.prefills)}
        return {"engine/prefills": float(self.prefills), "engine/prefix_hits": float(alloc.prefix_hits),
                "engine/prefill_tokens": float(self.prefill_tokens),
                "engine/prefix_tokens": float(alloc.prefix_tokens), "engine/kv_pages": float(alloc.in_use),
                "engine/kv_kept_pages": float(alloc.kept)}

    def release(self, slot: int) -> None:
        """Return the pages of `slot`, whose request finished or was cancelled (a dense cache: nothing)."""
        if (alloc := self.pages) is not None:
            alloc.release(slot)

    def generate(self, params: EngineParams, decode_state: DecodeState, truncate: bool = True, penalize: bool = True,
                 ban: bool = True, chunks: int | None = None, top: int = 0) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot (the decode state's buffers are donated). `truncate=False`
        skips min_p / top_k / top_p, `penalize=False` the repetition penalty and its bookkeeping, and
        `ban=False` the `min_tokens` ban (`stop_ban`): faster, for when no active slot uses them (no
        slot still short of its `min_tokens`, for `ban`); with all three off the CPU's weights may sample
        without the [B, V] logits (`jaxrl.inference.cpu`).
        `chunks` (`cache_chunks`; None: all): the step reads and writes only the part of the cache that
        holds positions before those, so attention reads the positions in use, not `max_seq_len`: every
        slot that matters must be at a position it holds; a slot past it samples from a truncated cache.
        A slot's numbers are the same, bit for bit, for any `chunks` that holds its position
        (`jaxrl.kv.chunked.Chunked.attend`). `top` (`top_for`; 0: none): each slot's `top` most likely tokens
        come back in the result, all slots sampling from the [B, V] logits (the CPU's blocked sampler,
        `cpu.blocked_sampling_pays`, then sits the step out: the same distribution, its tokens the same up to
        float rounding at a chunk boundary). Each combination compiles once."""
        decode_state = self._pages_for(decode_state, None)
        return self._generate(params, decode_state, truncate=truncate, penalize=penalize, ban=ban, chunks=chunks,
                              top=top)

    def generate_steps(self, params: EngineParams, decode_state: DecodeState, budget_B: np.ndarray,
                       truncate: bool = True, penalize: bool = True, ban: bool = True, chunks: int | None = None,
                       top: int = 0) -> tuple[DecodeState, ResultSteps]:
        """Up to `decode_steps_per_dispatch` (k) decode steps for every slot in one program, an on-device loop
        (`lax.while_loop`), as tpu-inference's multi-step decode: the host sees the engine once per k steps.
        Slot b runs at most `budget_B[b]` (int [B], host; 0: a free slot) of them and none after it samples
        one of its stop tokens (`DecodeState.stop`; a slot whose input token already is one runs none): a
        stopped slot keeps its state (`_step`'s mask) and its step's numbers are those of `generate`'s, step
        for step, bit for bit up to XLA's fusion of the loop's body. The loop ends once no slot runs. A paged
        cache first gives each held slot the pages of the `budget_B` positions it may write
        (`PageAllocator.step`). `chunks` must hold every position a slot may feed (its position +
        budget - 1); the other arguments as `generate`'s. Each combination compiles once.

        Returns:
            The decode state (the input's buffers donated) and the steps' tokens (`ResultSteps`).
        """
        decode_state = self._pages_for(decode_state, budget_B := np.asarray(budget_B, np.int32))
        return self._generate_steps(params, decode_state, jnp.asarray(budget_B), steps=self.decode_steps_per_dispatch,
                                    truncate=truncate, penalize=penalize, ban=ban, chunks=chunks, top=top,
                                    pin=pin_for(params, self.mesh))

    def _pages_for(self, decode_state: DecodeState, ahead_B: np.ndarray | None) -> DecodeState:
        """With a paged cache, `decode_state` with each held slot given the pages of its next `ahead_B[slot]`
        positions (None: one; `PageAllocator.step`), shared ones copied first, and the page table put on the
        device if it changed; a dense cache's as it is."""
        if (alloc := self.pages) is None:
            return decode_state
        b = self.max_concurrent_decodes
        copies = alloc.step(ahead_B)
        for i in range(0, len(copies), b):  # a slot copies at most its prompt's partial page: one batch
            src, dst = np.zeros((2, b), np.int32)  # padding: scratch to scratch
            part = copies[i:i + b]
            src[:len(part)], dst[:len(part)] = zip(*part, strict=True)
            decode_state = self._copy_pages(decode_state, jnp.asarray(src), jnp.asarray(dst))
        if alloc.dirty:
            # a copy: on CPU device_put may alias the host array, which later inserts change
            table = jax.device_put(alloc.table.copy(), decode_state.cache["pages"].sharding)
            decode_state = decode_state.replace(cache={**decode_state.cache, "pages": table})
            alloc.dirty = False
        return decode_state

    def cache_chunks(self, positions: int) -> int | None:
        """`generate`'s `chunks` for slots at positions below `positions` (`CacheKind.chunks`: on CPU the
        fewest cache chunks that hold them; None, the whole cache, elsewhere)."""
        return self.kv.chunks(positions)

    # jitted bodies --------------------------------------------------------------------------------
    def _prefill_forward_impl(self, params, tokens_T, true_length):
        """The prompt's cache {"k","v"} [L, 1, T, K, H] and the logits after its last token, [1, V]
        (through the per-layer copy where `weights.prepare` made one, as decode steps)."""
        t = tokens_T.shape[0]
        model = modules.bind(self.cfg, params.base, params.lora, self.lora_scale)
        hidden_BTD, kv = model(tokens_T[None], jnp.arange(t, dtype=jnp.int32)[None], mesh=self.mesh,
                               layers=params.layers)
        last_BD = jax.lax.dynamic_index_in_dim(hidden_BTD[0], true_length - 1, keepdims=True)
        logits_BV = self.weights.logits(params, last_BD[None])[:, 0]
        return {k: v.astype(self.cache_dtype) for k, v in kv.items()}, logits_BV

    def _score_impl(self, params, tokens_T):
        """log softmax(logits)[next token] and its rank at each position but the last: float32, int32 [T - 1]."""
        t = tokens_T.shape[0]
        model = modules.bind(self.cfg, params.base, params.lora, self.lora_scale)
        hidden_BTD, _ = model(tokens_T[None], jnp.arange(t, dtype=jnp.int32)[None], mesh=self.mesh,
                              layers=params.layers)
        logits_TV = self.weights.logits(params, hidden_BTD)[0, :-1].astype(jnp.float32)
        picked_T = jnp.take_along_axis(logits_TV, tokens_T[1:, None], axis=1)[:, 0]
        logp_T = picked_T - jax.nn.logsumexp(logits_TV, axis=1)
        return logp_T, 1 + jnp.sum(logits_TV > picked_T[:, None], axis=1, dtype=jnp.int32)

    def _prefill_sample_impl(self, logits_BV, tokens_T, true_length, sampling, key, stop_V, *, truncate, top=0):
        """The first token and its logprob [1], the slot's next key, seen and stop tokens [1, V], and the
        `top` most likely tokens and their logprobs [1, top]."""
        t = tokens_T.shape[0]
        prompt_T = jnp.where(jnp.arange(t) < true_length, tokens_T, self.cfg.vocab_size)  # padding: dropped
        seen_BV = jnp.zeros((1, self.cfg.vocab_size), jnp.bool_).at[0, prompt_T].set(True, mode="drop")
        key, sub = jax.random.split(key)
        stop_BV = stop_V[None]
        token, logprob, top_ids, top_lps = sample_with_top(
            logits_BV, sampling, sub[None], truncate=truncate, seen_BV=seen_BV,
            ban_BV=stop_ban(stop_BV, jnp.zeros((1,), jnp.int32), sampling.min_tokens), top=top, search=self.search)
        token, logprob, top_ids, top_lps = (self._replicated(x) for x in (token, logprob, top_ids, top_lps))
        return token, logprob, key, mark_seen(seen_BV, token), stop_BV, top_ids, top_lps

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, pages=None):
        def put1(dst, src):
            return jax.lax.dynamic_update_slice(dst, src, (slot,))

        cache = self.kv.insert(state.cache, prefix.cache, slot, pages)
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

    def _extend_forward_impl(self, params, pool, read_N, tokens_T, start, true_length):
        """`_prefill_forward_impl` for positions `start` .. `start` + `true_length` - 1 of a prompt whose
        earlier ones are in pool pages `read_N` (int32 [N], 0 past them): those pages gathered into a dense
        [L, 1, N * page, K, H] cache, which `tokens_T` (padded; positions past N * page are dropped) is
        written into and attends over (`decoder.forward` with a cache: a query reads keys at positions <= its
        own). Returns that cache, in the pool's dtype, and the logits after the last token, [1, V]."""
        t = tokens_T.shape[0]
        cache = self.kv.extend_cache(pool, read_N)
        model = modules.bind(self.cfg, params.base, params.lora, self.lora_scale)
        hidden_BTD, kv = model(tokens_T[None], (start + jnp.arange(t, dtype=jnp.int32))[None], cache=cache,
                               mesh=self.mesh)
        last_BD = jax.lax.dynamic_index_in_dim(hidden_BTD[0], true_length - 1, keepdims=True)
        return kv, self.weights.logits(params, last_BD[None])[:, 0]

    def _copy_pages_impl(self, state: DecodeState, src_B, dst_B) -> DecodeState:
        """`state` with pool pages `src_B` copied to `dst_B` (int32 [B] each: `jaxrl.kv.paged.Paged.copy_pages`)."""
        return state.replace(cache=self.kv.copy_pages(state.cache, src_B, dst_B))

    def _generate_impl(self, params, state: DecodeState, *, truncate, penalize, ban=True, chunks=None, top=0):
        new, result = self._step(params, state, None, truncate=truncate, penalize=penalize, ban=ban, chunks=chunks,
                                 top=top)
        return new, ResultTokens(*(self._replicated(x) for x in result))

    def _generate_steps_impl(self, params, state: DecodeState, budget_B, *, steps, truncate, penalize, ban=True,
                             chunks=None, top=0, pin=None):
        """`steps` masked `_step`s in one program (`jaxrl.inference.steps.run_steps`, with `pin`; `generate_steps`)."""

        def step(p: EngineParams, s: DecodeState, live_B: jax.Array):
            return self._step(p, s, live_B, truncate=truncate, penalize=penalize, ban=ban, chunks=chunks, top=top)

        state, out, counts_B = run_steps(step, params, state, budget_B, steps=steps, top=top, pin=pin)
        return state, ResultSteps(*(self._replicated(x) for x in (*out, counts_B)))

    def _step(self, params, state: DecodeState, live_B, *, truncate, penalize, ban, chunks, top):
        """One decode step of every slot: the next state and (tokens int32 [B], logprobs float32 [B], top ids
        int32 [B, top], top logprobs float32 [B, top]). `live_B` (bool [B]; None: all) masks the slots that
        do not advance: their token, position, key, seen tokens and count stay as they were. Their step
        still runs and writes its key and value, those of their input token at their position, past the
        last position they hold (so their cache holds the same numbers; no kind needs a masked write)."""
        model = modules.bind(self.cfg, params.base, params.lora, self.lora_scale)
        hidden_BTD, cache = self.kv.decode(model, params.layers, state.tokens, state.positions, state.cache, chunks,
                                           self.mesh)
        keys, (tokens, lps, *alt) = self.sample_slots(params, state, hidden_BTD[:, 0], truncate, penalize, ban, top)
        positions, step_B = jnp.minimum(state.positions + 1, self.max_seq_len - 1), 1
        if live_B is not None:  # the input token is marked seen already: a masked slot marks it again
            tokens, positions = jnp.where(live_B, tokens, state.tokens), jnp.where(live_B, positions, state.positions)
            keys, step_B = jnp.where(live_B, keys, state.keys), live_B.astype(jnp.int32)
        seen = mark_seen(state.seen, tokens) if penalize else state.seen
        new = DecodeState(cache=cache, tokens=tokens, positions=positions, sampling=state.sampling,
                          keys=keys, seen=seen, stop=state.stop, generated=state.generated + step_B)
        return new, (tokens, lps, *alt)

    def sample_slots(self, params, state: DecodeState, hidden_BD, truncate, penalize, ban, top):
        """Each slot's next key and (tokens, logprobs, top ids, top logprobs) from its hidden state [B, D] (traced;
        `generate`'s flags, `state`'s settings, stop and seen tokens): `_step`'s and the ragged step's."""
        split = jax.vmap(jax.random.split)(state.keys)
        rules = {"truncate": truncate, "seen_BV": state.seen if penalize else None,
                 "ban_BV": stop_ban(state.stop, state.generated, state.sampling.min_tokens) if ban else None,
                 "search": self.search}
        if top:  # the alternatives need the [B, V] logits: every `weights.sample` samples from these
            return split[:, 0], sample_with_top(self.weights.logits(params, hidden_BD[:, None])[:, 0], state.sampling,
                                                split[:, 1], top=top, **rules)
        tokens, logprobs = self.weights.sample(params, hidden_BD, state.sampling, split[:, 1], **rules)
        return split[:, 0], (tokens, logprobs, jnp.zeros((tokens.shape[0], 0), jnp.int32),
                             jnp.zeros((tokens.shape[0], 0), jnp.float32))

    def _replicated(self, x: jax.Array) -> jax.Array:
        """`x` (sampled tokens or logprobs) on every device of the mesh: each host reads them from its own
        devices, also when the mesh spans hosts (`jaxrl.inference.lockstep`)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec()))


def pad_prompt(prompt_ids: list[int], bucket: int) -> jax.Array:
    """Right-pad `prompt_ids` with zeros to `bucket` tokens (int32 [bucket])."""
    return jnp.asarray(list(prompt_ids) + [0] * (bucket - len(prompt_ids)), jnp.int32)
