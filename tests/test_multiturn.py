"""Multi-turn environments and trajectory strategies: the shipped `jaxrl/follow-rules` taskset, its
traces through the in-process harness, verifiers' train client and the real server on the tiny Qwen3,
and how a trace becomes training samples ("interleaved" or "branching")."""

import asyncio
import math
import re

import pytest
from follow_rules.taskset import RULES, SHORT_CHARS, rule_score
from helpers import REPO, SERVED_MODEL, jaxrl, read_metrics, shrink
from tokenizers import Tokenizer

from jaxrl.envs.loader import Rollout, load_env, run_group
from jaxrl.inference.protocol import SamplingParams
from jaxrl.rl.samples import training_samples, turn_samples

TURNS = 3


def test_rule_scores_by_hand():
    assert rule_score("lowercase", "  hello World ") == 10 / 11  # stripped; "W" is not lowercase
    assert rule_score("uppercase", "HI there") == 3 / 8
    assert rule_score("short", "x" * SHORT_CHARS) == 1.0
    assert rule_score("short", "x" * (4 * SHORT_CHARS)) == 0.25
    assert [rule_score(r, " \n") for r in RULES] == [0.0, 0.0, 0.0]


def test_follow_rules_loads_by_id_with_disjoint_deterministic_splits():
    env = load_env("jaxrl/follow-rules", {"num_train_examples": 30, "num_eval_examples": 10})
    assert (env.name, env.module, type(env.env).__name__) == ("follow-rules", "follow_rules", "FollowRulesEnv")
    assert (len(env.tasks), len(env.eval_tasks)) == (30, 10)
    for task in env.tasks + env.eval_tasks:
        rules, requests = task.data.rules, task.data.requests
        assert len(rules) == len(requests) == TURNS
        assert all(a != b for a, b in zip(rules, rules[1:], strict=False))  # each turn changes the rule
        assert task.data.prompt == f"{RULES[rules[0]]} {requests[0]}"
    key = lambda t: (tuple(t.data.rules), tuple(t.data.requests))  # noqa: E731
    assert {key(t) for t in env.tasks}.isdisjoint(key(t) for t in env.eval_tasks)
    again = load_env("jaxrl/follow-rules", {"num_train_examples": 30, "num_eval_examples": 10})
    assert [key(t) for t in again.tasks] == [key(t) for t in env.tasks]
    two = load_env("jaxrl/follow-rules", {"num_train_examples": 5, "num_turns": 2})
    assert {len(t.data.rules) for t in two.tasks} == {2}


def test_turn_samples_by_hand():
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    mask = [False, True, True, False, False, True, False, True, False]
    lps = [0.0, -0.1, -0.2, 0.0, 0.0, -0.5, 0.0, -0.7, 0.0]
    assert turn_samples(ids, mask, lps) == [
        ([1, 2, 3], [False, True, True], [0.0, -0.1, -0.2]),
        ([1, 2, 3, 4, 5, 6], [False, False, False, False, False, True], [0.0] * 5 + [-0.5]),
        ([1, 2, 3, 4, 5, 6, 7, 8], [False] * 7 + [True], [0.0] * 7 + [-0.7]),
    ]
    assert turn_samples([1, 2], [True, True], [-1.0, -2.0]) == [([1, 2], [True, True], [-1.0, -2.0])]
    assert turn_samples([1, 2], [False, False], [0.0, 0.0]) == []
    with pytest.raises(ValueError, match="differ in length: 2, 1, 2"):
        turn_samples([1, 2], [True], [0.0, 0.0])


def test_training_samples_by_strategy():
    def rollout(mask: list[bool]) -> Rollout:
        n = len(mask)
        return Rollout(list(range(n)), mask, [-1.0 if m else 0.0 for m in mask], 0.0, False, True, None, "e", 0)

    two_turns, one_turn = rollout([False, True, False, True]), rollout([False, False, True, True])
    samples, source = training_samples([two_turns, one_turn], "interleaved")
    assert samples == [(r.token_ids, r.loss_mask, r.logprobs) for r in (two_turns, one_turn)]
    assert source.tolist() == [0, 1]
    samples, source = training_samples([two_turns, one_turn], "branching")
    assert [s[0] for s in samples] == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert [s[1] for s in samples] == [[False, True], [False, False, False, True], [False, False, True, True]]
    assert source.tolist() == [0, 0, 1]  # each sample trains with its rollout's advantage and temperature
    with pytest.raises(ValueError, match="unknown trajectory_strategy 'depth-first'"):
        training_samples([two_turns], "depth-first")


