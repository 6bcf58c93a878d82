"""Classic verifiers environments (`load_environment(**args) -> vf.Environment`, `jaxrl.envs.classic`): the
shipped `jaxrl/echo-word` loaded by id, its groups played over the real server's /v1/chat/completions
on the tiny Qwen3 (single-turn and 3-turn), failures as failed rollouts, and a 2-step `jaxrl run`."""

import asyncio
import math
from pathlib import Path

import pytest
from echo_word import EchoAgainEnv, letter_overlap, said_the_word
from gcs_fixtures import free_port
from helpers import REPO, SERVED_MODEL, jaxrl, read_metrics, shrink
from tokenizers import Tokenizer
from verifiers.legacy import SingleTurnEnv

from jaxrl.envs.classic import chain_turns
from jaxrl.envs.loader import EnvLoadError, LoadedEnv, Rollout, load_env, run_group
from jaxrl.inference.protocol import SamplingParams

TURNS = 3
MAX_TOKENS = 6

TEST_ENV = '''
import verifiers as vf
from datasets import Dataset


def explode(completion, **kwargs):
    raise RuntimeError("reward function exploded")


CALLS = []


def flaky(completion, **kwargs):
    CALLS.append(1)
    if len(CALLS) % 2:
        raise RuntimeError("flaky reward")
    return 1.0


def load_environment(mode="ok"):
    if mode == "raise":
        raise RuntimeError("no data for you")
    if mode == "dict":
        return {"prompt": "not an environment"}
    dataset = Dataset.from_list([{"question": "hi", "answer": "hi"}])
    return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[flaky if mode == "flaky" else explode]))
'''


@pytest.fixture
def test_env_module(tmp_path, monkeypatch):
    (tmp_path / "jaxrl_test_classic_env.py").write_text(TEST_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "someone/jaxrl-test-classic-env"


def play(env: LoadedEnv, task: int, n: int, base_url: str, tokenizer_dir: Path, seed: int) -> list[Rollout]:
    async def go():
        async with env.serving():
            return await run_group(env, task, n, base_url=base_url, model_name=SERVED_MODEL,
                                   tokenizer_path=tokenizer_dir,
                                   sampling=SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed))

    return asyncio.run(go())


def test_loads_by_id_with_its_args():
    env = load_env("jaxrl/echo-word", {"num_train_examples": 6, "num_eval_examples": 2, "turns": TURNS})
    assert env.classic and (env.name, env.module) == ("echo-word", "echo_word")
    assert isinstance(env.env.environment, EchoAgainEnv) and env.env.environment.max_turns == TURNS
    assert (len(env.tasks), len(env.eval_tasks)) == (6, 2)
    assert [t.idx for t in env.tasks] == list(range(6)) and [t.idx for t in env.eval_tasks] == [0, 1]
    row = env.tasks[0].input
    assert row["prompt"][-1] == {"role": "user", "content": row["answer"]}
    assert {t.input["answer"] for t in env.tasks}.isdisjoint(t.input["answer"] for t in env.eval_tasks)

    single = load_env("jaxrl/echo-word", {"num_train_examples": 6, "num_eval_examples": 0, "seed": 1})
    assert isinstance(single.env.environment, SingleTurnEnv) and single.eval_tasks == []
    assert [t.input["answer"] for t in single.tasks] != [t.input["answer"] for t in env.tasks]  # another seed


def test_load_errors_name_the_id(test_env_module):
    with pytest.raises(EnvLoadError, match=r"'jaxrl/echo-word'.*'echo_word'.*does not take args.*bogus"):
        load_env("jaxrl/echo-word", {"bogus": 1})
    with pytest.raises(EnvLoadError, match=r"'jaxrl/echo-word'.*raised ValueError: turns must be >= 1"):
        load_env("jaxrl/echo-word", {"turns": 0})
    with pytest.raises(EnvLoadError, match=r"'jaxrl/echo-word'.*classic environment.*not \[env.taskset\]"):
        load_env("jaxrl/echo-word", taskset={"split": "eval"})
    with pytest.raises(EnvLoadError, match=r"'someone/jaxrl-test-classic-env'.*raised RuntimeError: no data for you"):
        load_env(test_env_module, {"mode": "raise"})
    with pytest.raises(EnvLoadError, match=r"'someone/jaxrl-test-classic-env'.*returned dict, not a verifiers"):
        load_env(test_env_module, {"mode": "dict"})


