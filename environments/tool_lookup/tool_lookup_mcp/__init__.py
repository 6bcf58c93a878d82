"""tool-lookup-mcp: the tool-lookup task (`tool_lookup.corpus`) as a verifiers v1 taskset whose `lookup` tool
is an MCP server (`tool_lookup_mcp.toolset`), shared by the run's rollouts (`Taskset.toolsets`). The reward's
parts are the v1 rewards `used_the_tool`, `right_name` and `correct_answer`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field
from tool_lookup import corpus

from tool_lookup_mcp.toolset import LookupToolset, LookupToolsetConfig


class LookupData(vf.TaskData):
    entry: str
    """The corpus name the question asks about."""


class LookupTask(vf.Task[LookupData]):
    def _part(self, trace: vf.Trace, part: str) -> float:
        return corpus.score(trace.assistant_messages, self.data.entry)[part]

    @vf.reward(weight=corpus.WEIGHTS["used_the_tool"])
    async def used_the_tool(self, trace: vf.Trace) -> float:
        return self._part(trace, "used_the_tool")

    @vf.reward(weight=corpus.WEIGHTS["right_name"])
    async def right_name(self, trace: vf.Trace) -> float:
        return self._part(trace, "right_name")

    @vf.reward(weight=corpus.WEIGHTS["correct_answer"])
    async def correct_answer(self, trace: vf.Trace) -> float:
        return self._part(trace, "correct_answer")


class LookupConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """Which split to load."""
    num_train_examples: int = Field(100, ge=1)
    num_eval_examples: int = Field(20, ge=1)
    tools: LookupToolsetConfig = LookupToolsetConfig()
    """The MCP server's placement (verifiers' default: a local subprocess)."""


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    def load(self) -> Iterator[LookupTask]:
        c = self.config
        train, evaluation = corpus.split(c.num_train_examples, c.num_eval_examples)
        for i, name in enumerate(evaluation if c.split == "eval" else train):
            data = LookupData(name=f"{c.split}-{i}", prompt=corpus.QUESTION.format(name=name), entry=name)
            yield LookupTask(data, c.task)

    @classmethod
    def toolsets(cls, config: LookupConfig) -> list[vf.Toolset]:
        return [LookupToolset(config.tools)]


__all__ = ["LookupTaskset"]
