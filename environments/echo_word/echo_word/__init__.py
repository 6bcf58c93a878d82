"""echo-word: a classic verifiers environment (`load_environment(**args) -> vf.Environment`).

Each prompt asks the model to repeat a generated word. The rubric scores every assistant reply:
`letter_overlap` (weight 1.0) is the Jaccard similarity of the reply's letter set and the word's, dense
enough that a tiny random policy gets signal (a short reply made of the word's letters scores high, a
long ramble low); `said_the_word` (weight 0.5) is the fraction of replies that contain the word.
With `turns > 1` it is a MultiTurnEnv that answers each reply with "Again." until `turns` replies.
Words are drawn from generated syllables by a seeded generator: the first `num_eval_examples` form
the eval dataset, the next `num_train_examples` the train dataset (no download).
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Repeat the word you are given, and nothing else."
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "da", "fu", "gi", "he", "ju", "ba")


def words(n: int, seed: int) -> list[str]:
    """`n` distinct words of 2 to 3 syllables, in a seeded order. Raises ValueError past 4,352 words."""
    k = len(SYLLABLES)
    if n > k**2 + k**3:
        raise ValueError(f"echo-word has {k**2 + k**3} distinct words; {n} were asked for")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3))))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def replies(completion: vf.Messages) -> list[str]:
    """The text of each assistant message of `completion`."""
    return [str(m["content"] or "") for m in completion if m["role"] == "assistant"]


def letter_overlap(completion: vf.Messages, answer: str, **kwargs) -> float:
    """Mean over replies of |letters(reply) & letters(answer)| / |letters(reply) | letters(answer)|."""
    target = set(answer)
    scores = [len(set(r.lower()) & target) / len({c for c in r.lower() if c.isalpha()} | target)
              for r in replies(completion)]
    return sum(scores) / len(scores) if scores else 0.0


def said_the_word(completion: vf.Messages, answer: str, **kwargs) -> float:
    """Fraction of replies that contain `answer` (case-insensitive)."""
    texts = replies(completion)
    return sum(answer in t.lower() for t in texts) / len(texts) if texts else 0.0


class EchoAgainEnv(vf.MultiTurnEnv):
    """Answers every reply with "Again." (the rollout ends after `max_turns` replies)."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        return [vf.UserMessage(content="Again.")]


def load_environment(num_train_examples: int = 200, num_eval_examples: int = 20, turns: int = 1,
                     seed: int = 0, system_prompt: str = SYSTEM_PROMPT) -> vf.Environment:
    """The echo-word environment: a SingleTurnEnv for `turns == 1`, else an EchoAgainEnv of `turns` replies.
    `system_prompt`: the instruction (a GEPA run's best_prompt.txt, as the seeds pass one back).

    Raises ValueError for `turns < 1` or more examples than distinct words.
    """
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    pool = words(num_eval_examples + num_train_examples, seed)

    def dataset(ws: list[str]) -> Dataset:
        return Dataset.from_list([{"question": w, "answer": w} for w in ws])

    rubric = vf.Rubric(funcs=[letter_overlap, said_the_word], weights=[1.0, 0.5])
    kwargs = {"dataset": dataset(pool[num_eval_examples:]),
              "eval_dataset": dataset(pool[:num_eval_examples]) if num_eval_examples else None,
              "system_prompt": system_prompt, "rubric": rubric}
    if turns == 1:
        return vf.SingleTurnEnv(**kwargs)
    return EchoAgainEnv(max_turns=turns, **kwargs)
