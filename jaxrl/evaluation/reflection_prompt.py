"""The reflection prompt, fitted to the reflection model's context.

gepa's instruction-proposal prompt (`InstructionProposalSignature`) holds the current prompt and one record
per rollout of the minibatch, each with the rollout's whole output. A small local model's outputs fill its
context (a 4,096-token Qwen3 wrote 40,164 characters of them for a minibatch of two), and a prompt that
does not fit is refused by the server every time it is sent. So the prompt is measured in the reflection
model's own tokens (its chat template included, as its server counts them) and, when it would leave less
than the reply's tokens free, each record's output is cut to its first and last characters (the middle
elided and marked with how much was cut, and the cut said in the prompt), as little as still fits; if even
empty outputs do not fit, the records after the first are left out (said too). A prompt that cannot fit
at all (the current prompt alone is too long for the context) raises `Unrecoverable`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gepa.strategies.instruction_proposal import InstructionProposalSignature

from jaxrl.inference.template import ChatTemplate

OUTPUT = "completion"
"""The record field holding a rollout's output (verifiers' classic and v1 GEPA adapters both name it so)."""
_EXAMPLES = "```\n<side_info>"


class Unrecoverable(Exception):
    """A reflection request that cannot succeed however often it is sent: a prompt that cannot fit the
    reflection model's context, or a request its server refuses as malformed (a 4xx other than a rate
    limit or a timeout). The message says why and what to change."""


@dataclasses.dataclass(frozen=True)
class PromptBudget:
    """What a reflection prompt may use. context: the reflection model's tokens per sequence (prompt and
    reply); reply: the tokens kept free for the reply (`--reflection-max-tokens`); count: the tokens of a
    prompt sent as one user message, chat template included."""

    context: int
    reply: int
    count: Callable[[str], int]

    @property
    def limit(self) -> int:
        """The most tokens the prompt may have: `context - reply`."""
        return self.context - self.reply


def local_budget(tokenizer_path: str, context: int, reply: int) -> PromptBudget:
    """The budget of jaxrl's own server over a local model: its tokenizer and chat template
    (`jaxrl.inference.template.ChatTemplate`, as the server renders the request) and its context.

    Raises:
        Unrecoverable: `reply` leaves no room for a prompt in `context`.
    """
    if reply >= context:
        raise Unrecoverable(f"--reflection-max-tokens ({reply}) leaves no room for the reflection prompt in the "
                            f"reflection model's {context}-token context: raise --seq-len or lower "
                            "--reflection-max-tokens")
    template = ChatTemplate.load(tokenizer_path)
    return PromptBudget(context, reply, lambda prompt: len(template.render([{"role": "user", "content": prompt}], {})))


def render(current: str, records: Sequence[Mapping[str, Any]], template: str | None = None) -> str:
    """gepa's instruction-proposal prompt for `current` and `records` (`template`: its default's text when
    None)."""
    prompt = InstructionProposalSignature.prompt_renderer({"current_instruction_doc": current,
                                                           "dataset_with_feedback": list(records),
                                                           "prompt_template": template})
    assert isinstance(prompt, str), "records hold no images"  # text records give one string
    return prompt


def output_text(value: Any) -> str:
    """A record's output as text: a string as is, chat messages as `role: content` paragraphs."""
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return "\n\n".join(f"{m.get('role')}: {m.get('content') or ''}" if isinstance(m, Mapping) else str(m)
                           for m in value)
    return str(value)


def elide(text: str, keep: int) -> str:
    """`text` with its middle cut so that `keep` characters of it are left (the first half and the last),
    the cut marked `[... N characters cut ...]`; `text` itself when it is no longer than `keep`."""
    if len(text) <= keep:
        return text
    head, tail = keep - keep // 2, keep // 2
    return f"{text[:head]}[... {len(text) - keep:,} characters cut ...]{text[len(text) - tail:]}"


def _cut(records: Sequence[Mapping[str, Any]], keep: int) -> list[dict[str, Any]]:
    out = []
    for record in records:
        text = output_text(record.get(OUTPUT, ""))
        out.append({**record, OUTPUT: elide(text, keep)} if OUTPUT in record and len(text) > keep else dict(record))
    return out


def fitted(current: str, records: Sequence[Mapping[str, Any]], budget: PromptBudget | None) -> tuple[str, str]:
    """(the reflection prompt for `current` and `records` within `budget`, what was cut to fit: "" when
    nothing was) as the module docstring says; the plain prompt when `budget` is None (a context that is not
    known) or it fits.

    Raises:
        Unrecoverable: not even the first record, its output cut to nothing, fits.
    """
    prompt = render(current, records)
    if budget is None or (tokens := budget.count(prompt)) <= budget.limit:
        return prompt, ""

    def attempt(keep: int, shown: int) -> str:
        note = (f"(The responses below were shortened to fit the reflection model's context of {budget.context:,} "
                f"tokens: the middle of each response longer than {keep:,} characters is cut and marked "
                "\"[... N characters cut ...]\"" + (f"; only the first {shown} of {len(records)} examples are "
                                                    "shown" if shown < len(records) else "") + ".)\n")
        template = InstructionProposalSignature.default_prompt_template
        return render(current, _cut(records[:shown], keep), template.replace(_EXAMPLES, note + _EXAMPLES, 1))

    def fits(keep: int, shown: int) -> bool:
        return budget.count(attempt(keep, shown)) <= budget.limit

    said = f"the reflection prompt ({tokens:,} tokens) was cut to fit {budget.limit:,} ({budget.context:,} less " \
           f"{budget.reply:,} for the reply): "
    if not fits(0, len(records)):
        shown = next((n for n in range(len(records) - 1, 0, -1) if fits(0, n)), 0)
        if shown:
            return attempt(0, shown), said + f"responses cut to nothing, {shown} of {len(records)} examples shown"
        raise Unrecoverable(f"the reflection prompt cannot fit the reflection model's context: with one example "
                            f"and its response cut to nothing it has {budget.count(attempt(0, 1)):,} tokens, and "
                            f"{budget.limit:,} are free ({budget.context:,} less {budget.reply:,} for the reply); "
                            "raise --seq-len (the reflection model's context) or lower --reflection-max-tokens")
    lo, hi = 0, max(len(output_text(r.get(OUTPUT, ""))) for r in records)  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid, len(records)) else (lo, mid)
    return attempt(lo, len(records)), said + f"each response kept to {lo:,} characters"
