"""Environments end to end: load by id, run groups through the in-process harness, verifiers' train
client and a real server, and check the rollouts token for token."""

import asyncio
import difflib
import textwrap
import time

import pytest
from tokenizers import Tokenizer

from jaxrl.envs.loader import EnvLoadError, LoadedEnv, Rollout, load_env, run_group
from jaxrl.inference.protocol import Completion, SamplingParams
from jaxrl.inference.server import start_server

MODEL = "policy"
IM_END = 151_645


class ScriptedBackend:
    """Replies `reply` (encoded, then `<|im_end|>`), cut at `max_tokens`; token i gets logprob
    -(i + 1) / 10. Records every request."""

    model_name = MODEL
    max_model_len = 1024

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.reply = ""
        self.calls: list[tuple[list[int], SamplingParams]] = []

    def completion_ids(self) -> list[int]:
        return self.tokenizer.encode(self.reply, add_special_tokens=False).ids + [IM_END]

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        self.calls.append((prompt_ids, params))
        full = self.completion_ids()
        out = full[: params.max_tokens]
        return Completion(out, logprobs(len(out)), "stop" if out == full else "length", [0] * len(out))


def logprobs(n: int) -> list[float]:
    return [-(i + 1) / 10 for i in range(n)]


@pytest.fixture(scope="module")
def backend(qwen3_tokenizer_dir):
    return ScriptedBackend(Tokenizer.from_file(str(qwen3_tokenizer_dir / "tokenizer.json")))


@pytest.fixture(scope="module")
def server(backend):
    handle = start_server(backend)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def lowercase():
    return load_env("jaxrl/lowercase")


@pytest.fixture(scope="module")
def reverse_text():
    return load_env("jaxrl/reverse-text", {"num_train_examples": 20}, {"num_eval_examples": 5})


def play(env: LoadedEnv, task: int, n: int, server, tokenizer_dir, **sampling) -> list[Rollout]:
    async def go():
        async with env.serving():
            return await run_group(
                env, task, n, base_url=server.base_url, model_name=MODEL, tokenizer_path=tokenizer_dir,
                sampling=SamplingParams(**{"max_tokens": 64, **sampling}),
            )

    return asyncio.run(go())


def assert_tokens(rollout: Rollout, prompt_ids: list[int], completion_ids: list[int]):
    """The branch is the prompt the engine saw + the completion, with the mask and logprobs exactly on
    the sampled tokens."""
    assert rollout.token_ids == prompt_ids + completion_ids
    assert rollout.loss_mask == [False] * len(prompt_ids) + [True] * len(completion_ids)
    assert rollout.logprobs == pytest.approx([0.0] * len(prompt_ids) + logprobs(len(completion_ids)))


def test_tasksets_load_by_id(lowercase, reverse_text):
    assert (lowercase.name, lowercase.module) == ("lowercase", "lowercase")
    assert (len(lowercase.tasks), len(lowercase.eval_tasks)) == (400, 50)
    assert [t.data.idx for t in lowercase.tasks[:3]] == [0, 1, 2]
    assert lowercase.tasks[0].data.prompt.startswith("Reply using only lowercase English letters and spaces.")
    train = {t.data.prompt for t in lowercase.tasks}
    assert len(train) == 400 and train.isdisjoint(t.data.prompt for t in lowercase.eval_tasks)

    assert (reverse_text.name, reverse_text.module) == ("reverse-text", "reverse_text")
    assert (len(reverse_text.tasks), len(reverse_text.eval_tasks)) == (20, 5)  # args, then [env.taskset]
    data = reverse_text.tasks[0].data
    assert data.answer == data.text[::-1] and data.prompt.endswith("\n\n" + data.text)
    assert {t.data.text for t in reverse_text.tasks}.isdisjoint(t.data.text for t in reverse_text.eval_tasks)
    # Deterministic: the same config generates the same data; another seed, other data.
    again = load_env("jaxrl/reverse-text@0.1.0", {"num_train_examples": 20, "num_eval_examples": 5})
    assert [t.data.text for t in again.tasks] == [t.data.text for t in reverse_text.tasks]
    reseeded = load_env("jaxrl/reverse-text", {"num_train_examples": 20, "seed": 1}, {"seed": 2})
    assert reseeded.env.taskset.config.seed == 2  # [env.taskset] wins over args
    assert [t.data.text for t in reseeded.tasks] != [t.data.text for t in reverse_text.tasks]


