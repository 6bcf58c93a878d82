"""`[eval]` and `[val]` (`jaxrl.run.evaluate`): pass@k against hand-computed values, the check metrics by hand,
which examples, rollouts and seeds each check plays, config errors, and one real run through the CLI."""

import dataclasses
import io
import math
import re

import pytest
from helpers import jaxrl, read_metrics, write_run_config
from rich.console import Console

from jaxrl.config.schema import SEED_MULTIPLIER, ConfigError, RunConfig, load_config
from jaxrl.envs import loader
from jaxrl.run import evaluate
from jaxrl.run.evaluate import Evaluator, Outcome, check_metrics, pass_at_k, pass_at_k_ks

BASE = {"model": "m", "batch_size": 8, "rollouts_per_example": 4, "jax": {"seed": 3}}


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # 1 - C(3,1)/C(4,1) = 1 - 3/4
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # no success; fewer failures than k
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    with pytest.raises(ValueError, match="n=2, c=3, k=1"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="k=3"):
        pass_at_k(2, 1, 3)
    assert pass_at_k_ks(1) == [1] and pass_at_k_ks(4) == [1, 2, 4] and pass_at_k_ks(6) == [1, 2, 4, 6]


def out(reward: float, ok: bool = True, seq_len: int = 10, truncated: bool = False) -> Outcome:
    return Outcome(reward if ok else 0.0, ok, seq_len if ok else 0, truncated, None if ok else "boom")


def test_check_metrics_by_hand():
    groups = [[out(1), out(0), out(0), out(0, seq_len=20, truncated=True)],
              [out(0), out(0), out(0), out(0)],
              [out(1), out(1), out(0), out(0, ok=False)]]
    m = check_metrics(groups, "eval/x/")
    assert m["eval/x/reward/mean"] == pytest.approx(3 / 11) and m["eval/x/rollouts/failed"] == 1.0
    assert m["eval/x/reward/std"] == pytest.approx(math.sqrt(3 / 11 * 8 / 11))
    assert m["eval/x/seq_len"] == pytest.approx(120 / 11) and m["eval/x/is_truncated"] == pytest.approx(1 / 11)
    # per example c = 1, 0, 2 of n = 4 (the failed rollout counts as incorrect)
    assert m["eval/x/pass@1"] == pytest.approx((0.25 + 0 + 0.5) / 3)
    assert m["eval/x/pass@2"] == pytest.approx((0.5 + 0 + (1 - 1 / 6)) / 3)
    assert m["eval/x/pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert not any("pass@" in k for k in check_metrics([[out(0.5), out(1)]], "v/"))  # not binary
    assert not any("pass@" in k for k in check_metrics([[out(1)], [out(0)]], "v/"))  # one rollout each
    none = check_metrics([[out(0, ok=False)]], "v/")
    assert math.isnan(none["v/reward/mean"]) and none["v/rollouts/failed"] == 1.0 and none["v/seq_len"] == 0.0


@pytest.fixture(scope="module")
def lowercase() -> loader.LoadedEnv:
    return loader.load_env("jaxrl/lowercase", {"num_eval_examples": 5})


def test_checks_play_the_configured_examples_rollouts_and_seeds(lowercase):
    cfg = RunConfig.model_validate(BASE | {
        "env": [{"id": "jaxrl/lowercase", "name": "a", "args": {"num_eval_examples": 5}},
                {"id": "jaxrl/lowercase", "name": "b"}],
        "eval": {"interval": 3, "num_examples": 2, "rollouts_per_example": 2, "env": [
            {"id": "jaxrl/reverse-text", "args": {"num_eval_examples": 3}, "num_examples": -1,
             "rollouts_per_example": 4},
            {"id": "jaxrl/lowercase", "name": "lc"}]},
        "val": {"num_examples": 4, "rollouts_per_example": 3, "interval": 2}})
    eval_envs = evaluate.load_eval_envs(cfg)
    no_eval_split = dataclasses.replace(lowercase, eval_tasks=[])
    console = Console(file=io.StringIO(), width=200)
    ev = Evaluator(cfg, [lowercase, no_eval_split], eval_envs, {}, None, console)
    plan = [(s.kind, s.name, [t.data.name for t in s.env.tasks], s.rollouts_per_example) for s in ev.suites]
    assert plan == [
        ("eval", "jaxrl/reverse-text", ["eval-0", "eval-1", "eval-2"], 4),  # args reached the taskset
        ("eval", "lc", ["eval-0", "eval-1"], 2),  # the [eval] defaults
        ("val", "a", ["eval-0", "eval-1", "eval-2", "eval-3"], 3),
        ("val", "b", ["train-0", "train-1", "train-2", "train-3"], 3),  # no eval split: train examples
    ]
    assert "val b: 4 examples of its tasks (it has no eval split) x 3 rollouts" in console.file.getvalue()
    training_first = 3 * SEED_MULTIPLIER * 4  # ProducerSettings.of_run: the first training seed of this config
    seeds = [(s.first_seed, s.first_seed + len(s.env.tasks) * s.rollouts_per_example) for s in ev.suites]
    assert seeds == [(training_first - 2**30, training_first - 2**30 + 12),
                     (training_first - 2**30 + 12, training_first - 2**30 + 16),
                     (training_first - 2**29, training_first - 2**29 + 12),
                     (training_first - 2**29 + 12, training_first - 2**29 + 24)]
    assert [s for s in range(10) if ev.due("eval", s)] == [0, 3, 6, 9]
    assert [s for s in range(10) if ev.due("val", s)] == [2, 4, 6, 8]
    no_base = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"eval_base_model": False})})
    assert [s for s in range(7) if Evaluator(no_base, [lowercase] * 2, eval_envs, {}, None, console).due(
        "eval", s)] == [3, 6]
    nothing = RunConfig.model_validate(BASE | {"env": [{"id": "jaxrl/lowercase"}]})
    assert Evaluator(nothing, [lowercase], [], {}, None, console).run(0, None) == {}  # nothing due, nothing played


