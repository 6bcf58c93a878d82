"""GEPA's reflection step, made so that it cannot fail silently.

gepa 0.1.4's default proposer logs and swallows a reflection LM's exceptions, and takes whatever text it
finds between the first and the last ``` of a reply, or the whole reply when there is none, as the new
prompt: a Qwen3 reply cut off in its `<think>` monologue was adopted as a system prompt that way
(gepa#390). `Reflector.propose` is the adapter's `propose_new_texts` (gepa's adapter protocol), so it owns
the call: it renders gepa's own instruction-proposal prompt (`InstructionProposalSignature`), asks the
reflection model, and accepts a reply only when

- the call succeeded and the reply was not cut at its token limit (finish reason "length"),
- after Qwen3's thinking (`<think>...</think>`) is stripped, no unfinished `<think>` block is left,
- it holds a fenced block (an opening and a closing ```, as the reflection prompt asks), whose text,
  without a language tag and surrounding blank space, is not empty and differs from the current prompt.

Any other reply is a failed proposal: logged with its reason, nothing is proposed (gepa then skips the
iteration: "Reflection returned no text updates"), and the search goes on. `max_failures` failures in a
row make `should_stop` true (a gepa stopper, checked before each iteration), and the caller then stops the
run with `ReflectionFailed` (`raise_if_exhausted`) unless the budget was spent anyway.

The prompt is fitted to the reflection model's context first (`jaxrl.evaluation.reflection_prompt`). A
request that cannot succeed however often it is sent (`Unrecoverable`: a prompt that cannot fit, or a 4xx
refusal such as a context overflow) is not sent again: it stops the search at once, with advice that names
the reflection model's context.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl.evaluation.reflection_prompt import PromptBudget, Unrecoverable, fitted

FENCE = "```"
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Reply:
    """A reflection model's reply: its text and finish reason ("stop", "length", ... or None if unknown)."""

    text: str
    finish_reason: str | None = "stop"


ReflectionModel = Callable[[str], Reply]
"""A reflection model: the reflection prompt (one user message) in, its `Reply` out; may raise."""


class Unusable(ValueError):
    """A reply that holds no usable prompt; the message says why."""


class ReflectionFailed(RuntimeError):
    """Too many reflection replies in a row held no usable prompt: the run stops."""


def strip_thinking(text: str) -> str:
    """`text` without Qwen3's thinking: every `<think>...</think>` block, and everything up to a lone
    `</think>` (the chat template opens the block in the prompt). Raises Unusable when a `<think>` is left
    open (the reply ended inside its monologue)."""
    text = _THINK.sub("", text)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        raise Unusable("the reply ends inside an unfinished <think> block")
    return text


def usable_prompt(reply: Reply, current: str) -> str:
    """The new prompt in `reply` (see the module docstring for the rules). Raises Unusable naming the rule
    broken."""
    if reply.finish_reason == "length":
        raise Unusable("the reply was cut at its token limit (finish reason 'length')")
    text = strip_thinking(reply.text)
    start = text.find(FENCE)
    end = text.rfind(FENCE)
    if start < 0 or end <= start:
        raise Unusable("the reply holds no fenced (```) block")
    body = text[start + len(FENCE):end]
    first, newline, rest = body.partition("\n")
    if newline and first.strip() and " " not in first.strip():  # a language tag: ```text
        body = rest
    prompt = body.strip()
    if not prompt:
        raise Unusable("the fenced block is empty")
    if prompt == current.strip():
        raise Unusable("the fenced block repeats the current prompt")
    return prompt


