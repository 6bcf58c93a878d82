"""A multi-turn chat in which every user turn sets a new rule for the reply.

Each task is `num_turns` rules (lowercase only, UPPERCASE only, at most `SHORT_CHARS` characters),
no rule twice in a row, each with a generated request ("Tell me about the sea."). The prompt states
the first rule; after each reply the env, playing the user, scores it and answers with that score and
the next rule, so the conversation (and the prompt of every later turn) depends on the model's
replies. The reward is the mean per-turn rule score, a missing reply scoring 0. Each score is dense
(a fraction of conforming characters, or of the length budget), so a random tiny model already
scores well above 0 and every group carries signal. The first `num_eval_examples` distinct tasks
form the eval split and the next `num_train_examples` the train split.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

SHORT_CHARS = 12
Rule = Literal["lowercase", "uppercase", "short"]
RULES: dict[Rule, str] = {
    "lowercase": "Reply using only lowercase letters and spaces.",
    "uppercase": "Reply using only UPPERCASE letters and spaces.",
    "short": f"Reply in at most {SHORT_CHARS} characters.",
}
SUBJECTS = (
    "the sea", "a cat", "the moon", "a forest", "bread", "rain", "a city", "music", "a river", "the sun",
    "a garden", "snow", "a dog", "coffee", "a train", "the wind", "a book", "mountains", "a bird", "the night",
    "a lamp", "apples", "a bridge", "fire", "a ship", "the sky", "a horse", "tea", "a clock", "flowers",
)
NEXT_TURN = "Your reply scored {score:.2f} for that rule. New rule: {rule} {request}"
LOWER = frozenset(string.ascii_lowercase + " ")
UPPER = frozenset(string.ascii_uppercase + " ")


def rule_score(rule: Rule, reply: str) -> float:
    """How well `reply` (whitespace-stripped) follows `rule`, in [0, 1]; 0.0 for an empty reply.

    lowercase / uppercase: the fraction of characters that are a-z (A-Z) or a space.
    short: 1.0 within `SHORT_CHARS` characters, else `SHORT_CHARS / len(reply)`.
    """
    reply = reply.strip()
    if not reply:
        return 0.0
    if rule == "short":
        return min(1.0, SHORT_CHARS / len(reply))
    allowed = LOWER if rule == "lowercase" else UPPER
    return sum(ch in allowed for ch in reply) / len(reply)


def turn_message(rules: list[Rule], requests: list[str], turn: int, last_reply: str = "") -> str:
    """The user's message opening turn `turn` (0-based): the rule and request, after turn 0 preceded by
    the score of `last_reply` under the previous turn's rule."""
    rule, request = RULES[rules[turn]], requests[turn]
    if turn == 0:
        return f"{rule} {request}"
    return NEXT_TURN.format(score=rule_score(rules[turn - 1], last_reply), rule=rule, request=request)


class FollowRulesData(vf.TaskData):
    rules: list[Rule]
    """One rule per turn."""
    requests: list[str]
    """One request per turn, aligned with `rules`."""


class FollowRulesTask(vf.Task[FollowRulesData]):
    @vf.reward(weight=1.0)
    async def rules_followed(self, trace: vf.Trace) -> float:
        """Mean `rule_score` of each turn's reply; turns the trace never reached score 0."""
        replies = [m.content or "" for m in trace.assistant_messages]
        rules = self.data.rules
        return sum(rule_score(r, reply) for r, reply in zip(rules, replies, strict=False)) / len(rules)


class FollowRulesConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """Which split to load."""
    num_train_examples: int = Field(400, ge=1)
    """Tasks in the train split."""
    num_eval_examples: int = Field(50, ge=1)
    """Tasks in the eval split."""
    num_turns: int = Field(3, ge=1, le=8)
    """Assistant turns per conversation (rules per task)."""
    seed: int = 0
    """Generator seed; the same seed gives the same splits."""


def generate_tasks(seed: int, count: int, num_turns: int) -> list[tuple[list[Rule], list[str]]]:
    """`count` distinct (rules, requests) pairs of `num_turns` turns, no rule twice in a row; the same for
    the same arguments. Raises ValueError when that many distinct tasks cannot be drawn."""
    rng = random.Random(seed)
    names = list(RULES)
    tasks: dict[str, tuple[list[Rule], list[str]]] = {}
    for _ in range(100 * count):
        if len(tasks) == count:
            break
        rules = [rng.choice(names)]
        while len(rules) < num_turns:
            rules.append(rng.choice([r for r in names if r != rules[-1]]))
        requests = [f"Tell me about {s}." for s in rng.sample(SUBJECTS, num_turns)]
        tasks.setdefault(repr((rules, requests)), (rules, requests))
    if len(tasks) < count:
        raise ValueError(f"cannot generate {count} distinct tasks of {num_turns} turns")
    return list(tasks.values())


class FollowRulesTaskset(vf.Taskset[FollowRulesTask, FollowRulesConfig]):
    def load(self) -> Iterator[FollowRulesTask]:
        c = self.config
        tasks = generate_tasks(c.seed, c.num_eval_examples + c.num_train_examples, c.num_turns)
        tasks = tasks[: c.num_eval_examples] if c.split == "eval" else tasks[c.num_eval_examples :]
        for i, (rules, requests) in enumerate(tasks):
            data = FollowRulesData(
                name=f"{c.split}-{i}", prompt=turn_message(rules, requests, 0), rules=rules, requests=requests
            )
            yield FollowRulesTask(data, c.task)


class FollowRulesEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    """The policy: it answers every turn."""


class FollowRulesEnv(vf.Env[FollowRulesEnvConfig]):
    """The env plays the user: it takes the opening reply to the prompted first rule, then answers
    each reply with its score and the next rule until every rule has had a turn (or the run ended
    early: a limit, an error)."""

    async def run(self, task: FollowRulesTask, agents: vf.Agents) -> None:
        data = task.data
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for turn in range(1, len(data.rules)):
                if segment.terminated:
                    break
                segment = await chat.turn(turn_message(data.rules, data.requests, turn, segment.last_reply))