def test_chain_turns_by_hand():
    def step(prompt, completion, mask, lps):
        return {"tokens": {"prompt_ids": prompt, "completion_ids": completion, "completion_mask": mask,
                           "completion_logprobs": lps}}

    turn1 = step([1, 2], [3, 4], [1, 1], [-0.1, -0.2])
    # Turn 2's prompt extends turn 1 (+ an env token 9): one sample, the env token masked out.
    assert chain_turns([turn1, step([1, 2, 3, 4, 9], [5], [1], [-0.5])]) == (
        [1, 2, 3, 4, 9, 5], [False, False, True, True, False, True], [0.0, 0.0, -0.1, -0.2, 0.0, -0.5])
    # Re-rendering changed turn 1's tokens (4 -> 8): the sample starts again at turn 2's prompt.
    assert chain_turns([turn1, step([1, 2, 3, 8, 9], [5, 6], [1, 0], [-0.5, -0.6])]) == (
        [1, 2, 3, 8, 9, 5, 6], [False] * 5 + [True, False], [0.0] * 5 + [-0.5, 0.0])
    with pytest.raises(ValueError, match="turn 1 came back without token ids"):
        chain_turns([{"tokens": None}])


def calls_by_rollout(calls: list, seeds: list[int]) -> list[list[tuple[list[int], list[int], list[float]]]]:
    """Each rollout's model calls in turn order, found by its seed (rollout i samples with seed + i)."""
    return [[(p, c, lps) for p, c, lps, s in calls if s == seed] for seed in seeds]


def test_single_turn_group_through_the_real_server(recording_server, tiny_model_dir):
    server, backend = recording_server
    env = load_env("jaxrl/echo-word", {"num_train_examples": 4, "num_eval_examples": 0})
    backend.calls = []
    rollouts = play(env, 2, 3, server.base_url, tiny_model_dir, seed=7)
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    answer = env.tasks[2].input["answer"]
    for r, calls in zip(rollouts, calls_by_rollout(backend.calls, [7, 8, 9]), strict=True):
        assert r.ok and r.error is None, r.error
        assert (r.env_name, r.example_id) == ("echo-word", 2)
        assert r.env_s > 0  # its rubric's seconds at least (the model call's are left out)
        [(prompt, completion, lps)] = calls
        assert tokenizer.decode(prompt, skip_special_tokens=False) == (
            f"<|im_start|>system\nRepeat the word you are given, and nothing else.<|im_end|>\n"
            f"<|im_start|>user\n{answer}<|im_end|>\n<|im_start|>assistant\n")
        assert r.token_ids == prompt + completion
        assert r.loss_mask == [False] * len(prompt) + [True] * len(completion)
        assert r.logprobs == [0.0] * len(prompt) + lps  # exactly what the engine reported
        assert all(math.isfinite(x) and x <= 0 for x in lps)
        reply = [{"role": "assistant", "content": tokenizer.decode(completion, skip_special_tokens=True)}]
        assert r.reward == pytest.approx(letter_overlap(reply, answer) + 0.5 * said_the_word(reply, answer))
        assert r.is_truncated == (len(completion) == MAX_TOKENS and completion[-1] != 151_645)
    assert len({tuple(r.token_ids) for r in rollouts}) == 3  # a group's rollouts differ


def test_multi_turn_group_chains_turns_into_one_sample(recording_server, tiny_model_dir):
    server, backend = recording_server
    env = load_env("jaxrl/echo-word", {"num_train_examples": 4, "num_eval_examples": 0, "turns": TURNS})
    backend.calls = []
    rollouts = play(env, 1, 4, server.base_url, tiny_model_dir, seed=3)
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    answer = env.tasks[1].input["answer"]
    chained = 0
    for r, calls in zip(rollouts, calls_by_rollout(backend.calls, [3, 4, 5, 6]), strict=True):
        assert r.ok and r.error is None, r.error
        assert len(calls) == TURNS
        # The sample starts at the last turn whose prompt does not extend the previous prompt + reply (a
        # re-rendering that re-tokenized a reply); from there on, each turn's reply is masked in.
        before = [p + c for p, c, _ in calls]  # each turn's prompt + reply, as the next turn must begin
        first = max([0] + [k for k in range(1, TURNS) if calls[k][0][: len(before[k - 1])] != before[k - 1]])
        chained += first == 0
        last_prompt, last_completion, _ = calls[-1]
        assert r.token_ids == last_prompt + last_completion
        mask, logprobs = [False] * len(r.token_ids), [0.0] * len(r.token_ids)
        for prompt, completion, lps in calls[first:]:
            start, end = len(prompt), len(prompt) + len(completion)
            assert r.token_ids[:end] == prompt + completion
            mask[start:end], logprobs[start:end] = [True] * len(completion), lps
        assert r.loss_mask == mask  # every reply of the sample in; system, user, "Again." and template out
        assert r.logprobs == logprobs
        for k in range(1, TURNS):  # the env's reply closes the last one and opens the next
            env_turn = tokenizer.decode(calls[k][0][len(calls[k - 1][0]):], skip_special_tokens=False)
            assert env_turn.endswith("<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")
        replies = [{"role": "assistant", "content": tokenizer.decode(c, skip_special_tokens=True)} for _, c, _ in calls]
        assert r.reward == pytest.approx(letter_overlap(replies, answer) + 0.5 * said_the_word(replies, answer))
    # These seeds give both: conversations whose three turns form one sample, and ones where a reply
    # re-tokenized differently (the tiny random model's text often does).
    assert 0 < chained < len(rollouts)


