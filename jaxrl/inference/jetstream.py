"""JetStream (google-jetstream 0.2.2, the `jaxrl[jetstream]` extra) driving jaxrl's engine.

`JetStreamEngine` presents a `jaxrl.inference.engine.Engine` as JetStream's `engine_api.Engine`, so that
JetStream's own orchestrator (`Driver`: prefill, generate and detokenize threads) schedules it;
`in_process(...).decode` runs requests through `LLMOrchestrator.Decode` in this process, and `serve`
starts JetStream's gRPC server. Requests are greedy (JetStream's `DecodeRequest` has no sampling
settings) and come back as token ids (and text), without logprobs (JetStream's `ReturnSample` has
none), so this path serves models; RL rollouts stay on `jaxrl.inference.scheduler`.

Where the two APIs differ, the adapter translates:
- JetStream emits only what `generate` samples. So `prefill` hands over the prompt "rewound" by one
  token: its cache, with the last prompt token as the slot's next input at its own position. The first
  decode step recomputes that position and samples the first completion token; every token, first
  included, then comes out of `generate` (one decode step more per request than jaxrl's scheduler).
- `generate` returns JetStream's `ResultTokens`: int32 [B, 3] columns token / valid / length, where
  length counts the slot's emitted tokens (JetStream stops a request once it exceeds `max_tokens`) and
  valid is 0 once the KV cache (`max_seq_len`) is full, which ends the request there.
- The tokenizer is the model's Hugging Face tokenizer (`HFTokenizer`). JetStream puts `bos_id` before
  every prompt not continuing a session; a tokenizer without a BOS token (Qwen3) reports `NO_BOS`,
  which `prefill` drops. The stop tokens are the model's `eos_token_id`s; JetStream does not emit the
  stop token itself (jaxrl's scheduler does).
- `max_prefill_length` is the largest of JetStream's prefill buckets (powers of two from 16) that fits
  the engine; JetStream keeps the last that many tokens of a longer prompt (and logs a warning).

Shims for the 2024 release on current JAX, all confined to this module and applied only to JetStream's
own modules (`jax` itself is not touched):
1. `orchestrator.delete_pytree` calls `jax.tree_map`, removed in JAX 0.6; it is replaced at import by
   the same function over `jax.tree.map`. Without it the generate thread dies at the first insert.
2. Importing `orchestrator` sets the root logger to DEBUG with a stdout handler, which would print
   every DEBUG record of the process (JAX's included); the level and handlers are put back.
3. In-process (`in_process`), JetStream's worker threads (`JetThread`) would SIGKILL their own
   process on any error, the caller's included; they are built as `_ReportingThread`s, which keep the
   error for `decode` to raise. `serve` keeps JetStream's behaviour: a server with a dead worker exits,
   so its servicer (`_CheckedOrchestrator`) refuses requests the engine would fail on (`check_request`)
   with INVALID_ARGUMENT before they reach a worker.
4. `server_lib.JetStreamServer` binds every interface (`[::]`) with no parameter; `serve` binds
   `host` instead (swapping `_HOST`, and `LLMOrchestrator` for the checking servicer, while it builds).
5. JetStream frees a slot by putting it back on its queue of free slots (the detokenize thread, once the
   request is complete); the engine is not told. With a paged cache (`jaxrl.kv.paged`) the driver's
   queue's `put` first returns the slot's pages (`Engine.release`, under the adapter's lock: the generate
   thread inserts and steps under it), so the pages in use follow the requests in flight. JetStream gives
   the engine no request's `max_tokens`, so any slot may grow to `max_seq_len`: the adapter offers
   JetStream only as many slots as the pool holds whole sequences (`max_concurrent_decodes`), and an
   insert never finds the pool empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl.inference.decode_state import DecodeState, Prefix
from jaxrl.inference.engine import Engine, pad_prompt
from jaxrl.inference.engine_params import EngineParams
from jaxrl.inference.protocol import SamplingParams
from jaxrl.model.blocks import Params

_root = logging.getLogger()
_root_level, _root_handlers = _root.level, list(_root.handlers)
from jetstream.core import orchestrator, server_lib  # noqa: E402 - shim 2 needs the state before it
from jetstream.core.proto import jetstream_pb2  # noqa: E402
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402

_root.setLevel(_root_level)
for _h in set(_root.handlers) - set(_root_handlers):
    _root.removeHandler(_h)

log = logging.getLogger(__name__)

NO_BOS = -1  # `bos_id` of a tokenizer without one: never a token id, dropped by `prefill`
# JetStream's prefill lengths (`token_utils.pad_tokens`); its `max_prefill_length` must be one of them.
JETSTREAM_BUCKETS = tuple(2**k for k in range(4, 16))


def _delete_pytree(p: Any) -> None:
    """`orchestrator.delete_pytree` over `jax.tree.map` (shim 1): frees a prefix once it is inserted."""
    jax.tree.map(lambda leaf: leaf.delete() if isinstance(leaf, jax.Array) else None, p)


orchestrator.delete_pytree = _delete_pytree


class JetStreamError(RuntimeError):
    """A JetStream worker thread failed; the message names the thread and its error."""


class HFTokenizer(tokenizer_api.Tokenizer):
    """JetStream's tokenizer API over a Hugging Face `tokenizers.Tokenizer`, stopping at
    `stop_token_ids` (the model's end-of-turn ids; JetStream's default would add `pad_id`)."""

    def __init__(self, tokenizer: Any, stop_token_ids: Sequence[int]) -> None:
        if not stop_token_ids:
            raise ValueError("a JetStream tokenizer needs at least one stop token id")
        self._tok = tokenizer
        self._stop = tuple(stop_token_ids)
        plain, special = tokenizer.encode("a", add_special_tokens=False).ids, tokenizer.encode("a").ids
        self._bos = special[0] if len(special) > len(plain) and special[1:] == plain else NO_BOS

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        """The `tokenizer.json` in `folder`; stop ids: `eos_token_id` (an int or a list) of
        `generation_config.json`, else of `config.json`.

        Raises:
            ValueError: no `tokenizer.json` in `folder`, or no `eos_token_id` in either file.
        """
        from tokenizers import Tokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {folder}")
        stop: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if not stop and (folder / name).is_file():
                eos = json.loads((folder / name).read_text()).get("eos_token_id")
                stop = [eos] if isinstance(eos, int) else list(eos or [])
        if not stop:
            raise ValueError(f"no eos_token_id in {folder}/generation_config.json or config.json")
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), stop)

    def encode(self, s: str, **kwargs: Any) -> tuple[jax.Array, int]:
        """Token ids of `s`, padded as JetStream pads (`token_utils.pad_tokens`, same keywords)."""
        ids = np.asarray(self._tok.encode(s, add_special_tokens=False).ids, np.int64)
        return token_utils.pad_tokens(ids, self.bos_id, self.pad_id, **kwargs)

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=False)

    @property
    def pad_id(self) -> int:
        return 0  # padding is cut off at the true length, so any id will do; jaxrl pads with 0

    @property
    def eos_id(self) -> int:
        return self._stop[0]

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def stop_tokens(self) -> set[int]:
        """The model's end ids only: JetStream's default adds `pad_id`, a real token here."""
        return set(self._stop)


@struct.dataclass
class SlotState:
    """JetStream's decode state: jaxrl's, plus per slot the tokens emitted so far and the tokens that fit
    in the cache after the prompt (int32 [B] each)."""

    decode: DecodeState
    emitted: jax.Array
    room: jax.Array


class JetStreamEngine(engine_api.Engine):
    """`engine` (with engine params `params`, `{"base", "lora"}`) as a JetStream engine that tokenizes
    with `tokenizer`. Decoding is greedy.

    Raises:
        ValueError: the engine's `max_prefill_length` is below JetStream's smallest bucket (16).
    """

    def __init__(self, engine: Engine, params: Params, tokenizer: HFTokenizer) -> None:
        fits = [b for b in JETSTREAM_BUCKETS if b <= engine.max_prefill_length]
        if not fits:
            raise ValueError(f"JetStream needs max_prefill_length >= {JETSTREAM_BUCKETS[0]}; the engine's "
                             f"max_seq_len {engine.max_seq_len} allows {engine.max_prefill_length}")
        self.engine = engine
        self._params = engine.prepare(params)
        self._max_prefill_length = fits[-1]
        self.tokenizer = tokenizer
        self._lock = threading.Lock()  # the page allocator: generate thread (insert, step), detokenize (release)
        s = engine.max_seq_len
        self._start = jax.jit(lambda emitted, room, slot, length: (emitted.at[slot].set(0),
                                                                   room.at[slot].set(s - 1 - length)))
        self._pack = jax.jit(_pack)

    def load_params(self, *args: Any, **kwargs: Any) -> EngineParams:
        return self._params

    def prefill(self, *, params: EngineParams, existing_prefix: Prefix | None = None, padded_tokens: jax.Array,
                true_length: int) -> Prefix:
        """Prefill the prompt `padded_tokens[:true_length]` (int [T]; a leading `NO_BOS` dropped) and
        rewind it by one token (see the module docstring).

        Raises:
            NotImplementedError: `existing_prefix` is given.
            ValueError: the prompt is empty, or holds a token id outside the vocabulary.
        """
        ids = [int(t) for t in jax.device_get(padded_tokens)[:true_length]]
        if ids and ids[0] == NO_BOS:
            ids = ids[1:]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        prefix = self.engine.prefill(params=params, existing_prefix=existing_prefix,
                                     padded_tokens=pad_prompt(ids, self.engine.bucket(len(ids))),
                                     true_length=len(ids), sampling=SamplingParams(temperature=0.0))
        return prefix.replace(token=jnp.asarray(ids[-1:], jnp.int32), length=jnp.int32(len(ids) - 1))

    def insert(self, prefix: Prefix, decode_state: SlotState, slot: int) -> SlotState:
        emitted, room = self._start(decode_state.emitted, decode_state.room, jnp.int32(slot), prefix.length)
        with self._lock:
            return SlotState(self.engine.insert(prefix, decode_state.decode, slot), emitted, room)

    def generate(self, params: EngineParams, decode_state: SlotState) -> tuple[SlotState, engine_api.ResultTokens]:
        with self._lock:
            state, result = self.engine.generate(params, decode_state.decode, truncate=False,
                                                 penalize=False, ban=False)  # greedy, no min_tokens
        data, emitted = self._pack(result.tokens, decode_state.emitted, decode_state.room)
        out = engine_api.ResultTokens(data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                                      samples_per_slot=1)
        return SlotState(state, emitted, decode_state.room), out

    def init_decode_state(self, *args: Any, **kwargs: Any) -> SlotState:
        b = self.engine.max_concurrent_decodes
        return SlotState(self.engine.init_decode_state(), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))

    def get_prefix_destination_sharding(self) -> Any:
        return self.engine.get_prefix_destination_sharding()

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        """Empty: `build_tokenizer` hands over the tokenizer object rather than rebuilding it."""
        return tokenizer_pb2.TokenizerParameters()

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> HFTokenizer:
        return self.tokenizer

    def release(self, slot: int) -> None:
        """Return `slot`'s pages (a paged cache; else nothing): JetStream freed the slot (shim 5)."""
        with self._lock:
            self.engine.release(slot)

    def watch(self, driver: orchestrator.Driver) -> None:
        """Make `driver`'s queue of free slots return a freed slot's pages before the slot is free (shim
        5; every put after the driver's own initial ones is a slot JetStream freed)."""
        if self.engine.pages is None:
            return
        free = driver._generate_slots[0]  # 0.2.2: one queue per generate engine, no public handle
        put = free.put

        def release_then_put(slot: int, *args: Any, **kwargs: Any) -> None:
            self.release(slot)
            put(slot, *args, **kwargs)

        free.put = release_then_put

    @property
    def max_concurrent_decodes(self) -> int:
        """The engine's slots; with a paged cache at most as many as its pool holds sequences of
        `max_seq_len` positions (shim 5)."""
        if (pages := self.engine.pages) is None:
            return self.engine.max_concurrent_decodes
        whole = (pages.num_pages - 1) // -(-self.engine.max_seq_len // pages.page)
        return min(self.engine.max_concurrent_decodes, whole)

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.engine.mesh

    @property
    def colocated_cpus(self) -> None:
        return None


