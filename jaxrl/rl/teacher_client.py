"""An external teacher (`[jax.teacher] base_url` + `model_name`): the logprob of every token of each trained
sample under a model served by an OpenAI-compatible server, asked while the step's batch is assembled.

The request is vLLM's (`vllm.entrypoints.openai`, `prompt_logprobs` on `/v1/completions`; `jaxrl serve` answers
it too, `jaxrl.inference.completions`): the sample's token
ids as the prompt, one token to generate, and `prompt_logprobs: 0`; the reply's `choices[0].prompt_logprobs`
holds, for each prompt position after the first, a dict keyed by the token id (as a string) whose entry's
`logprob` is log p(token | the tokens before it) at temperature 1 (vLLM scores prompts from the raw logits),
and None for the first position. Requests run concurrently, at most `max_concurrent` at once, each retried
`retries` times after 1, 2, 4, ... s; a sample whose logprobs do not come is given None (the run drops it
and counts it in `teacher/failed`).

Before the run starts, `check_server` also compares the server's tokenizer with the student's by a probe
(`PROBE`, sent as text with `prompt_logprobs: 0`: the reply's entries are keyed by the ids the server's
tokenizer gave it), as a server says nothing else of its vocabulary.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from jaxrl.config.teacher import TeacherConfig

PROBE = ("\nHello world! The quick brown fox jumps over 13 lazy dogs; 2+2=4, isn't it? <|im_start|>user\n"
         "What is tea?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA drink.<|im_end|> Größe "
         "café naïve 你好，世界 Привет мир مرحبا 🙂\t  def f(x):\n    return x ** 2\n")
"""The text `check_server` has the server tokenize: English words, digits, punctuation, code, whitespace
runs, accented and non-Latin scripts, an emoji, and the Qwen chat template's special tokens. Its first
token is the newline, whose id the reply does not give (the first position has no logprob)."""


class TeacherUnavailable(Exception):
    """The teacher's server cannot be used: not reachable, not serving `model_name`, not scoring prompts,
    or tokenizing as the student does not (one line)."""


def _headers(cfg: TeacherConfig) -> dict[str, str]:
    key = os.environ.get(cfg.api_key_var, "") if cfg.api_key_var else ""
    return {"Authorization": f"Bearer {key}"} if key else {}


async def check_server(cfg: TeacherConfig, encode: Callable[[str], Sequence[int]], student: str) -> None:
    """`GET {base_url}/models` must answer and list `model_name`, and `PROBE` must come back with its
    `prompt_logprobs`, keyed by the ids `encode` (the student's tokenizer, no special tokens added; its
    folder `student`, named in the refusal) gives it.

    Raises:
        TeacherUnavailable: the server is down, answers an error, serves other models (naming them), does
            not return prompt logprobs (vLLM and `jaxrl serve` do), or tokenizes `PROBE` otherwise
            (`probe_mismatch`).
    """
    url = f"{cfg.base_url.rstrip('/')}/models"
    try:
        async with httpx.AsyncClient(timeout=min(cfg.timeout, 30.0)) as client:
            reply = await client.get(url, headers=_headers(cfg))
            reply.raise_for_status()
            served = [m.get("id") for m in reply.json().get("data", [])]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise TeacherUnavailable(f"the teacher's server {url} cannot be reached: {type(exc).__name__}: "
                                 f"{exc or 'no answer'}") from None
    if cfg.model_name not in served:
        raise TeacherUnavailable(f"the teacher's server {url} does not serve {cfg.model_name!r} (it serves "
                                 f"{', '.join(map(repr, served)) or 'nothing'})")
    body = {"model": cfg.model_name, "prompt": PROBE, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    try:  # one small request: a server that does not return prompt_logprobs is refused here, not at each step
        async with httpx.AsyncClient(timeout=cfg.timeout) as client:
            reply = await client.post(f"{cfg.base_url.rstrip('/')}/completions", json=body, headers=_headers(cfg))
            reply.raise_for_status()
            served = prompt_token_ids(reply.json())
    except httpx.HTTPStatusError as exc:
        raise TeacherUnavailable(f"the teacher's server refuses a prompt_logprobs request: HTTP "
                                 f"{exc.response.status_code}: {exc.response.text[:200]}") from None
    except (httpx.HTTPError, ValueError) as exc:
        raise TeacherUnavailable(f"the teacher's server cannot score a prompt: {type(exc).__name__}: {exc}") \
            from None
    if reason := probe_mismatch(served, list(encode(PROBE))[1:], student):
        raise TeacherUnavailable(reason)


def prompt_token_ids(body: Any) -> list[int]:
    """The token ids a `/v1/completions` reply with `prompt_logprobs: 0` scored, from the second on (the
    keys of its entries: each holds the prompt token alone).

    Raises:
        ValueError: no `prompt_logprobs`, or an entry that is not a dict of one token id.
    """
    try:
        entries = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("the reply has no choices[0].prompt_logprobs") from None
    ids = []
    for i, entry in enumerate(entries[1:] if isinstance(entries, list) else [None], start=1):
        key = next(iter(entry)) if isinstance(entry, dict) and len(entry) == 1 else None
        if not (isinstance(key, str) and key.isdigit()):
            raise ValueError(f"prompt_logprobs[{i}] is not one {{token id: ...}} entry")
        ids.append(int(key))
    return ids


def probe_mismatch(served: Sequence[int], mine: Sequence[int], student: str) -> str | None:
    """Why a server whose tokenizer gave `PROBE` the ids `served` (from its second token) cannot teach a
    student whose tokenizer (folder `student`) gives `mine`: one line naming the first token they differ
    on; None when they agree."""
    if list(served) == list(mine):
        return None
    at = next((i for i, (a, b) in enumerate(zip(served, mine, strict=False)) if a != b), min(len(served), len(mine)))
    theirs = served[at] if at < len(served) else "the end"
    here = mine[at] if at < len(mine) else "the end"
    return (f"the teacher's server tokenizes a probe text otherwise than the student's tokenizer ({student}): "
            f"{len(served) + 1} tokens there, {len(mine) + 1} here, token {at + 1} is {theirs} there, {here} here; "
            f"distillation scores the student's token ids, so the teacher must share its vocabulary")


def parse_prompt_logprobs(body: Any, token_ids: Sequence[int]) -> list[float]:
    """The logprob of each of `token_ids` from a `/v1/completions` reply with `prompt_logprobs` (0.0 for the
    first token, which has no context): float [len(token_ids)].

    Raises:
        ValueError: the reply has no `prompt_logprobs`, another length, a position without its token, or
            a non-finite logprob.
    """
    try:
        entries = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("the reply has no choices[0].prompt_logprobs (does the server take prompt_logprobs?)") \
            from None
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        raise ValueError(f"prompt_logprobs has {len(entries) if isinstance(entries, list) else 'no'} entries for "
                         f"{len(token_ids)} prompt tokens")
    out = [0.0]
    for i, (token, entry) in enumerate(zip(token_ids[1:], entries[1:], strict=True), start=1):
        found = entry.get(str(token)) if isinstance(entry, dict) else None
        logprob = found.get("logprob") if isinstance(found, dict) else None
        if not isinstance(logprob, int | float) or not math.isfinite(logprob):
            raise ValueError(f"prompt_logprobs[{i}] has no finite logprob for token {token}")
        out.append(float(logprob))
    return out


async def sample_logprobs(client: httpx.AsyncClient, cfg: TeacherConfig, token_ids: Sequence[int]) -> list[float]:
    """One sample's token logprobs (`parse_prompt_logprobs`) from one request. Raises httpx.HTTPError or
    ValueError."""
    body = {"model": cfg.model_name, "prompt": list(token_ids), "max_tokens": 1, "temperature": 1.0,
            "prompt_logprobs": 0}
    reply = await client.post(f"{cfg.base_url.rstrip('/')}/completions", json=body, headers=_headers(cfg))
    reply.raise_for_status()
    return parse_prompt_logprobs(reply.json(), token_ids)


async def score(cfg: TeacherConfig, samples: Sequence[Sequence[int]], backoff_s: float = 1.0
                ) -> tuple[list[list[float] | None], list[str]]:
    """Each sample's token logprobs under the teacher (`sample_logprobs`), concurrently (at most
    `cfg.max_concurrent` requests at once), each retried `cfg.retries` times after `backoff_s`, 2 x, 4 x ...
    seconds. Returns the logprobs (None for a sample that failed every try) and one line per failed
    sample saying why."""
    gate = asyncio.Semaphore(cfg.max_concurrent)
    errors: list[str] = []

    async def one(client: httpx.AsyncClient, i: int, ids: Sequence[int]) -> list[float] | None:
        for attempt in range(cfg.retries + 1):
            try:
                async with gate:
                    return await sample_logprobs(client, cfg, ids)
            except (httpx.HTTPError, ValueError) as exc:
                if attempt == cfg.retries:
                    errors.append(f"sample {i}: {type(exc).__name__}: {exc}")
                    return None
                await asyncio.sleep(backoff_s * 2**attempt)
        return None

    async with httpx.AsyncClient(timeout=cfg.timeout) as client:
        out = await asyncio.gather(*(one(client, i, ids) for i, ids in enumerate(samples)))
    return list(out), errors