def test_lowercase_group_end_to_end(lowercase, server, backend, qwen3_tokenizer_dir):
    backend.reply, backend.calls = "hello World", []
    t0 = time.perf_counter()
    rollouts = play(lowercase, 3, 4, server, qwen3_tokenizer_dir, temperature=0.8, top_k=20, seed=5)
    elapsed = time.perf_counter() - t0
    assert len(rollouts) == 4 and len(backend.calls) == 4
    completion = backend.completion_ids()
    for rollout, (prompt_ids, params) in zip(rollouts, backend.calls, strict=True):
        assert rollout.ok and rollout.error is None
        assert_tokens(rollout, prompt_ids, completion)
        assert rollout.reward == 10 / 11  # "hello World": 10 of 11 characters are lowercase or space
        assert not rollout.is_truncated
        assert (rollout.env_name, rollout.example_id) == ("lowercase", 3)
        assert 0 < rollout.env_s < elapsed  # the environment's own code, its model call left out
        assert (params.temperature, params.top_k, params.max_tokens) == (0.8, 20, 64)
    prompt = backend.tokenizer.decode(backend.calls[0][0], skip_special_tokens=False)
    assert prompt == (
        f"<|im_start|>user\n{lowercase.tasks[3].data.prompt}<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert sorted(params.seed for _, params in backend.calls) == [5, 6, 7, 8]  # a group's rollouts differ


def test_reverse_text_rewards(reverse_text, server, backend, qwen3_tokenizer_dir):
    answer = reverse_text.tasks[0].data.answer
    backend.reply, backend.calls = answer, []
    [exact] = play(reverse_text, 0, 1, server, qwen3_tokenizer_dir)
    assert exact.ok and exact.reward == 1.0
    assert_tokens(exact, backend.calls[0][0], backend.completion_ids())

    n = len(answer)
    backend.reply = answer[:-2]  # a near miss: 2 * (n - 2) matched / (2n - 2) characters
    [near] = play(reverse_text, 0, 1, server, qwen3_tokenizer_dir)
    assert near.reward == 2 * (n - 2) / (2 * n - 2)
    assert near.reward == difflib.SequenceMatcher(None, answer[:-2], answer).ratio()

    backend.reply, backend.calls = answer, []
    [cut] = play(reverse_text, 0, 1, server, qwen3_tokenizer_dir, max_tokens=2)
    assert cut.ok and cut.is_truncated
    assert_tokens(cut, backend.calls[0][0], backend.completion_ids()[:2])
    assert 0 < cut.reward < 1


BROKEN_ENV = textwrap.dedent('''
    import verifiers.v1 as vf

    class BrokenTask(vf.Task[vf.TaskData]):
        @vf.reward
        async def explodes(self, trace: vf.Trace) -> float:
            raise RuntimeError("reward function exploded")

    class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
        def load(self):
            yield BrokenTask(vf.TaskData(prompt="Say something."), self.config.task)

    __all__ = ["BrokenTaskset"]
''')


def test_failures_are_rollouts_not_exceptions(tmp_path, monkeypatch, server, backend, lowercase,
                                              qwen3_tokenizer_dir):
    (tmp_path / "jaxrl_test_broken_env.py").write_text(BROKEN_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = load_env("someone/jaxrl-test-broken-env")
    backend.reply = "fine"
    rollouts = play(broken, 0, 2, server, qwen3_tokenizer_dir)
    assert [r.ok for r in rollouts] == [False, False]
    assert all("reward function exploded" in r.error for r in rollouts)
    assert all(r.token_ids == r.loss_mask == r.logprobs == [] for r in rollouts)

    # An engine error (here: a model name the server does not serve) fails the rollout the same way.
    async def wrong_model():
        return await run_group(lowercase, 0, 2, base_url=server.base_url, model_name="other",
                               tokenizer_path=qwen3_tokenizer_dir, sampling=SamplingParams(max_tokens=8))

    rollouts = asyncio.run(wrong_model())
    assert [r.ok for r in rollouts] == [False, False]
    assert all("other" in r.error for r in rollouts)


def test_load_errors_name_the_id_and_module():
    with pytest.raises(EnvLoadError, match=r"'jaxrl/no-such-env'.*'no_such_env'.*not importable"):
        load_env("jaxrl/no-such-env")
    with pytest.raises(EnvLoadError, match=r"'jaxrl/json'.*'json'.*could not be loaded.*exports no Taskset"):
        load_env("jaxrl/json")
    with pytest.raises(EnvLoadError, match=r"(?s)'jaxrl/lowercase'.*invalid config.*bogus"):
        load_env("jaxrl/lowercase", {"bogus": 1})