def test_failures_are_rollouts_not_exceptions(recording_server, tiny_model_dir, test_env_module):
    server, _ = recording_server
    broken = load_env(test_env_module)
    rollouts = play(broken, 0, 2, server.base_url, tiny_model_dir, seed=1)
    assert [r.ok for r in rollouts] == [False, False]
    assert all("reward function 'explode' raised RuntimeError: reward function exploded" in r.error
               for r in rollouts)
    assert all(r.token_ids == r.loss_mask == r.logprobs == [] for r in rollouts)

    echo = load_env("jaxrl/echo-word", {"num_train_examples": 2, "num_eval_examples": 0})
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    rollouts = play(echo, 0, 2, dead, tiny_model_dir, seed=1)
    assert [r.ok for r in rollouts] == [False, False]
    assert all("Connection" in r.error for r in rollouts), [r.error for r in rollouts]


def test_max_retries_plays_a_failed_rollout_again_with_its_seed(recording_server, tiny_model_dir, test_env_module):
    """`[[env]] max_retries` (a Hosted Training field): a rollout whose reward fails once passes on its
    second attempt, which samples with the same seed; without retries it counts as failed."""
    import dataclasses
    import sys

    from jaxrl.rl import rollouts

    server, backend = recording_server
    flaky = load_env(test_env_module, {"mode": "flaky"})
    client = {"base_url": server.base_url, "model_name": SERVED_MODEL, "tokenizer_path": tiny_model_dir}

    def collect(env: LoadedEnv) -> Rollout:
        async def go():
            async with env.serving():
                return await rollouts.collect([env], [(0, 0)], 1, client, SamplingParams(max_tokens=MAX_TOKENS), 7,
                                              60)
        sys.modules["jaxrl_test_classic_env"].CALLS.clear()
        backend.calls = []
        return asyncio.run(go())[0][0]

    once = collect(flaky)
    assert not once.ok and "flaky reward" in once.error and [c[3] for c in backend.calls] == [7]
    again = collect(dataclasses.replace(flaky, max_retries=2))
    assert again.ok and again.reward == 1.0 and [c[3] for c in backend.calls] == [7, 7]


def test_classic_config_trains(tmp_path, tiny_model_dir):
    """configs/classic.toml (jaxrl/echo-word, 2 turns), shrunk to two small steps, through the real CLI:
    the run's server serves /v1/chat/completions, the pre-flight rollout passes, every rollout trains."""
    text = shrink((REPO / "configs" / "classic.toml").read_text(), [
        ("max_steps = 10", "max_steps = 2"), ("batch_size = 16", "batch_size = 8"),
        ("rollouts_per_example = 8", "rollouts_per_example = 4"), ("max_tokens = 12", "max_tokens = 6"),
        ("seq_len = 256", "seq_len = 128"), ("decode_slots = 32", "decode_slots = 8"),
        ('model_path = "../assets/qwen3-tiny"',
         f'model_path = "{tiny_model_dir}"\noutput_dir = "{tmp_path / "runs"}"')])
    cfg = tmp_path / "classic.toml"
    cfg.write_text(text)
    out = jaxrl("run", cfg)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "pre-flight: one rollout of each environment passed" in out.stdout
    rows = read_metrics(tmp_path / "runs" / "classic")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollouts/failed"] == 0 and row["train/samples"] == 8
        assert 0.0 < row["reward/mean"] <= 1.5 and math.isfinite(row["loss"])
    assert abs(rows[0]["policy/kl"]) < 1e-3  # the trainer's logprobs of the sampled tokens match the engine's
