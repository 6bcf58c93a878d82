"""GEPA's reflection prompt fitted to the reflection model's context (the tiny Qwen3's own tokenizer and chat
template): outputs cut in the middle with the cut said, fewer examples when that is not enough, a prompt that
cannot fit refused once; a reflection request the real server refuses (its context overflowed) is not sent
again and stops the search with advice that names --seq-len."""

import dataclasses
import re

import pytest

from jaxrl.evaluation.reflection import ReflectionFailed, Reflector, Reply, chat_model
from jaxrl.evaluation.reflection_prompt import Unrecoverable, elide, fitted, local_budget, render

# Distinct words, so a cut output's head and tail are recognisable.
LONG = " ".join(f"w{i}" for i in range(3000))


@pytest.fixture(scope="module")
def budget(tiny_model_dir):
    """The tiny model's budget at a 4,096-token context with 2,048 tokens kept for the reply (its tokenizer
    loaded once: other contexts are `dataclasses.replace`d)."""
    return local_budget(str(tiny_model_dir), 4096, 2048)


def _records(n=2):
    return [{"query": f"question {i}", "completion": f"start{i} {LONG} end{i}", "reward": 0.0} for i in range(n)]


def test_elide_keeps_the_head_and_tail_and_says_how_much_was_cut():
    assert elide("abcdefghij", 4) == "ab[... 6 characters cut ...]ij"
    assert elide("abcdefghij", 5) == "abc[... 5 characters cut ...]ij"
    assert elide("abc", 5) == "abc"


def test_a_prompt_that_fits_is_sent_as_gepa_renders_it(budget):
    records = [{"query": "q", "completion": "short", "reward": 1.0}]
    assert fitted("Be brief.", records, budget) == (render("Be brief.", records), "")
    assert fitted("Be brief.", _records(), None) == (render("Be brief.", _records()), "")  # no known context


def test_long_outputs_are_cut_to_fit_with_room_for_the_reply(budget):
    records = _records()
    assert budget.count(render("Be brief.", records)) > 4096  # the case: it overflows the whole context
    prompt, cut = fitted("Be brief.", records, budget)
    assert budget.count(prompt) <= 2048 and cut.startswith("the reflection prompt (") and "each response kept" in cut
    assert "shortened to fit the reflection model's context of 4,096 tokens" in prompt
    for i in range(2):  # each output keeps its beginning and its end; the middle is marked
        assert f"start{i} w0 w1" in prompt and f"w2999 end{i}" in prompt
    assert len(re.findall(r"\[\.\.\. [\d,]+ characters cut \.\.\.\]", prompt)) == 2
    assert "Be brief." in prompt and "question 1" in prompt
    keep = int(cut.rsplit("kept to ", 1)[1].split()[0].replace(",", ""))
    looser, _ = fitted("Be brief.", records, dataclasses.replace(budget, reply=1024))
    assert keep > 100 and len(looser) > len(prompt)  # as much is kept as fits


def test_too_many_examples_are_left_out_and_a_prompt_that_cannot_fit_is_unrecoverable(budget, tiny_model_dir):
    budget = dataclasses.replace(budget, context=1200, reply=600)
    records = [{"query": f"question {i} " + "q " * 150, "completion": LONG, "reward": 0.0} for i in range(4)]
    prompt, cut = fitted("Be brief.", records, budget)
    assert budget.count(prompt) <= 600 and "of 4 examples shown" in cut and "of 4 examples are shown" in prompt
    with pytest.raises(Unrecoverable, match="raise --seq-len .* or lower --reflection-max-tokens"):
        fitted("Be brief. " * 400, records, budget)
    with pytest.raises(Unrecoverable, match=r"--reflection-max-tokens \(600\) leaves no room"):
        local_budget(str(tiny_model_dir), 600, 600)


def test_a_context_overflow_from_the_server_is_not_retried_and_stops_the_search(recording_server):
    """The session's real server has a 160-token context: the whole reflection prompt is refused with a 400.
    One call is made, the search stops at once, and the advice names the context (--seq-len)."""
    handle, backend = recording_server
    lm = chat_model(handle.base_url, "policy", "NO_SUCH_KEY_VAR", 8)
    with pytest.raises(Unrecoverable, match=r"refused the reflection request \(400: the prompt is .*this model's "
                                            r"context is 160.*raise --seq-len"):
        lm(render("Be brief.", _records(1)))
    calls = []

    def counting(prompt):
        calls.append(prompt)
        return lm(prompt)

    lines = []
    reflector = Reflector(counting, max_failures=5, log=lines.append)
    assert reflector.propose({"system_prompt": "Be brief."}, {"system_prompt": _records(1)}, ["system_prompt"]) == {}
    assert len(calls) == 1 and reflector.should_stop() and "not retried" in lines[-1]
    with pytest.raises(ReflectionFailed, match="cannot succeed, so the search stopped: .*raise --seq-len"):
        reflector.raise_if_exhausted(budget_left=True)


def test_failed_proposals_that_end_with_the_budget_let_the_run_finish():
    reflector = Reflector(lambda prompt: Reply("no fence"), max_failures=1, log=lambda line: None)
    reflector.propose({"system_prompt": "old"}, {"system_prompt": [{"query": "q"}]}, ["system_prompt"])
    assert reflector.should_stop()
    reflector.raise_if_exhausted(budget_left=False)  # the budget was spent: the run finished
    with pytest.raises(ReflectionFailed, match="1 reflection replies in a row"):
        reflector.raise_if_exhausted(budget_left=True)
