"""`jaxrl gepa run`: reflection replies judged (thinking, truncation, fences), the TOML form against the flags,
bad configs in one line, a scripted reflection model's better prompt adopted on a real classic environment
played by the tiny model behind the real rollout server, garbage reflection survived or stopped with a clear
error, and the command itself on a shipped classic and a shipped v1 environment."""

import json
import re
import types

import pytest
import verifiers as vf
from datasets import Dataset
from helpers import jaxrl
from typer.testing import CliRunner

from jaxrl.cli.main import app
from jaxrl.config.gepa import FLAGS, from_flags
from jaxrl.config.schema import ConfigError
from jaxrl.evaluation.reflection import Reflector, Reply, Unusable, usable_prompt


@pytest.mark.parametrize(("reply", "expected"), [
    (Reply("Here:\n```\nSay the word.\n```"), "Say the word."),
    (Reply("<think>\nmaybe ``` this\n</think>\n\n```text\nSay the word.\n```"), "Say the word."),
    (Reply("reasoning without its tag\n</think>\n```Say it twice.```"), "Say it twice."),
    (Reply("<think>\nI should write ```a prompt``` but"), "unfinished <think>"),
    (Reply("```\nSay the word.\n```", "length"), "cut at its token limit"),
    (Reply("Say the word."), "no fenced"),
    (Reply("```\nSay the word."), "no fenced"),
    (Reply("```\n \n```"), "empty"),
    (Reply("```\nold prompt\n```"), "repeats the current prompt"),
])
def test_usable_prompt(reply, expected):
    if expected[0].isupper():
        assert usable_prompt(reply, "old prompt") == expected
    else:
        with pytest.raises(Unusable, match=expected):
            usable_prompt(reply, "old prompt")


def test_reflector_counts_failures_in_a_row_and_stops():
    replies = iter([Reply("no fence"), Reply("```\nnew\n```"), RuntimeError("endpoint down"), Reply("", "length")])

    def lm(prompt):
        assert "<curr_param>" not in prompt and "old" in prompt  # gepa's own instruction-proposal prompt
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    lines = []
    r = Reflector(lm, max_failures=2, log=lines.append)
    data = {"system_prompt": [{"query": "q", "completion": "c", "reward": 0.0}]}
    outcomes = [r.propose({"system_prompt": "old"}, data, ["system_prompt"]) for _ in range(4)]
    assert outcomes == [{}, {"system_prompt": "new"}, {}, {}]
    assert (r.failures, r.accepted, r.in_a_row, r.should_stop()) == (3, 1, 2, True)
    assert "RuntimeError: endpoint down" in lines[2] and "token limit" in lines[3]


TOML_VF = """
model = "{model}"
reflection_model = "teacher"
run_dir = "out"

[[env]]
env_id = "jaxrl/echo-word"
env_args = {{ num_eval_examples = 4 }}

[gepa]
max_calls = 9
num_train = 2
num_val = 2
minibatch_size = 2
perfect_score = 1.5
state_columns = ["answer"]
seed = 3

[sampling]
max_tokens = 6
temperature = 0.5

[jax]
seq_len = 512
"""


def test_toml_form_and_flags_give_the_same_config(tmp_path):
    path = tmp_path / "gepa.toml"
    path.write_text(TOML_VF.format(model="m"))
    hosted = tmp_path / "hosted.toml"
    hosted.write_text(TOML_VF.format(model="m").replace("env_id =", "id =").replace("env_args =", "args ="))
    flags = {"model": "m", "reflection_model": "teacher", "run_dir": str(tmp_path / "out"), "gepa.max_calls": 9,
             "gepa.num_train": 2, "gepa.num_val": 2, "gepa.minibatch_size": 2, "gepa.perfect_score": 1.5,
             "gepa.state_columns": ["answer"], "gepa.seed": 3, "jax.seq_len": 512,
             "env_args": {"num_eval_examples": 4}, "sampling": {"max_tokens": 6, "temperature": 0.5}}
    from_file = from_flags(str(path), {})
    assert from_file == from_flags("jaxrl/echo-word", flags) == from_flags(str(hosted), {})
    # A flag given with the file overrides its key; -S merges into [sampling].
    over = from_flags(str(path), {"gepa.max_calls": 20, "sampling": {"temperature": 1.0}})
    assert (over.gepa.max_calls, over.sampling.max_tokens, over.sampling.temperature) == (20, 6, 1.0)