def test_multiturn_traces_through_the_real_server(recording_server, tiny_model_dir):
    server, backend = recording_server
    backend.calls = []
    env = load_env("jaxrl/follow-rules", {"num_train_examples": 4, "num_eval_examples": 1})
    task = env.tasks[1]

    async def go():
        async with env.serving():
            return await run_group(env, task, 2, base_url=server.base_url, model_name=SERVED_MODEL,
                                   tokenizer_path=tiny_model_dir,
                                   sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=11))

    rollouts = asyncio.run(go())
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert len(rollouts) == 2 and len(backend.calls) == 2 * TURNS
    for r in rollouts:
        assert r.ok and r.error is None, r.error
        # This rollout's model calls: those whose prompt + completion its token ids extend, in order (two
        # rollouts that sampled the same replies share theirs).
        mine = {len(p): (p, c, lps) for p, c, lps, _ in backend.calls if r.token_ids[: len(p) + len(c)] == p + c}
        calls = [mine[n] for n in sorted(mine)]
        assert len(calls) == TURNS
        mask, logprobs = [False] * len(r.token_ids), [0.0] * len(r.token_ids)
        for k, (prompt, completion, lps) in enumerate(calls):
            start, end = len(prompt), len(prompt) + len(completion)
            # The trace is the renderer's tokens: each prompt extends the last prompt + its completion.
            assert r.token_ids[start:end] == completion
            if k + 1 < TURNS:
                assert calls[k + 1][0][:end] == r.token_ids[:end]
            mask[start:end], logprobs[start:end] = [True] * len(completion), lps
        assert r.token_ids[: len(calls[-1][0]) + len(calls[-1][1])] == r.token_ids  # nothing after the last reply
        assert r.loss_mask == mask  # every sampled span in, every prompt and environment token out
        assert r.logprobs == pytest.approx(logprobs)
        assert all(math.isfinite(x) and x <= 0 for x in logprobs)
        # The environment's turns are real user turns built from the model's replies.
        replies = [tokenizer.decode(c[1], skip_special_tokens=True) for c in calls]
        for k in range(1, TURNS):
            env_text = tokenizer.decode(r.token_ids[len(calls[k - 1][0]) + len(calls[k - 1][1]): len(calls[k][0])])
            score = float(re.search(r"Your reply scored (\d\.\d\d)", env_text).group(1))
            assert score == pytest.approx(rule_score(task.data.rules[k - 1], replies[k - 1]), abs=0.005)
            assert RULES[task.data.rules[k]] in env_text
        expected = sum(rule_score(rule, reply) for rule, reply in zip(task.data.rules, replies, strict=True)) / TURNS
        assert r.reward == pytest.approx(expected)

        # interleaved: the trace as one sample; branching: each turn's prompt + completion, only it masked in.
        (interleaved,), source = training_samples([r], "interleaved")
        assert interleaved == (r.token_ids, r.loss_mask, r.logprobs) and source.tolist() == [0]
        branching, source = training_samples([r], "branching")
        assert source.tolist() == [0] * TURNS
        for (ids, sample_mask, sample_lps), (prompt, completion, lps) in zip(branching, calls, strict=True):
            assert ids == prompt + completion
            assert sample_mask == [False] * len(prompt) + [True] * len(completion)
            assert sample_lps == pytest.approx([0.0] * len(prompt) + lps)


def test_multiturn_config_trains_with_branching(tmp_path, tiny_model_dir):
    """configs/multiturn.toml, shrunk to one small step, runs through the real CLI with
    trajectory_strategy = "branching": every rollout of the step trains as one sample per turn. Its engine
    keeps finished turns' pages (`[jax] kv_reuse_turns`, a paged cache): each later turn prefills only what
    follows its last prompt and reply (each turn's reply and the user turn are well under a prompt)."""
    text = shrink((REPO / "configs" / "multiturn.toml").read_text(), [
        ("max_steps = 10", "max_steps = 1"), ("batch_size = 16", "batch_size = 4"),
        ("rollouts_per_example = 8", "rollouts_per_example = 2"), ("max_tokens = 16", "max_tokens = 4"),
        ('trajectory_strategy = "interleaved"', 'trajectory_strategy = "branching"'),
        ('model_path = "../assets/qwen3-tiny"', f'model_path = "{tiny_model_dir}"\noutput_dir = "{tmp_path / "runs"}"'),
        ("decode_slots = 32", "decode_slots = 4\nkv_cache_tokens = 1024\nkv_reuse_turns = true")])
    cfg = tmp_path / "multiturn.toml"
    cfg.write_text(text + "\n[buffer]\nskip_verification = true\n")  # the rollout test above covers the env
    out = jaxrl("run", cfg)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (row,) = read_metrics(tmp_path / "runs" / "multiturn")
    assert row["rollouts/failed"] == 0 and row["train/samples"] == 4 * TURNS
    assert 0.0 <= row["reward/mean"] <= 1.0 and math.isfinite(row["loss"])
    # each later turn of the 4 rollouts (and of any started ahead) shares a page or more of its conversation,
    # and each group's second rollout its first prompt
    assert row["engine/prefix_hits"] >= 4 * (TURNS - 1) + 2 and row["engine/kv_kept_pages"] > 0
    assert row["engine/prefix_tokens"] >= 4 * (TURNS - 1) * 16