def _pack(tokens_B: jax.Array, emitted_B: jax.Array, room_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """JetStream's result rows [B, 3] (token, valid, length) and the new emitted counts [B]."""
    length_B = emitted_B + 1
    valid_B = (length_B <= room_B).astype(jnp.int32)
    return jnp.stack([tokens_B.astype(jnp.int32), valid_B, length_B], axis=1), length_B


class _ReportingThread(threading.Thread):
    """A driver thread that keeps its error in `error` instead of killing the process (shim 3)."""

    error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - handed to `decode`, which raises it
            log.exception("JetStream thread %s failed", self.name)
            self.error = exc


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _driver(engine: JetStreamEngine) -> orchestrator.Driver:
    params = engine.load_params()
    # One engine prefills and generates: JetStream's interleaved mode (no transfer between slices).
    driver = orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine], prefill_params=[params],
                                 generate_params=[params], interleaved_mode=True, jax_padding=False)
    engine.watch(driver)
    return driver


def check_request(request: jetstream_pb2.DecodeRequest, vocab_size: int) -> str | None:
    """What is wrong with `request` for a model of `vocab_size` tokens (empty content, a token id
    outside [0, vocab_size)), or None. JetStream would hand such a request to the engine, whose error
    ends the server."""
    kind = request.WhichOneof("content")
    if kind is None or (kind == "text_content" and not request.text_content.text):
        return "the request has no text_content.text nor token_content.token_ids"
    if kind == "token_content":
        ids = request.token_content.token_ids
        if not ids:
            return "token_content.token_ids is empty"
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
    return None


