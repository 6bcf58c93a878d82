"""What the rollout server asks of the inference engine, and what it gets back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, Protocol

MAX_TOP_LOGPROBS = 20
"""The most alternatives per sampled token a request may ask for (OpenAI's `top_logprobs` limit, 0..20)."""


class BackendStopped(RuntimeError):
    """A request that the backend dropped because it is shutting down (the scheduler was stopped while the
    request was queued or decoding): the server answers 503, as for an overloaded engine, without logging
    a failure."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature: >= 0; 0 means greedy. top_p: in (0, 1]; 1 disables nucleus sampling (Holtzman et al.
    2019). top_k: number of highest-logit tokens kept; <= 0 disables it. min_p: in [0, 1]; tokens whose
    probability is below `min_p` times the most likely token's are dropped (Nguyen et al. 2024); 0
    disables it. repetition_penalty: > 0; a token already in the prompt or the output has its logit
    divided by it when positive, multiplied when negative (CTRL, Keskar et al. 2019, as in vLLM and
    transformers); 1 disables it. max_tokens: sampled tokens per turn (>= 1). stop_token_ids: sampling
    stops after emitting one of these (it is kept in the output). min_tokens: >= 0; the first
    `min_tokens` sampled tokens are never one of `stop_token_ids` (their logits are masked out of the
    distribution, as vLLM's `min_tokens`); 0 disables it. seed: makes the request's samples
    reproducible; None draws from the engine's key. top_logprobs: in [0, `MAX_TOP_LOGPROBS`]; with each
    sampled token, that many most likely tokens and their logprobs under the distribution the token's own
    logprob is reported from (`jaxrl.inference.sampling.sample_with_top`); 0: none (no ranking on device).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    seed: int | None = None
    top_logprobs: int = 0

    @property
    def truncates(self) -> bool:
        """Whether top_p, top_k or min_p cut the distribution (the engine then runs its threshold search)."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0

    @property
    def penalizes(self) -> bool:
        return self.repetition_penalty != 1.0


@dataclasses.dataclass
class Completion:
    """A finished request: sampled tokens, the logprob of each under the sampling distribution (after
    temperature), why it stopped, the policy version that produced each token, the seconds from
    queueing to the first token (None when the backend does not measure it), and, when the request asked
    for `top_logprobs`, each token's alternatives: (token id, logprob) pairs, most likely first (None
    otherwise)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    policy_versions: list[int]
    ttft_s: float | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class GenerateBackend(Protocol):
    """The engine side of the server: turns prompt token ids into a completion."""

    model_name: str
    max_model_len: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[..., None] | None = None) -> Completion:
        """Raises ValueError for a request the engine cannot serve (e.g. prompt too long).
        `on_token(token, logprob)`, when given, is called on the caller's event loop as each token is
        sampled (the chat route streams and checks stop strings with it), as `on_token(token, logprob,
        top)` with the token's `Completion.top_logprobs` entry when `params.top_logprobs` > 0; cancelling
        the awaiting task stops the request."""
        ...