@pytest.mark.parametrize(("edit", "message"), [
    (("max_calls = 9", "max_calls = 0"), "gepa.toml: gepa.max_calls: Input should be greater than or equal to 1"),
    (("seed = 3", "sead = 3"), "gepa.toml: gepa.sead: unknown key"),
    (("[sampling]", "[sampling]\ntemprature = 1.0"), "gepa.toml: sampling.temprature: unknown key"),
    (("env_id =", "id = 'x/y'\nenv_id ="), "gepa.toml: env.0: set env_id or id, not both"),
    (("[gepa]", "[[env]]\nenv_id = 'jaxrl/lowercase'\n[gepa]"), "gepa.toml: env: jaxrl gepa optimises one"),
    (('model = "m"', ""), "gepa.toml: model: required key is missing"),
])
def test_bad_configs_are_one_clear_line(tmp_path, edit, message):
    path = tmp_path / "gepa.toml"
    path.write_text(TOML_VF.format(model="m").replace(*edit))
    with pytest.raises(ConfigError) as info:
        from_flags(str(path), {})
    assert str(info.value).startswith(str(tmp_path)) and message in str(info.value)
    r = CliRunner().invoke(app, ["gepa", "run", str(path)])
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_bad_flags_are_one_clear_line():
    with pytest.raises(ConfigError, match=f"^{FLAGS}: gepa.num_val: Input should be greater than or equal to 1"):
        from_flags("jaxrl/echo-word", {"model": "m", "gepa.num_val": 0})
    r = CliRunner().invoke(app, ["gepa", "run", "jaxrl/echo-word", "-m", "m", "-S", '{"top_p": 2}'])
    assert r.exit_code == 2 and r.output.strip() == ("flags: sampling.top_p: Input should be less than or equal "
                                                    "to 1, got 2"), r.output


def _magic_env(tmp_path):
    """A real classic environment (verifiers' SingleTurnEnv and Rubric) whose reward is 1 exactly when the
    system prompt says MAGIC: whatever the tiny model replies, a prompt holding it is strictly better."""
    from jaxrl.envs import classic
    from jaxrl.envs.loader import LoadedEnv

    def has_magic(prompt, **kwargs) -> float:
        return float(prompt[0]["role"] == "system" and "MAGIC" in prompt[0]["content"])

    def load_environment():
        rows = Dataset.from_list([{"question": f"word {i}", "answer": "a"} for i in range(4)])
        return vf.SingleTurnEnv(dataset=rows, eval_dataset=rows, system_prompt="Answer briefly.",
                                rubric=vf.Rubric(funcs=[has_magic]))

    module = types.ModuleType("magic")
    module.load_environment = load_environment
    env, tasks, eval_tasks = classic.load(module, {})
    return LoadedEnv("test/magic", "magic", env, tasks, eval_tasks)


def _search(recording_server, tiny_model_dir, tmp_path, replies, max_calls, max_failures=3):
    """A GEPA search of `_magic_env` on the tiny model behind the session's rollout server, reflection scripted
    by `replies` (a Reply, or an exception to raise, per call); returns (result, calls made, reflector)."""
    from jaxrl.config.gepa import GepaConfig
    from jaxrl.evaluation import gepa_run
    from jaxrl.evaluation.endpoint import Endpoint

    handle, _ = recording_server
    cfg = GepaConfig.model_validate({"model": "policy", "env": [{"env_id": "test/magic"}],
                                     "gepa": {"max_calls": max_calls, "num_train": 2, "num_val": 2,
                                              "minibatch_size": 2}, "sampling": {"max_tokens": 3}})
    calls = []

    def lm(prompt):
        calls.append(prompt)
        reply = replies[min(len(calls), len(replies)) - 1]
        if isinstance(reply, Exception):
            raise reply
        return reply

    reflector = Reflector(lm, max_failures, lambda line: None)
    gepa_run.check_resume(tmp_path, cfg.model_dump(mode="json", exclude={"run_dir"}))
    with gepa_run.plan(cfg, _magic_env(tmp_path), Endpoint(handle.base_url, "policy", tokenizer_path=str(
            tiny_model_dir))) as p:
        return gepa_run.run(cfg, p, reflector, tmp_path, gepa_run.FileLog(tmp_path / "gepa.log"),
                            lambda state: None), calls, reflector