class _CheckedOrchestrator(orchestrator.LLMOrchestrator):
    """JetStream's gRPC servicer that refuses a bad request (`check_request`) with INVALID_ARGUMENT
    instead of queueing it."""

    def __init__(self, driver: orchestrator.Driver, vocab_size: int) -> None:
        super().__init__(driver)
        self._vocab_size = vocab_size

    async def Decode(self, request, context=None):  # noqa: N802 - the gRPC method's name
        problem = check_request(request, self._vocab_size)
        if problem is not None:
            await orchestrator._abort_or_raise(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        async for response in super().Decode(request, context):
            yield response


@dataclasses.dataclass
class InProcess:
    """JetStream's `Driver` over one engine, in this process, and the event loop (in its own thread)
    that `LLMOrchestrator.Decode` runs on. The loop outlives every request: JetStream's detokenize
    thread touches a request's loop after the last result is read, and a closed loop is an error there.
    """

    driver: orchestrator.Driver
    loop: asyncio.AbstractEventLoop

    def decode(self, prompts: Sequence[Sequence[int]], max_tokens: int, timeout_s: float = 300.0) -> list[list[int]]:
        """Greedy completions of `prompts` (token ids), all sent at once through `LLMOrchestrator.Decode`,
        as JetStream streams them: at most `max_tokens` ids each, without the stop token.

        Raises:
            ValueError: `max_tokens` < 1, or an empty prompt.
            JetStreamError: a driver thread failed (e.g. on a token id outside the vocabulary), or no
                answer within `timeout_s`.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not all(prompts):
            raise ValueError("a prompt is empty")
        service = orchestrator.LLMOrchestrator(driver=self.driver)

        async def one(ids: Sequence[int]) -> list[int]:
            content = jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids)
            request = jetstream_pb2.DecodeRequest(max_tokens=max_tokens, token_content=content)
            return [t async for r in service.Decode(request) for t in r.stream_content.samples[0].token_ids]

        async def watched() -> list[list[int]]:
            work = asyncio.ensure_future(asyncio.gather(*(one(p) for p in prompts)))
            try:
                while not work.done():
                    # 0.2.2 has no public list of its threads
                    failed = [t for t in self.driver._all_threads if getattr(t, "error", None) is not None]
                    if failed:
                        raise JetStreamError(f"JetStream thread {failed[0].name} failed: {failed[0].error!r}")
                    await asyncio.wait({work}, timeout=0.05)
                return work.result()
            finally:
                if not work.done():
                    work.cancel()
                    await asyncio.wait({work})
                if not work.cancelled():
                    # A cancelled gather holds its children's CancelledError as its exception; unread,
                    # asyncio logs it with its traceback whenever the future happens to be collected.
                    work.exception()

        future = asyncio.run_coroutine_threadsafe(watched(), self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise JetStreamError(f"no answer from JetStream within {timeout_s} s") from None


@contextlib.contextmanager
def in_process(engine: JetStreamEngine) -> Iterator[InProcess]:
    """JetStream's `Driver` over `engine` (as prefill and generate engine) in this process; its threads
    report errors to `InProcess.decode` instead of killing the process. Stopped at exit."""
    with _swapped(orchestrator, "JetThread", _ReportingThread):
        d = _driver(engine)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="jetstream-requests", daemon=True)
    thread.start()
    try:
        yield InProcess(d, loop)
    finally:
        d.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def serve(engine: JetStreamEngine, port: int, host: str = "127.0.0.1",
          threads: int | None = None) -> server_lib.JetStreamServer:
    """Start JetStream's gRPC server (`jetstream.core.server_lib.JetStreamServer`, service
    `Orchestrator`: `Decode`, `HealthCheck`) on `host:port` over `engine`, and return it (`stop()` ends
    it; `wait_for_termination()` blocks). A bad request is refused with INVALID_ARGUMENT
    (`check_request`); a failing worker thread still ends the process (JetStream's own choice).
    `threads`: gRPC handler threads, default JetStream's: max(decode slots, 64).

    Raises:
        OSError: `host:port` cannot be bound (checked before anything starts).
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, port))
    d = _driver(engine)
    threads = threads or max(d.get_total_concurrent_requests(), 64)
    checked = functools.partial(_CheckedOrchestrator, vocab_size=engine.engine.cfg.vocab_size)
    address = f"[{host}]" if ":" in host else host
    with _swapped(server_lib, "_HOST", address), _swapped(server_lib.orchestrator, "LLMOrchestrator", checked):
        server = server_lib.JetStreamServer(d, threads, port, grpc.insecure_server_credentials())
    server.start()
    return server
