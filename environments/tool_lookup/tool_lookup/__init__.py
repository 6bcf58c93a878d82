"""tool-lookup: a classic verifiers ToolEnv (`load_environment(**args) -> vf.ToolEnv`) over a shipped corpus.

The model answers "What is the code of <name>?" by calling the `lookup` tool and repeating the code it
returns (`tool_lookup.corpus` has the task and the reward). verifiers' ToolEnv plays it: the tool runs in
the env's process, a tool that raises is answered with its error text, and the rollout ends at the first
reply that calls no tool, or after `max_turns` replies.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

from tool_lookup.corpus import QUESTION, WEIGHTS, lookup, score, split


def _reward_function(part: str):
    def fn(completion: vf.Messages, answer: str, **kwargs) -> float:
        return score([m for m in completion if m["role"] == "assistant"], answer)[part]

    fn.__name__ = part
    return fn


def load_environment(num_train_examples: int = 100, num_eval_examples: int = 20, max_turns: int = 3) -> vf.Environment:
    """The tool-lookup ToolEnv: `num_train_examples` / `num_eval_examples` tasks (corpus names, eval first),
    `max_turns` replies at most. Raises ValueError for more examples than the corpus holds."""
    train, evaluation = split(num_train_examples, num_eval_examples)

    def dataset(names: list[str]) -> Dataset:
        return Dataset.from_list([{"question": QUESTION.format(name=n), "answer": n} for n in names])

    rubric = vf.Rubric(funcs=[_reward_function(p) for p in WEIGHTS], weights=list(WEIGHTS.values()))
    return vf.ToolEnv(dataset=dataset(train), eval_dataset=dataset(evaluation) if evaluation else None,
                      tools=[lookup], max_turns=max_turns, rubric=rubric)