def test_scripted_reflection_adopts_the_better_prompt_and_resumes(recording_server, tiny_model_dir, tmp_path):
    from jaxrl.evaluation import gepa_run

    better = Reply("<think>\nThe reward wants MAGIC.\n</think>\n\n```\nMAGIC: answer briefly.\n```")
    # Budget 8: the seed on 2 validation examples, its minibatch of 2, the child's 2, the child on validation.
    result, calls, _ = _search(recording_server, tiny_model_dir, tmp_path, [better], max_calls=8)
    assert len(calls) == 1 and "Answer briefly." in calls[0]
    assert result.best_idx == 1 and list(result.val_aggregate_scores) == [0.0, 1.0]
    assert (tmp_path / "best_prompt.txt").read_text() == (tmp_path / "system_prompt.txt").read_text() == \
        "MAGIC: answer briefly."
    frontier = [json.loads(line) for line in (tmp_path / "pareto_frontier.jsonl").read_text().splitlines()]
    assert [(r["best_score"], [c["candidate_idx"] for c in r["best_candidates"]]) for r in frontier] == \
        [(1.0, [1]), (1.0, [1])]
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert (meta["seed_val_score"], meta["best_val_score"], meta["num_candidates"]) == (0.0, 1.0, 2)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["info"]["is_best"] for r in rows] == [False, True]
    # The same folder with a larger budget resumes from gepa_state.bin: two more iterations (4 rollouts),
    # each reflecting once on the adopted prompt (the same prompt back is a failed proposal), no seed re-run.
    result, calls, reflector = _search(recording_server, tiny_model_dir, tmp_path, [better], max_calls=12)
    assert result.total_metric_calls == 12 and len(calls) == 2 and reflector.failures == 2
    assert result.best_idx == 1 and len(result.val_aggregate_scores) == 2
    # Other settings than the saved search's are refused, naming each changed key with both values.
    settings = json.loads((tmp_path / "gepa_config.json").read_text())
    changed = {**settings, "sampling": {**settings["sampling"], "max_tokens": 4}, "gepa": {**settings["gepa"],
                                                                                          "max_calls": 20}}
    with pytest.raises(gepa_run.GepaRunError, match=r"other settings \(sampling.max_tokens 3 -> 4\); use another"):
        gepa_run.check_resume(tmp_path, changed)
    assert gepa_run.check_resume(tmp_path, {**settings, "gepa": {**settings["gepa"], "max_calls": 20}})


def test_garbage_reflection_is_survived_then_stops_the_run_clearly(recording_server, tiny_model_dir, tmp_path):
    from jaxrl.evaluation.reflection import ReflectionFailed

    garbage = [Reply("<think>\nLet me think about the word and"), Reply("```\nMAGIC", "length"),
               RuntimeError("connection reset"), Reply("I would say: be brief.")]
    result, calls, reflector = _search(recording_server, tiny_model_dir, tmp_path / "a", garbage, max_calls=8,
                                       max_failures=10)
    assert len(calls) == 3 and reflector.failures == 3 and result.best_idx == 0
    assert (tmp_path / "a" / "best_prompt.txt").read_text() == "Answer briefly."
    with pytest.raises(ReflectionFailed, match=r"4 reflection replies in a row held no usable prompt \(last: the "
                                               r"reply holds no fenced"):
        _search(recording_server, tiny_model_dir, tmp_path / "b", garbage, max_calls=100, max_failures=4)
    assert json.loads((tmp_path / "b" / "metadata.json").read_text())["stopped_by_failed_proposals"] is True


SMALL = ["-B", "6", "-n", "2", "-N", "2", "--minibatch-size", "2", "--seq-len", "640", "--decode-slots", "4",
         "--reflection-max-tokens", "8", "--max-failed-proposals", "3"]
OUTPUTS = ("system_prompt.txt", "best_prompt.txt", "results.jsonl", "pareto_frontier.jsonl", "metadata.json")


def _check_outputs(folder, env_id):
    assert all((folder / name).is_file() for name in OUTPUTS), sorted(p.name for p in folder.iterdir())
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["env_id"] == env_id and meta["total_metric_calls"] <= 8 and meta["best_val_score"] is not None
    assert [json.loads(line)["valset_row"] for line in (folder / "pareto_frontier.jsonl").read_text().splitlines()] \
        == [0, 1]
    return (folder / "best_prompt.txt").read_text()


