"""The tool-lookup task, shared by the classic ToolEnv (`tool_lookup`) and the v1 MCP taskset (`tool_lookup_mcp`).

The shipped corpus (`corpus.json`, 150 entries) maps a two-syllable name to a three-digit code. A task asks
"What is the code of <name>?"; the code is not in the prompt, so the model must call the `lookup` tool
(`lookup(name) -> code`; an unknown name raises ValueError, answered to the model as error text) and
answer with what it returned. The first `num_eval_examples` entries are the eval split, the next
`num_train_examples` the train split: eval names are never trained on.

The reward (`score`, in [0, 1]) is dense enough for a small policy to climb: 0.25 for calling `lookup`
with a well-formed call, 0.25 for calling it with the task's name, 0.5 for a final reply holding the code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CORPUS: dict[str, str] = json.loads((Path(__file__).with_name("corpus.json")).read_text())
QUESTION = "What is the code of {name}?"
WEIGHTS = {"used_the_tool": 0.25, "right_name": 0.25, "correct_answer": 0.5}


def lookup(name: str) -> str:
    """Looks a name up in the corpus and returns its three-digit code.

    Args:
        name: the entry's name, e.g. "kalo".
    """
    code = CORPUS.get(name.strip().lower())
    if code is None:
        raise ValueError(f"no entry named {name!r}")
    return code


def split(num_train_examples: int, num_eval_examples: int) -> tuple[list[str], list[str]]:
    """(train names, eval names). Raises ValueError when the corpus has fewer entries than asked for."""
    names = list(CORPUS)
    if num_train_examples + num_eval_examples > len(names):
        raise ValueError(f"the corpus has {len(names)} entries; {num_train_examples} + {num_eval_examples} "
                         "were asked for")
    return names[num_eval_examples:num_eval_examples + num_train_examples], names[:num_eval_examples]


def _get(message: Any, key: str) -> Any:
    return message.get(key) if isinstance(message, dict) else getattr(message, key, None)


def _call_name_arguments(call: Any) -> tuple[str | None, str | None]:
    """(name, arguments text) of a tool call, in verifiers' ToolCall form or OpenAI's nested one."""
    fn = _get(call, "function")
    return (_get(fn, "name"), _get(fn, "arguments")) if fn else (_get(call, "name"), _get(call, "arguments"))


def score(replies: Iterable[Any], name: str) -> dict[str, float]:
    """The reward's parts (`WEIGHTS`' keys, each 0 or 1) of the assistant messages `replies` (dicts or message
    models with `content` and `tool_calls`) for the task about `name`."""
    replies = list(replies)
    calls = [_call_name_arguments(c) for m in replies for c in _get(m, "tool_calls") or ()]
    used = right = False
    for fn, arguments in calls:
        try:
            args = json.loads(arguments or "")
        except ValueError:
            continue
        if fn == "lookup" and isinstance(args, dict):
            used = True
            right = right or str(args.get("name", "")).strip().lower() == name
    final = str(_get(replies[-1], "content") or "") if replies else ""
    return {"used_the_tool": float(used), "right_name": float(right), "correct_answer": float(CORPUS[name] in final)}


def reward(parts: dict[str, float]) -> float:
    """The weighted sum of `score`'s parts."""
    return sum(WEIGHTS[k] * v for k, v in parts.items())
