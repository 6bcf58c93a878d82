"""Chunked prefill over the ragged paged KV cache (`jaxrl.kv.ragged.RaggedPaged`, TPU's): an admitted prompt
is fed to the model in chunks, in the same compiled step as every running slot's decode token, one ragged
step of a fixed number of flat tokens a dispatch (`RaggedSteps`), as vLLM V1 and tpu-inference schedule
it. A long prompt then never holds the decode slots still while it prefills, and no prefill bucket is
compiled beside the decode step. While no prompt is being fed (every slot decoding), a dispatch runs the
engine's `decode_steps_per_dispatch` (k) steps in one program instead (`RaggedSteps.decode`: the on-device
loop of `jaxrl.inference.steps.run_steps` over the same ragged step, each slot stopping at its stop token
or its length, as the bucketed `Scheduler`'s `Engine.generate_steps`), so the host sees the engine once per
k tokens; a prompt admitted meanwhile waits for that dispatch, then is fed beside the decode tokens again.

`ChunkedScheduler` is `jaxrl.inference.scheduler.Scheduler` with its admission and its step replaced: a
request admitted into a free slot gets the pages of its whole prompt and its sampling settings
(`RaggedSteps.begin`), nothing runs; each step then takes every decoding slot's one token and, in the tokens
left, the next chunk of each prompt still being fed (the first admitted first). The step that feeds a
prompt's last token samples its first token from there. Each of the k steps of a dispatch is the flat batch
of M tokens that a single step of the same slots would run, so a slot's tokens and logprobs are those of one
step a dispatch, bit for bit (a slot's row does not depend on the others').

A group's rollouts (any requests whose prompts start with the same whole pages) share those pages: the
whole pages before a prompt's last token's are fed once, by the first of them admitted, the others sharing
them (`PageAllocator.assign_prefix`, reference counted, as the bucketed path shares a prompt's pages) and
waiting until they are fed; each then feeds the rest of its prompt itself (under a page of tokens, into a
page of its own), so each samples its first token from its own last token and its numbers are those of a
request alone. A rollout admitted after the pages were fed (the group larger than the free slots) shares
them at once. The bucketed path shares the partial last page too and copies it on the first decode write;
here it is computed again per rollout instead, which no feeding slot waits on. With `keep_turns` (`[jax]
kv_reuse_turns`), a finished request's pages are kept as the bucketed path keeps them, and a prompt that
extends a kept sequence's tokens (a conversation's next turn) shares its whole pages and feeds the rest.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.inference.decode_state import DecodeState, ResultSteps, ResultTokens
from jaxrl.inference.engine import Engine
from jaxrl.inference.engine_params import EngineParams
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.request import Request, Sampled
from jaxrl.inference.sampling import SlotSampling
from jaxrl.inference.scheduler import Scheduler
from jaxrl.inference.steps import pin_for, run_steps
from jaxrl.kv.ragged import QUERY_BLOCK, Ragged, RaggedPaged, pack
from jaxrl.model import modules
from jaxrl.model.blocks import Params

PREFILL_CHUNK = 512  # prompt tokens a step feeds beside the decode tokens (vLLM's TPU default batch: 512-2,048)


@dataclasses.dataclass
class RaggedSteps:
    """The jitted programs of chunked prefill over `engine` (its kind a `RaggedPaged`): `begin` a slot and
    `step` a flat batch of `tokens` tokens (at least the engine's slots; rounded up to the kernel's query
    blocks of `jaxrl.kv.ragged.QUERY_BLOCK`). The decode state is donated to both."""

    engine: Engine
    tokens: int

    def __post_init__(self) -> None:
        self.tokens = -(-max(self.tokens, self.engine.max_concurrent_decodes) // QUERY_BLOCK) * QUERY_BLOCK
        self._begin = jax.jit(self._begin_impl, donate_argnums=(0,))
        flags = ("truncate", "penalize", "ban", "top")
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), static_argnames=flags)
        self._steps = jax.jit(self._steps_impl, donate_argnums=(1,), static_argnames=("steps", "pin", *flags))

    def begin(self, state: DecodeState, slot: int, params: SamplingParams, key: jax.Array,
              prompt: list[int]) -> DecodeState:
        """`state` with `slot`'s sampling settings, PRNG key and stop tokens, its `prompt`'s tokens seen (for
        the repetition penalty, as a prefill counts them: also those it shares, `ChunkedScheduler`, and does
        not feed), nothing sampled yet."""
        seen_V = np.zeros((self.engine.cfg.vocab_size,), np.bool_)
        seen_V[prompt] = True
        return self._begin(state, jnp.int32(slot), SlotSampling.of(params), key,
                           jnp.asarray(self.engine._stop_tokens(params)), jnp.asarray(seen_V))

    def step(self, params: EngineParams, state: DecodeState, tokens_M: np.ndarray, batch: Ragged,
             last_B: np.ndarray, emit_B: np.ndarray, **flags) -> tuple[DecodeState, ResultTokens]:
        """One ragged step (`_step_impl`; `flags` are `Engine.generate`'s truncate, penalize, ban and top)."""
        return self._step(params, state, jnp.asarray(tokens_M), jax.tree.map(jnp.asarray, batch),
                          jnp.asarray(last_B), jnp.asarray(emit_B), **flags)

    def _begin_impl(self, state: DecodeState, slot, sampling: SlotSampling, key, stop_V, seen_V) -> DecodeState:
        def put(dst, src):
            return jax.lax.dynamic_update_slice(dst, src, (slot,) + (0,) * (dst.ndim - 1))

        return state.replace(sampling=jax.tree.map(put, state.sampling, sampling), keys=put(state.keys, key[None]),
                             seen=put(state.seen, seen_V[None]), stop=put(state.stop, stop_V[None]),
                             generated=put(state.generated, jnp.zeros((1,), jnp.int32)))

    def decode(self, params: EngineParams, state: DecodeState, batch: Ragged, last_B: np.ndarray,
               budget_B: np.ndarray, **flags) -> tuple[DecodeState, ResultSteps]:
        """Up to the engine's `decode_steps_per_dispatch` (k) decode steps of the slots in `batch` in one
        program (`_steps_impl`), slot b running at most `budget_B[b]` (int32 [B]) and none after a stop
        token (`jaxrl.inference.steps.run_steps`, as `Engine.generate_steps`); `flags` as `step`'s."""
        return self._steps(params, state, jax.tree.map(jnp.asarray, batch), jnp.asarray(last_B),
                           jnp.asarray(budget_B), steps=self.engine.decode_steps_per_dispatch,
                           pin=pin_for(params, self.engine.mesh), **flags)

    def _step_impl(self, params, state: DecodeState, tokens_M, batch: Ragged, last_B, emit_B, *, truncate, penalize,
                   ban, top):
        state, result = self._ragged(params, state, tokens_M, batch, last_B, emit_B, truncate=truncate,
                                     penalize=penalize, ban=ban, top=top)
        return state, ResultTokens(*(self.engine._replicated(x) for x in result))

    def _steps_impl(self, params, state: DecodeState, batch: Ragged, last_B, budget_B, *, steps, truncate, penalize,
                    ban, top, pin=None):
        """`steps` masked ragged steps (`_ragged`) in one `run_steps` loop. `batch` holds one token for each
        decoding slot, placed as `pack` placed it for the first step; each step moves its positions to the
        slots' positions then, so that every step is the flat batch of M tokens a single step of those
        slots would run, and a slot's numbers are that step's (a slot's row does not depend on the others').
        `pin`: `run_steps`' (`jaxrl.inference.steps.pin_for` of `params`)."""
        seq_S = jnp.arange(batch.kv_lens.shape[0]) < batch.num_seqs[0]
        tokens_M = jnp.where(batch.valid, -1, 0)  # each slot's last sampled token; padding as `step`'s

        def step(p: EngineParams, s: DecodeState, live_B: jax.Array):
            at = batch.replace(positions=jnp.where(batch.valid, s.positions[batch.slots], 0),
                               kv_lens=jnp.where(seq_S, s.positions[batch.seq_slots] + 1, 0))
            return self._ragged(p, s, tokens_M, at, last_B, live_B, truncate=truncate, penalize=penalize,
                                ban=ban, top=top)

        state, out, counts_B = run_steps(step, params, state, budget_B, steps=steps, top=top, pin=pin)
        return state, ResultSteps(*(self.engine._replicated(x) for x in (*out, counts_B)))

    def _ragged(self, params, state: DecodeState, tokens_M, batch: Ragged, last_B, emit_B, *, truncate, penalize,
                ban, top) -> tuple[DecodeState, tuple[jax.Array, ...]]:
        """The M tokens (`tokens_M` int32 [M]; a token < 0 is its slot's last sampled one, `state.tokens`)
        through the model (`RaggedPaged.step`), then each slot's next token sampled from the hidden state of
        its last token this step (`last_B`, int32 [B], indices into M): kept where `emit_B` (bool [B]: a
        decoding slot, or a prompt fed to its end), the rest of `state` as it was (its prompt's tokens seen
        since `begin`). Returns the state and (tokens int32 [B], logprobs float32 [B], top ids int32 [B,
        top], top logprobs float32 [B, top])."""
        e = self.engine
        tokens_M = jnp.where(tokens_M < 0, state.tokens[batch.slots], tokens_M)
        model = modules.bind(e.cfg, params.base, params.lora, e.lora_scale)
        hidden_MD, cache = e.kv.step(model, tokens_M, batch, state.cache, e.mesh, params.layers)
        keys, sampled = e.sample_slots(params, state, hidden_MD[last_B], truncate, penalize, ban, top)
        tokens = jnp.where(emit_B, sampled[0], state.tokens)
        keys = jax.random.wrap_key_data(jnp.where(emit_B[:, None], jax.random.key_data(keys),
                                                  jax.random.key_data(state.keys)))
        new = DecodeState(cache=cache, tokens=tokens, positions=jnp.where(emit_B, batch.positions[last_B] + 1,
                                                                          state.positions),
                          sampling=state.sampling, keys=keys,
                          seen=state.seen.at[jnp.arange(tokens.shape[0]), jnp.where(emit_B, tokens, e.cfg.vocab_size)]
                          .set(True, mode="drop") if penalize else state.seen, stop=state.stop,
                          generated=state.generated + emit_B.astype(jnp.int32))
        return new, sampled


class ChunkedScheduler(Scheduler):
    """`Scheduler` for an engine over a `RaggedPaged` cache: prompts fed in chunks beside the decode tokens
    (the module's), in steps of the slots and `prefill_chunk` more tokens (`RaggedSteps.tokens`), all of
    which a prompt's chunk may use. Arguments as `Scheduler`'s: with `keep_turns`, a prompt that extends a
    kept sequence's tokens shares its whole pages and feeds the rest (`_admit`).

    Raises:
        ValueError: the engine's cache is not a `RaggedPaged`.
    """

    def __init__(self, engine: Engine, params: Params, model_name: str, seed: int = 0, keep_turns: bool = False,
                 prefill_chunk: int = PREFILL_CHUNK) -> None:
        if not isinstance(engine.kv, RaggedPaged):
            raise ValueError(f"chunked prefill runs over a RaggedPaged cache, not {type(engine.kv).__name__}")
        self.steps = RaggedSteps(engine, engine.max_concurrent_decodes + prefill_chunk)
        self._fed: dict[int, int] = {}  # slot -> prompt positions its pages hold (fed, or shared and fed)
        self._feeders: dict[tuple[int, ...], int] = {}  # whole pages' tokens -> the slot feeding them, until fed
        self._waits: dict[int, tuple[int, int]] = {}  # slot -> (the slot feeding its shared pages, positions)
        super().__init__(engine, params, model_name, seed, keep_turns)  # starts the loop: everything it reads is set

    def _admit(self, admit: list[Request]) -> None:
        """Each live request into a free slot, in order: the pages of its whole prompt and its settings. Its
        prompt's whole pages before its last token's are shared with a slot that holds them
        (`PageAllocator.assign_prefix`: a group's rollouts, admitted together or not), which may still be
        feeding them (then it waits, `_waits`, until they are fed); it feeds the rest itself, so that its
        first token is sampled from its own last token's hidden state. With `keep_turns`, a prompt that
        extends a kept sequence's tokens (`PageAllocator.match`: a conversation's next turn) shares that
        sequence's whole pages instead, fed already."""
        page = self.engine.pages.page
        for req in admit:
            if self._dropped(req):
                continue
            key = self._key(req)
            req.slot = slot = self._slots.index(None)
            prompt = tuple(req.prompt_ids)
            prefix = prompt[:(len(prompt) - 1) // page * page]
            kept = prompt if self.keeps and self.engine.pages.match(prompt) else None
            shared = self.engine.pages.assign_prefix(slot, len(prompt), prefix, kept)
            self._state = self.steps.begin(self._state, slot, req.params, key, req.prompt_ids)
            self._slots[slot], self._fed[slot] = req, shared
            if kept is None and shared and (feeder := self._feeders.get(prefix)) is not None:
                self._fed[slot], self._waits[slot] = 0, (feeder, shared)
            elif kept is None and prefix and not shared:
                self._feeders[prefix] = slot
            req.admitted = self._admitted = self._admitted + 1
            req.epoch = self._epoch

    def _release(self, req: Request, keep: bool = False) -> None:
        """`Scheduler._release`; where `req`'s slot was feeding whole pages that others wait for, the first
        admitted of them feeds on from where it stopped (its pages hold those positions too)."""
        slot = req.slot
        super()._release(req, keep)
        if slot is None:
            return
        fed = self._fed.pop(slot, 0)
        self._waits.pop(slot, None)
        prefixes = [p for p, s in self._feeders.items() if s == slot]
        waiting = sorted((w for w, (s, _) in self._waits.items() if s == slot), key=lambda w: self._slots[w].admitted)
        for prefix in prefixes:
            del self._feeders[prefix]
        if waiting:
            heir = waiting.pop(0)
            self._fed[heir] = fed
            del self._waits[heir]
            self._waits.update({w: (heir, self._waits[w][1]) for w in waiting})
            self._feeders.update(dict.fromkeys(prefixes, heir))

    def _fed_up_to(self, slot: int, fed: int) -> None:
        """`slot`'s pages hold its prompt's first `fed` positions: the slots waiting for those (`_waits`) go
        on from their shared positions."""
        self._fed[slot] = fed
        for w, (s, shared) in list(self._waits.items()):
            if s == slot and fed >= shared:
                self._fed[w] = shared
                del self._waits[w]
        for prefix in [p for p, s in self._feeders.items() if s == slot and fed >= len(p)]:
            del self._feeders[prefix]

    def _plan(self, active: list[tuple[int, Request]]) -> tuple[list[tuple[int, int, int]], list[int], np.ndarray]:
        """This step's runs (slot, first position, tokens) and tokens (-1: the slot's last sampled one), and
        which slots sample a kept token: every decoding slot's one token, then the prompts still fed, first
        admitted first, in the tokens left (none for a slot waiting for shared pages)."""
        runs, tokens, emit = [], [], np.zeros((len(self._slots),), bool)
        for slot, req in active:
            if self._fed[slot] == len(req.prompt_ids):
                runs.append((slot, len(req.prompt_ids) + req.dispatched - 1, 1))
                tokens.append(-1)
                emit[slot] = True
        left = self.steps.tokens - len(runs)
        for slot, req in sorted(active, key=lambda a: a[1].admitted):
            fed, prompt = self._fed[slot], req.prompt_ids
            if fed < len(prompt) and left > 0 and slot not in self._waits:
                n = min(left, len(prompt) - fed)
                runs.append((slot, fed, n))
                tokens += prompt[fed:fed + n]
                emit[slot], left = fed + n == len(prompt), left - n
        return runs, tokens, emit

    def _step(self) -> None:
        """Dispatch over the occupied slots, if any: while every one decodes (no prompt left to feed), up to
        the engine's `decode_steps_per_dispatch` (k) decode steps in one program (`Scheduler._decode`, over
        `_steps`), else one ragged step (`_feed`): while a prompt is fed, every decoding slot advances a
        token a step, and a prompt admitted during a dispatch of k waits for that dispatch only."""
        for req in self._slots:
            if req is not None and self._dropped(req):
                req.done = True
                self._release(req)
        self._make_room()
        rows = list(self._slots)
        active = [(slot, r) for slot, r in enumerate(rows) if r is not None]
        if not active:
            return
        if self.engine.decode_steps_per_dispatch > 1 and all(self._fed[s] == len(r.prompt_ids) for s, r in active):
            self._decode(rows)
        else:
            self._feed(rows, active)

    def _steps(self, budget_B: np.ndarray, active: list[Request],
               flags: dict[str, bool | int]) -> tuple[DecodeState, ResultSteps]:
        """`Scheduler._steps` over the ragged pool: `RaggedSteps.decode`, each step one token for each slot
        in the flat batch a ragged step of theirs places them in (`_plan`), pages for their budgets first."""
        runs, _, _ = self._plan([(r.slot, r) for r in sorted(active, key=lambda r: r.slot)])
        self._state = self.engine._pages_for(self._state, budget_B)
        return self.steps.decode(self._params, self._state, pack(runs, self.steps.tokens, len(self._slots)),
                                 self._lasts(runs), budget_B, **flags)

    def _lasts(self, runs: list[tuple[int, int, int]]) -> np.ndarray:
        """Each slot's last token in the flat batch of `runs` (`pack`'s order), int32 [B] (0: none)."""
        last = np.zeros((len(self._slots),), np.int32)
        for (slot, _, _), end in zip(runs, np.cumsum([n for _, _, n in runs]) - 1, strict=True):
            last[slot] = end
        return last

    def _feed(self, rows: list[Request | None], active: list[tuple[int, Request]]) -> None:
        """Dispatch one ragged step (`RaggedSteps.step`) over the `active` (slot, request) of `rows`: each
        decoding slot's token and the prompt chunks `_plan` gives."""
        runs, tokens, emit = self._plan(active)
        feeding = frozenset(s for s, r in active if self._fed[s] < len(r.prompt_ids))
        # a page for each decoding slot's position; none for a prompt being fed (`assign_prefix` gave it all)
        ahead = np.array([s not in feeding for s in range(len(rows))], np.int32)
        self._state = self.engine._pages_for(self._state, ahead)
        tokens_M = np.asarray(tokens + [0] * (self.steps.tokens - len(tokens)), np.int32)
        self._state, result = self.steps.step(self._params, self._state, tokens_M,
                                              pack(runs, self.steps.tokens, len(rows)), self._lasts(runs), emit,
                                              **self._flags([r for _, r in active]))
        self.decode_steps, self.dispatches = self.decode_steps + 1, self.dispatches + 1
        out = [r if emit[s] else None for s, r in enumerate(rows)]
        self._unread.append(Sampled(result.tokens, result.logprobs, out, self.policy_version, result.top_ids,
                                    result.top_logprobs))
        for slot, first, n in runs:
            req = rows[slot]
            if slot in feeding:
                self._fed_up_to(slot, first + n)
                self.engine.prefill_tokens += n
                self.engine.prefills += int(emit[slot])
            if emit[slot]:
                req.dispatched += 1
                if req.dispatched >= req.max_tokens:
                    self._release(req, keep=True)  # its tokens come with `_hand_out`


def chunked_prefill(engine: Engine) -> bool:
    """Whether `engine`'s scheduler feeds prompts through its ragged step (`ChunkedScheduler`: no prefill
    bucket; its decode program the loop of ragged steps, `RaggedSteps.decode`): over a `RaggedPaged` cache, the
    kind `jaxrl.kv.pick` gives a TPU (`keep_turns` or not)."""
    return isinstance(engine.kv, RaggedPaged)


def make_scheduler(engine: Engine, params: Params, model_name: str, seed: int = 0, keep_turns: bool = False,
                   prefill_chunk: int = PREFILL_CHUNK) -> Scheduler:
    """The scheduler for `engine`: `ChunkedScheduler` where `chunked_prefill`, else `Scheduler` (arguments as
    theirs)."""
    if chunked_prefill(engine):
        return ChunkedScheduler(engine, params, model_name, seed, keep_turns, prefill_chunk)
    return Scheduler(engine, params, model_name, seed, keep_turns=keep_turns)