def test_gepa_run_on_a_shipped_classic_env_by_flags(tiny_model_dir, tmp_path):
    """echo-word (classic) by flags; its best prompt goes back in as the env arg `system_prompt`."""
    from jaxrl.envs import loader

    out = tmp_path / "echo"
    r = jaxrl("gepa", "run", "jaxrl/echo-word", "-m", tiny_model_dir, *SMALL, "-o", out, "-S", '{"max_tokens": 4}',
              "-a", '{"num_train_examples": 2, "num_eval_examples": 2}', timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation score: seed prompt" in r.stdout and "GEPA" in r.stdout
    best = _check_outputs(out, "jaxrl/echo-word")
    ran = json.loads((out / "metadata.json").read_text())["total_metric_calls"]
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", r.stdout)  # rich's colours and cursor moves, if any
    assert f" {ran}/{max(ran, 6)} rollouts" in plain and f", {ran} rollouts)" in plain, repr(r.stdout)
    assert loader.load_env("jaxrl/echo-word", {"system_prompt": best}).env.environment.system_prompt == best


def test_gepa_run_on_a_shipped_v1_env_by_toml(tiny_model_dir, tmp_path):
    """lowercase (v1) by the shipped TOML, flags overriding its budget; its best prompt goes back in as
    `[env.taskset] system_prompt` (a file)."""
    from jaxrl.envs import loader

    out = tmp_path / "lower"
    r = jaxrl("gepa", "run", "configs/gepa/lowercase.toml", "-m", tiny_model_dir, *SMALL, "-o", out,
              "-S", '{"max_tokens": 4}', timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _check_outputs(out, "jaxrl/lowercase")
    env = loader.load_env("jaxrl/lowercase", taskset={"system_prompt": str(out / "best_prompt.txt")})
    assert env.env.taskset.system_prompt == (out / "best_prompt.txt").read_text()


def test_gepa_run_against_an_endpoint_that_is_down_is_one_line(tmp_path):
    r = CliRunner().invoke(app, ["gepa", "run", "jaxrl/lowercase", "-m", "tiny", "-b", "http://127.0.0.1:9/v1",
                                 "-B", "12", "-n", "2", "-N", "2", "-o", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert r.output.strip().startswith("jaxrl gepa run: http://127.0.0.1:9/v1: the endpoint cannot be reached ("), \
        r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists(), r.output


@pytest.mark.parametrize("env_id", ["jaxrl/lowercase", "jaxrl/echo-word"])
def test_gepa_run_whose_first_rollouts_all_fail_stops_there(recording_server, tmp_path, env_id):
    """A model the (real, running) server does not serve: the seed prompt's validation rollouts all get a 404,
    and the search stops at once (exit 1, one line) instead of scoring prompts 0 until its budget is spent."""
    handle, _ = recording_server
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["gepa", "run", env_id, "-m", "not-served", "-b", handle.base_url, "-B", "12",
                                 "-n", "2", "-N", "2", "--minibatch-size", "2", "-o", str(out)])
    assert r.exit_code == 1, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("jaxrl gepa run: every rollout of the first batch failed (2 of 2 rollouts failed (100%)); "
                           "first error: "), r.output
    assert "'not-served' does not exist" in last, r.output
    assert not (out / "best_prompt.txt").exists() and not (out / "gepa_state.bin").exists()


def test_gepa_run_fits_reflection_to_a_small_local_context(tiny_model_dir, tmp_path):
    """The issue's case, scaled down: a v1 environment whose rollouts (about 450 tokens each) overflow the local
    reflection model's 512-token context. The reflection prompt is cut to fit (gepa.log says so) and the run
    ends with its budget spent (exit 0), where the whole prompt drew the server's 400 on every try."""
    out = tmp_path / "fit"
    r = jaxrl("gepa", "run", "jaxrl/lowercase", "-m", tiny_model_dir, "-B", "6", "-n", "2", "-N", "2",
              "--minibatch-size", "2", "--seq-len", "512", "--decode-slots", "4", "--reflection-max-tokens", "32",
              "-S", '{"max_tokens": 450}', "-o", out, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "gepa.log").read_text()
    assert "was cut to fit 480 (512 less 32 for the reply): each response kept to" in log, log
    whole = [int(n.replace(",", "")) for n in re.findall(r"the reflection prompt \(([\d,]+) tokens\)", log)]
    assert whole and min(whole) > 512, log  # the uncut prompt would not fit the context at all
    assert "not retried" not in log and "refused" not in log, log
    assert json.loads((out / "metadata.json").read_text())["total_metric_calls"] == 6