def test_eval_env_errors_name_the_key(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text('model = "m"\n[[env]]\nid = "o/n"\n[eval]\n[[eval.env]]\nid = "jaxrl/lowercase"\n'
                    '[[eval.env]]\nid = "jaxrl/lowercase"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.problems == [("eval.env.1.name", "'jaxrl/lowercase' is also the name of eval.env.0; give each "
                                                      "[[eval.env]] a distinct `name` (it labels its metrics)")]
    path.write_text('model = "m"\n[[env]]\nid = "o/n"\n[eval]\n[[eval.env]]\nid = "jaxrl/lowercase"\nname = "a"\n'
                    '[[eval.env]]\nid = "jaxrl/no-such-env"\n')
    with pytest.raises(ConfigError) as err:
        evaluate.load_eval_envs(load_config(path))
    ((key, reason),) = err.value.problems
    assert key == "eval.env.1.id" and "'jaxrl/no-such-env'" in reason and "not importable" in reason
    path.write_text('model = "m"\n[[env]]\nid = "o/n"\n[eval]\n[[eval.env]]\nid = "jaxrl/lowercase"\n'
                    'args = { num_eval_examples = 0 }\n')
    with pytest.raises(ConfigError, match="eval.env.0.id: environment 'jaxrl/lowercase'.*invalid config"):
        evaluate.load_eval_envs(load_config(path))


def test_run_with_eval_val_and_base_model(tmp_path, tiny_model_dir):
    """The real CLI in a subprocess, 2 steps: the base model is evaluated as step 0, [val] after every step,
    [eval] after step 2, each on the configured examples x rollouts, metrics in the step's row."""
    lc_a_and_b = 'id = "jaxrl/lowercase"\nname = "lc-a"\nargs = { num_eval_examples = 2 }\n\n' \
                 '[[env]]\nid = "jaxrl/lowercase"\nname = "lc-b"'
    cfg = write_run_config(tmp_path / "rl.toml", tiny_model_dir, name="evals", max_steps=2, synchronous=False,
                           checkpoint_interval=None, env=lc_a_and_b, tables="""
[eval]
interval = 2
num_examples = 2
rollouts_per_example = 2
eval_base_model = true

[[eval.env]]
id = "jaxrl/reverse-text"
name = "rt"
args = { num_eval_examples = 3, max_words = 2 }
num_examples = -1
rollouts_per_example = 3

[[eval.env]]
id = "jaxrl/lowercase"
name = "lc-eval"

[val]
interval = 1
num_examples = 3
rollouts_per_example = 1
""")
    proc = jaxrl("run", cfg, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in ("eval rt: 3 examples of its eval split x 3 rollouts",  # args, num_examples -1, override
                 "eval lc-eval: 2 examples of its eval split x 2 rollouts",  # the [eval] defaults
                 "val lc-a: 2 examples of its eval split x 1 rollouts",  # its split has 2 < num_examples
                 "val lc-b: 3 examples of its eval split x 1 rollouts"):
        assert line in proc.stdout, proc.stdout[-3000:]
    rows = read_metrics(tmp_path / "runs" / "evals")
    assert [r["step"] for r in rows] == [0, 1, 2]
    base, first, second = rows
    errors = "\n".join(line for line in proc.stdout.splitlines() if "first error" in line)
    assert not errors, errors  # a failed rollout: the run's own line says why
    assert "reward/mean" not in base and not any(k.startswith("val/") for k in base)  # eval only, no training
    assert not any(k.startswith("eval/") for k in first) and "reward/mean" in first  # eval interval 2
    for row in (base, second):
        for name in ("rt", "lc-eval"):
            assert 0 <= row[f"eval/{name}/reward/mean"] <= 1 and row[f"eval/{name}/rollouts/failed"] == 0
            assert row[f"eval/{name}/reward/std"] >= 0 and 0 < row[f"eval/{name}/seq_len"] < 128
        assert row["time/eval"] > 0
    for row in (first, second):
        a, b = row["val/lc-a/reward/mean"], row["val/lc-b/reward/mean"]
        assert row["val/rollouts/failed"] == 0 and 0 <= a <= 1 and 0 <= b <= 1
        assert row["val/reward/mean"] == pytest.approx((2 * a + 3 * b) / 5)  # 2 and 3 examples, 1 rollout each
        assert row["time/val"] > 0
    report = re.search(r"eval base model: rt reward ([\d.]+) \(3 x 3\); lc-eval reward ([\d.]+) \(2 x 2\)",
                       proc.stdout)
    assert report, proc.stdout[-3000:]
    assert float(report[1]) == pytest.approx(base["eval/rt/reward/mean"], abs=6e-4)
    assert float(report[2]) == pytest.approx(base["eval/lc-eval/reward/mean"], abs=6e-4)
    assert re.search(r"val step 1: lc-a reward [\d.]+ \(2 x 1\); lc-b reward [\d.]+ \(3 x 1\)", proc.stdout)
    assert re.search(r"eval step 2: rt reward", proc.stdout) and not re.search(r"eval step 1:", proc.stdout)
