"""Reverse a short generated string, character by character.

The strings are 2-4 words drawn from a fixed list by a seeded generator, so the data ships with the
package and needs no download. The first `num_eval_examples` distinct strings form the eval split and
the next `num_train_examples` the train split: the splits never share a string, and resizing one
leaves the other unchanged. The reward is difflib's similarity ratio `2 * M / (len(a) + len(b))`
(M = matched characters) between the reply and the exact reversal: 1 for a perfect answer, partial
credit for a near miss.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field, model_validator

WORDS = (
    "apple", "river", "stone", "cloud", "green", "quick", "brown", "lazy", "happy", "little", "garden",
    "window", "yellow", "silver", "orange", "purple", "winter", "summer", "autumn", "spring", "forest",
    "desert", "ocean", "island", "bridge", "castle", "dragon", "rocket", "planet", "comet", "violin",
    "guitar", "piano", "pencil", "paper", "candle", "mirror", "basket", "rabbit", "tiger", "falcon",
    "salmon", "pepper", "ginger", "butter", "cookie", "honey", "lemon", "mango", "cherry", "copper",
    "marble", "velvet", "thunder", "shadow", "sunset", "harbor", "meadow", "valley", "canyon",
)

PROMPT = "Reverse the text below character by character. Reply with the reversed text only.\n\n{text}"


def similarity(reply: str, answer: str) -> float:
    """difflib.SequenceMatcher ratio in [0, 1]: 2 * matched characters / total characters."""
    return difflib.SequenceMatcher(None, reply, answer, autojunk=False).ratio()


def generate_texts(seed: int, count: int, min_words: int, max_words: int) -> list[str]:
    """`count` distinct strings of `min_words`..`max_words` words, the same for the same arguments.
    Raises ValueError when the word list cannot make that many distinct strings."""
    rng = random.Random(seed)
    texts: dict[str, None] = {}
    for _ in range(100 * count):
        if len(texts) == count:
            break
        texts[" ".join(rng.choices(WORDS, k=rng.randint(min_words, max_words)))] = None
    if len(texts) < count:
        raise ValueError(f"cannot generate {count} distinct strings of {min_words}-{max_words} words")
    return list(texts)


class ReverseTextData(vf.TaskData):
    text: str
    """The string to reverse."""
    answer: str
    """`text` reversed."""


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.reward(weight=1.0)
    async def lcs_ratio(self, trace: vf.Trace) -> float:
        """Similarity of the final reply (surrounding whitespace stripped) to the reversal."""
        return similarity(trace.last_reply, self.data.answer)


class ReverseTextConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """Which split to load."""
    num_train_examples: int = Field(2000, ge=1)
    """Strings in the train split."""
    num_eval_examples: int = Field(100, ge=1)
    """Strings in the eval split."""
    min_words: int = Field(2, ge=1)
    """Fewest words per string."""
    max_words: int = Field(4, ge=1)
    """Most words per string."""
    seed: int = 0
    """Generator seed; the same seed gives the same splits."""

    @model_validator(mode="after")
    def _check_words(self) -> ReverseTextConfig:
        if self.max_words < self.min_words:
            raise ValueError(f"max_words ({self.max_words}) < min_words ({self.min_words})")
        return self


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self) -> Iterator[ReverseTextTask]:
        c = self.config
        texts = generate_texts(c.seed, c.num_eval_examples + c.num_train_examples, c.min_words, c.max_words)
        texts = texts[: c.num_eval_examples] if c.split == "eval" else texts[c.num_eval_examples :]
        for i, text in enumerate(texts):
            data = ReverseTextData(
                name=f"{c.split}-{i}", prompt=PROMPT.format(text=text), text=text, answer=text[::-1]
            )
            yield ReverseTextTask(data, c.task)
