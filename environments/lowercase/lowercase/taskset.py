"""Reply using only lowercase English letters and spaces.

A task a tiny randomly initialised model can learn in a few RL steps: the reward is dense, the
fraction of the reply's characters that are `a`-`z` or a space, so a random Qwen3 policy (whose
151,936-token vocabulary is largely English word pieces) already scores well above 0 and every
rollout carries signal. The prompts combine a fixed instruction with a generated request
(template x subject), shuffled by a seeded generator; the first `num_eval_examples` form the eval
split and the next `num_train_examples` the train split, with no prompt in both.
"""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

INSTRUCTION = "Reply using only lowercase English letters and spaces."
TEMPLATES = (
    "Describe {} in a few words.",
    "Say something about {}.",
    "What do you like about {}?",
    "Name three things related to {}.",
    "Write a short sentence about {}.",
    "Where would you find {}?",
    "What color is {}?",
    "Tell me a fact about {}.",
    "Give a one line story about {}.",
    "Why do people like {}?",
)
SUBJECTS = (
    "the sea", "a cat", "the moon", "a forest", "bread", "rain", "a city", "music", "a river",
    "the sun", "a garden", "snow", "a dog", "coffee", "a train", "the wind", "a book", "mountains",
    "a bird", "the night", "a lamp", "apples", "a bridge", "fire", "a ship", "the sky", "a horse",
    "tea", "a clock", "flowers", "a school", "the desert", "a bicycle", "honey", "a castle", "stars",
    "a market", "the ocean", "a violin", "cheese", "a storm", "the winter", "a kitten", "a village",
    "the summer", "a candle", "rice", "a road", "an island", "a song",
)
ALLOWED = frozenset(string.ascii_lowercase + " ")


def lowercase_fraction(reply: str) -> float:
    """Fraction of `reply`'s characters that are a-z or a space; 0.0 for an empty reply."""
    return sum(ch in ALLOWED for ch in reply) / len(reply) if reply else 0.0


class LowercaseData(vf.TaskData):
    pass


class LowercaseTask(vf.Task[LowercaseData]):
    @vf.reward(weight=1.0)
    async def lowercase_fraction(self, trace: vf.Trace) -> float:
        """`lowercase_fraction` of the final reply, surrounding whitespace stripped."""
        return lowercase_fraction(trace.last_reply)


class LowercaseConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """Which split to load."""
    num_train_examples: int = Field(400, ge=1)
    """Prompts in the train split."""
    num_eval_examples: int = Field(50, ge=1)
    """Prompts in the eval split."""
    seed: int = 0
    """Shuffle seed; the same seed gives the same splits."""


class LowercaseTaskset(vf.Taskset[LowercaseTask, LowercaseConfig]):
    def load(self) -> Iterator[LowercaseTask]:
        c = self.config
        requests = [t.format(s) for t, s in itertools.product(TEMPLATES, SUBJECTS)]
        if c.num_eval_examples + c.num_train_examples > len(requests):
            raise ValueError(
                f"num_eval_examples + num_train_examples must be at most {len(requests)}, got "
                f"{c.num_eval_examples + c.num_train_examples}"
            )
        random.Random(c.seed).shuffle(requests)
        if c.split == "eval":
            requests = requests[: c.num_eval_examples]
        else:
            requests = requests[c.num_eval_examples : c.num_eval_examples + c.num_train_examples]
        for i, request in enumerate(requests):
            yield LowercaseTask(LowercaseData(name=f"{c.split}-{i}", prompt=f"{INSTRUCTION} {request}"), c.task)