@pytest.mark.parametrize("ragged", [False, True], ids=["paged", "ragged"])
def test_next_turns_share_the_last_turns_pages_through_the_real_server(tiny_model_dir, ragged):
    """The follow-rules environment (verifiers' MultiTurnEnv, 2 turns) against a paged engine that keeps
    finished turns' pages (`[jax] kv_reuse_turns`), with the gather-based pool a GPU gets (the bucketed
    `Scheduler`) and with the ragged pool a TPU gets (`jaxrl.inference.chunked.make_scheduler` gives its
    `ChunkedScheduler`): each rollout's next prompt extends its last prompt and
    completion, so turn 2 of both rollouts shares those pages and prefill only what follows them
    (the environment's reply, and the completion's last token or two: the engine feeds back all but the
    last sampled token, one more when the step after a stop token was already dispatched). The chunked
    scheduler shares whole pages only: each shared prompt feeds again what its last shared page held
    (under a page), and the group's second rollout its first prompt's tail (a page at most)."""
    import jax
    from helpers import Recording

    from jaxrl.inference.chunked import ChunkedScheduler, make_scheduler
    from jaxrl.inference.engine import Engine
    from jaxrl.inference.scheduler import Scheduler
    from jaxrl.inference.server import start_server
    from jaxrl.inference.template import ChatTemplate
    from jaxrl.kv.ragged import RaggedPaged
    from jaxrl.model import hf
    from jaxrl.parallel.sharding import make_mesh

    turns = 2
    mcfg, base = hf.load_hf(tiny_model_dir)
    kv = RaggedPaged(mcfg, 4, 160, 640) if ragged else None
    engine = Engine(mcfg, make_mesh({}, jax.devices()[:1]), 4, 160, kv_cache_tokens=640, kv=kv)
    scheduler = make_scheduler(engine, {"base": base, "lora": None}, model_name="policy", keep_turns=True)
    assert type(scheduler) is (ChunkedScheduler if ragged else Scheduler) and scheduler.keeps
    backend = Recording(scheduler)
    server = start_server(backend, chat_template=ChatTemplate.load(tiny_model_dir))
    env = load_env("jaxrl/follow-rules", {"num_train_examples": 4, "num_eval_examples": 1, "num_turns": turns})

    async def go():
        async with env.serving():
            return await run_group(env, env.tasks[1], 2, base_url=server.base_url, model_name=SERVED_MODEL,
                                   tokenizer_path=tiny_model_dir,
                                   sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=11))

    try:
        rollouts = asyncio.run(go())
    finally:
        server.stop()
        backend.scheduler.stop()
    assert all(r.ok for r in rollouts) and len(backend.calls) == 2 * turns
    metrics = engine.metrics()
    # every prompt position is prefilled or shared: the group's first prompt once each way, then the turns
    assert metrics["engine/prefill_tokens"] + metrics["engine/prefix_tokens"] == sum(len(p) for p, *_ in backend.calls)
    assert metrics["engine/prefix_hits"] == 1 + 2 * (turns - 1)
    first = len(backend.calls[0][0])
    new = 0  # the tokens each later turn's prompt adds to its last prompt and completion
    for r in rollouts:
        mine = sorted((len(p), p, c) for p, c, _, _ in backend.calls if r.token_ids[:len(p) + len(c)] == p + c)
        assert len(mine) == turns and mine[0][0] == first
        new += sum(len(p) - len(q) - len(c) for (_, q, c), (_, p, _) in zip(mine, mine[1:], strict=False))
    again = 16 + 15 * 2 * (turns - 1) if ragged else 0  # positions of shared partial pages fed again (pages of 16)
    assert new <= metrics["engine/prefill_tokens"] - first <= new + 2 * (turns - 1) + again