@dataclasses.dataclass
class Reflector:
    """The adapter's `propose_new_texts`, a gepa stopper and the failure record (module docstring).

    lm: the reflection model. max_failures: failed proposals in a row that stop the run (>= 1).
    log: where each proposal's outcome is written (one line each). budget: the reflection model's context,
    which each prompt is fitted to (None: sent as rendered). fatal: why the search must stop at once
    (an `Unrecoverable` request), or "".
    """

    lm: ReflectionModel
    max_failures: int
    log: Callable[[str], None]
    budget: PromptBudget | None = None
    failures: int = 0
    in_a_row: int = 0
    accepted: int = 0
    last_reason: str = ""
    fatal: str = ""

    def propose(self, candidate: dict[str, str], reflective_dataset: Mapping[str, Sequence[Mapping[str, Any]]],
                components_to_update: list[str]) -> dict[str, str]:
        """New texts for the components that have records; {} when every reply failed."""
        out = {}
        for name in components_to_update:
            records = reflective_dataset.get(name)
            if not records:
                continue
            try:
                try:
                    prompt, cut = fitted(candidate[name], records, self.budget)
                    if cut:
                        self.log(cut)
                    reply = self.lm(prompt)
                except Unrecoverable:
                    raise
                except Exception as exc:  # noqa: BLE001 - a failed call is a failed proposal, never a crash
                    raise Unusable(f"the reflection call failed: {type(exc).__name__}: {exc}") from exc
                out[name] = usable_prompt(reply, candidate[name])
            except Unrecoverable as exc:
                self.failures += 1
                self.fatal = str(exc)
                self.log(f"failed proposal for {name}, not retried: {exc}")
                return {}
            except Unusable as exc:
                self.failures += 1
                self.in_a_row += 1
                self.last_reason = str(exc)
                self.log(f"failed proposal for {name} ({self.in_a_row} in a row, {self.failures} in all): {exc}")
                continue
            self.accepted += 1
            self.in_a_row = 0
            self.log(f"proposed a new {name} ({len(out[name])} characters)")
        return out

    def should_stop(self, state: Any = None) -> bool:
        """Whether `max_failures` proposals in a row failed, or one was `Unrecoverable` (gepa's
        `StopperProtocol`)."""
        return bool(self.fatal) or self.in_a_row >= self.max_failures

    def raise_if_exhausted(self, budget_left: bool = True) -> None:
        """Raises ReflectionFailed when `should_stop` stopped a search that had `budget_left` (a search that
        spent its budget finished, however its last proposals went), naming the count and the last reason."""
        if self.fatal:
            raise ReflectionFailed(f"the reflection request cannot succeed, so the search stopped: {self.fatal}")
        if self.should_stop() and budget_left:
            raise ReflectionFailed(f"{self.in_a_row} reflection replies in a row held no usable prompt (last: "
                                   f"{self.last_reason}); the search stopped. Use a stronger reflection model (-M), "
                                   "more reflection tokens (--reflection-max-tokens, within the reflection model's "
                                   "context: --seq-len for a local one), or raise --max-failed-proposals")


RETRYABLE = (408, 409, 429)
"""The 4xx statuses a later try may pass (openai's own retry rule); any other 4xx is `Unrecoverable`."""


def _message(exc: Any) -> str:
    """An openai `APIStatusError`'s server message (OpenAI's error object, whole or its `error` member)."""
    body = exc.body if isinstance(exc.body, dict) else {}
    inner = body["error"] if isinstance(body.get("error"), dict) else body
    return str(inner.get("message") or exc.message)


def chat_model(base_url: str, model: str, api_key_var: str, max_tokens: int) -> ReflectionModel:
    """A reflection model on an OpenAI-compatible endpoint (`base_url` ending in /v1): the prompt as one
    user message, at most `max_tokens` tokens back, the endpoint's default sampling (as vf-gepa's
    `make_reflection_lm`). The key is read from `api_key_var` ("EMPTY" when unset, as verifiers does).
    A 4xx refusal other than `RETRYABLE`'s raises `Unrecoverable` (its message and the advice)."""
    import os

    import openai

    client = openai.OpenAI(base_url=base_url, api_key=os.environ.get(api_key_var) or "EMPTY", timeout=3600,
                           max_retries=2)

    def complete(prompt: str) -> Reply:
        try:
            response = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=max_tokens)
        except openai.APIStatusError as exc:
            if 400 <= exc.status_code < 500 and exc.status_code not in RETRYABLE:
                raise Unrecoverable(f"{base_url} refused the reflection request ({exc.status_code}: "
                                    f"{_message(exc)}); if the prompt is too long, the reflection model's context "
                                    f"must hold it and --reflection-max-tokens ({max_tokens}): raise --seq-len for "
                                    "a local model") from None
            raise
        choice = response.choices[0]
        return Reply(choice.message.content or "", choice.finish_reason)

    return complete
