"""On-policy distillation (issue 42): the teacher's per-token advantage `sg[log p_teacher - log p_student]`
in the loss (`jaxrl.rl.losses.policy_loss`), in the train step with an in-process teacher of its own
architecture or with a server's logprobs in the batch (`jaxrl.rl.train.Trainer`), the buffer keeping
equal-reward groups, and `[jax.teacher]`'s checks at load (one line per problem)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, jaxrl, random_batch, read_metrics, shrink, tiny_model_config, tiny_trainer, write_run_config

from jaxrl.config.algorithms import LossConfig
from jaxrl.config.envs import BufferConfig
from jaxrl.config.schema import ConfigError, load_config
from jaxrl.config.teacher import vocabulary
from jaxrl.model import assets, decoder, modules
from jaxrl.parallel.sharding import make_mesh, spec_shardings
from jaxrl.rl import losses
from jaxrl.rl.buffer import Buffer, BufferState

STUDENT = tiny_model_config()
TEACHER = dataclasses.replace(STUDENT, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=2,
                              num_kv_heads=1, head_dim=16)  # another architecture, the same vocabulary
DISTIL = LossConfig(teacher_tau=1.0, adv_tau=0.0)


# --- the loss, on hand-computed numbers -------------------------------------------------------------------------

def test_teacher_term_is_the_per_token_advantage():
    """adv_tau * A + teacher_tau * (teacher - student) per token, through the "is" loss at ratio 1: the
    gradient of the loss with respect to each token's logprob is minus its advantage over the token count."""
    logp = jnp.array([[-1.0, -2.0, 0.0]])
    teacher = jnp.array([[-0.5, -3.0, 0.0]])
    mask = jnp.array([[True, True, False]])
    cfg = LossConfig(teacher_tau=2.0, adv_tau=0.5, mismatch_kl_coef=0.0)

    def loss(lp):
        return losses.policy_loss(lp, logp, jnp.array([1.0]), mask, cfg, teacher_logp_BT=teacher)

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
    advantage = 0.5 * 1.0 + 2.0 * np.array([0.5, -1.0])  # [1.5, -1.5]
    np.testing.assert_allclose(np.asarray(grad)[0, :2], -advantage / 2, rtol=1e-6)
    assert float(grad[0, 2]) == 0.0  # not a loss token
    np.testing.assert_allclose(float(value), -(1.5 * -1.0 + -1.5 * -2.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["teacher/kl"]), ((-1.0 + 0.5) + (-2.0 + 3.0)) / 2, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["teacher/advantage"]), 2.0 * (0.5 - 1.0) / 2, rtol=1e-6)
    np.testing.assert_array_equal(losses.teacher_advantages(logp, teacher), teacher - logp)


@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
def test_every_loss_type_takes_per_token_advantages(kind):
    """A [B, T] advantage equal on every token of a row gives the loss of the [B] one, for each loss type."""
    rng = np.random.default_rng(0)
    logp, inf = (jnp.asarray(-rng.uniform(0.5, 3, (2, 5)), jnp.float32) for _ in range(2))
    adv_B = jnp.array([0.7, -1.2])
    mask = jnp.asarray(rng.random((2, 5)) > 0.3)
    cfg = LossConfig(type=kind)
    per_row, _ = losses.policy_loss(logp, inf, adv_B, mask, cfg)
    per_token, _ = losses.policy_loss(logp, inf, jnp.broadcast_to(adv_B[:, None], (2, 5)), mask, cfg)
    assert float(per_row) == float(per_token)


def test_teacher_tau_needs_the_teacher():
    with pytest.raises(ValueError, match="teacher_tau > 0 needs the teacher's logprobs"):
        losses.policy_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros(1), jnp.ones((1, 2), bool), DISTIL)


# --- the train step on a tiny model ---------------------------------------------------------------------------

def _teacher_weights(cfg, mesh, key=7):
    weights = modules.init_params(cfg, jax.random.key(key))
    return jax.device_put(weights, spec_shardings(modules.param_specs(cfg), cfg.dims(), mesh))


def _full_logprobs(cfg, weights, batch, temperature=1.0):
    """log softmax(logits / T) of every target, from the whole vocabulary's logits: float64 [B, T]."""
    b, t = batch.inputs.shape
    hidden, _ = decoder.forward(cfg, weights, jnp.asarray(batch.inputs),
                                jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
    logits = np.asarray(decoder.logits(weights, hidden), np.float64) / temperature
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return np.take_along_axis(logp, batch.targets[..., None], axis=-1)[..., 0]


def test_teacher_kl_of_a_teacher_of_another_architecture():
    """`teacher/kl` is the mean over sampled tokens of log p_student - log p_teacher, both read from the
    whole vocabulary's logits here; the step's `teacher/advantage` is its negative (teacher_tau 1)."""
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = tiny_trainer(STUDENT, mesh, loss_cfg=DISTIL, teacher_cfg=TEACHER)
    teacher = _teacher_weights(TEACHER, mesh)
    batch = random_batch(3)
    _, metrics = trainer.step(state, base, batch, teacher)
    student_logp = _full_logprobs(STUDENT, base, batch)  # the LoRA starts at zero: the student is its base
    teacher_logp = _full_logprobs(TEACHER, teacher, batch)
    expected = (student_logp - teacher_logp)[batch.loss_mask].mean()
    np.testing.assert_allclose(float(metrics["teacher/kl"]), expected, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["teacher/advantage"]), -expected, rtol=1e-4)
    assert float(metrics["optim/grad_norm"]) > 0


def test_a_teacher_equal_to_the_student_teaches_nothing():
    """Teacher = student: zero advantage on every token, so with adv_tau = 0 (and no mismatch term) the
    loss and the gradient are zero."""
    mesh = make_mesh({}, jax.devices()[:1])
    cfg = DISTIL.model_copy(update={"mismatch_kl_coef": 0.0})
    base, trainer, state = tiny_trainer(STUDENT, mesh, loss_cfg=cfg, teacher_cfg=STUDENT)
    _, metrics = trainer.step(state, base, random_batch(4), base)
    assert abs(float(metrics["teacher/kl"])) < 1e-6 and abs(float(metrics["teacher/advantage"])) < 1e-6
    assert abs(float(metrics["loss"])) < 1e-6 and float(metrics["optim/grad_norm"]) < 1e-5


def test_server_logprobs_in_the_batch_train_as_the_in_process_teacher():
    """A server's logprobs (`Batch.teacher_logprobs`) give the step the in-process teacher's metrics."""
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = tiny_trainer(STUDENT, mesh, loss_cfg=DISTIL, teacher_cfg=TEACHER)
    teacher = _teacher_weights(TEACHER, mesh)
    batch = random_batch(5)
    _, in_process = trainer.step(state, base, batch, teacher)
    served = np.where(batch.loss_mask, _full_logprobs(TEACHER, teacher, batch), 0.0).astype(np.float32)
    base2, external, state2 = tiny_trainer(STUDENT, mesh, loss_cfg=DISTIL)
    _, from_batch = external.step(state2, base2, dataclasses.replace(batch, teacher_logprobs=served))
    for key in ("teacher/kl", "teacher/advantage", "loss", "optim/grad_norm"):
        np.testing.assert_allclose(float(from_batch[key]), float(in_process[key]), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="teacher_tau > 0 needs the teacher's weights"):
        external.step(state2, base2, batch)


def test_teacher_tau_zero_changes_no_metric_bit_for_bit():
    """With teacher_tau = 0 a teacher given to the step (weights, or logprobs in the batch) is not read: two
    steps' metrics and weights equal those of a step without one, bit for bit."""
    mesh = make_mesh({}, jax.devices()[:1])
    base, plain, state = tiny_trainer(STUDENT, mesh)
    _, taught, state_t = tiny_trainer(STUDENT, mesh, teacher_cfg=TEACHER)
    teacher = _teacher_weights(TEACHER, mesh)
    for i in range(2):
        batch = random_batch(10 + i)
        state, metrics = plain.step(state, base, batch)
        with_logprobs = dataclasses.replace(batch, teacher_logprobs=np.ones_like(batch.inference_logprobs))
        state_t, metrics_t = taught.step(state_t, base, with_logprobs, teacher)
        assert jax.device_get(metrics) == jax.device_get(metrics_t)
        assert not any(k.startswith("teacher/") for k in metrics_t)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state.lora, state_t.lora)


# --- the buffer -----------------------------------------------------------------------------------------------

def test_equal_reward_groups_train_with_a_teacher():
    """Difficulty filtering drops a group of equal rewards, unless a teacher gives every token a signal."""
    cfg = BufferConfig(online_difficulty_filtering=True)
    rewards = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]
    jobs = [(0, 0), (0, 1), (0, 2)]
    keep, _ = Buffer((3,), cfg).record(BufferState.fresh(1), jobs, rewards)
    assert keep == [False, True, False]
    keep, state = Buffer((3,), cfg, dense_signal=True).record(BufferState.fresh(1), jobs, rewards)
    assert keep == [True, True, True] and state.mean_reward[0] == {0: 1.0, 1: 0.5, 2: 0.0}


# --- [jax.teacher] at load ------------------------------------------------------------------------------------

def _toml(tmp_path, model, teacher_lines, loss="teacher_tau = 1.0\nadv_tau = 0.0"):
    path = tmp_path / "distill.toml"
    path.write_text(f'model = "{model}"\n[[env]]\nid = "jaxrl/lowercase"\n[jax.loss]\n{loss}\n'
                    f'[jax.teacher]\n{teacher_lines}\n')
    return path


def _one_line(path):
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_teacher_of_the_same_tokenizer_loads(tmp_path, tiny_model_dir):
    cfg = load_config(_toml(tmp_path, tiny_model_dir, f'model = "{tiny_model_dir}"'))
    assert cfg.jax.teacher.model == str(tiny_model_dir) and cfg.jax.loss.teacher_tau == 1.0


def test_bad_teachers_are_one_line(tmp_path, tiny_model_dir):
    missing = _one_line(_toml(tmp_path, tiny_model_dir, 'model = "./no-such-teacher"'))
    assert missing.startswith(f"{tmp_path / 'distill.toml'}: jax.teacher.model: model './no-such-teacher' not found")
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello-there"] = vocab.pop("Hello")  # one token renamed: another vocabulary
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    line = _one_line(_toml(tmp_path, tiny_model_dir, f'model = "{other}"'))
    assert "jax.teacher.model: the teacher's tokenizer" in line and "is not the student's" in line
    assert f"token id {vocab['hello-there']} is 'hello-there' there, 'Hello' here" in line
    both = _one_line(_toml(tmp_path, tiny_model_dir, f'model = "{tiny_model_dir}"\nbase_url = "http://x/v1"\n'
                                                     f'model_name = "t"'))
    assert both.endswith("jax.teacher: set one of model (a model scored in process) and base_url (a server), not both")
    no_name = _one_line(_toml(tmp_path, tiny_model_dir, 'base_url = "http://127.0.0.1:9/v1"'))
    assert no_name.endswith("jax.teacher.model_name: required with base_url (the model the server serves)")
    unused = _one_line(_toml(tmp_path, tiny_model_dir, f'model = "{tiny_model_dir}"', loss="kl_coef = 0.0"))
    assert unused.endswith("jax.teacher: has no effect with [jax.loss] teacher_tau = 0; set teacher_tau > 0 "
                           "(1.0, with adv_tau = 0, is pure distillation) or remove the table")
    path = tmp_path / "no-teacher.toml"
    path.write_text(f'model = "{tiny_model_dir}"\n[[env]]\nid = "o/n"\n[jax.loss]\nteacher_tau = 0.5\n')
    assert _one_line(path).endswith("jax.loss.teacher_tau: 0.5 needs a teacher: add [jax.teacher] with model or "
                                    "base_url")


def test_the_shipped_example_loads(tmp_path, tiny_model_dir):
    """configs/distill.toml: pure distillation (adv_tau 0) from the exported quickstart."""
    text = (REPO / "configs" / "distill.toml").read_text()
    path = tmp_path / "distill.toml"
    path.write_text(shrink(text, [('"../runs/quickstart-hf"', f'"{tiny_model_dir}"'),
                                  ('"../assets/qwen3-tiny"', f'"{tiny_model_dir}"')]))
    cfg = load_config(path)
    assert (cfg.jax.loss.teacher_tau, cfg.jax.loss.adv_tau) == (1.0, 0.0)
    assert cfg.jax.teacher.model == str(tiny_model_dir) and cfg.eval.eval_base_model


# --- a run -----------------------------------------------------------------------------------------------------

def test_a_distillation_run_logs_the_teacher_kl(tmp_path, tiny_model_dir):
    """`jaxrl run` with an in-process teacher of another random initialisation (the same tokenizer), pure
    distillation with difficulty filtering on: two steps, every group trained, `teacher/kl` logged and
    positive; the teacher is not in the checkpoint, and the resumed run loads it again."""
    teacher = assets.build_tiny_model(tmp_path / "teacher", seed=1, layers=3)
    distil = f'\n[jax.loss]\nteacher_tau = 1.0\nadv_tau = 0.0\n\n[jax.teacher]\nmodel = "{teacher}"\n'
    cfg = write_run_config(tmp_path / "distil.toml", tiny_model_dir, name="distil", max_steps=2, jax_extra=distil,
                           tables="[buffer]\nonline_difficulty_filtering = true\n")
    done = jaxrl("run", cfg, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"teacher {teacher}" in done.stdout
    rows = read_metrics(tmp_path / "runs" / "distil")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["teacher/kl"] > 0 and r["train/samples"] == 8 and r["buffer/filtered_groups"] == 0 for r in rows)
    assert all(r["teacher/advantage"] == pytest.approx(-r["teacher/kl"], rel=1e-5) for r in rows)
    write_run_config(cfg, tiny_model_dir, name="distil", max_steps=3, jax_extra=distil,
                     tables="[buffer]\nonline_difficulty_filtering = true\n")
    resumed = jaxrl("run", cfg, timeout=1200)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from checkpoint step 2" in resumed.stdout and f"teacher {teacher}" in resumed.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "distil")] == [1, 2, 3]
    _a_run_teaches(tmp_path, tiny_model_dir, tmp_path / "runs" / "distil")


def _a_run_teaches(tmp_path, student, run_dir):
    """A real run's folder as `[jax.teacher] model` (found as `jaxrl serve` takes it): its latest checkpoint
    (step 3), its LoRA folded into its base weights, scores as the run's own forward pass with the LoRA
    does; a folder that is neither a model nor a run is one line."""
    from jaxrl.compile.architecture import teacher_model_of
    from jaxrl.export import exporter
    from jaxrl.run.teacher import check_vocabulary, find_teacher, load_teacher

    cfg = load_config(_toml(tmp_path, student, f'model = "{run_dir}"'))
    files = find_teacher(cfg)
    assert (files.where, files.run.step, files.tokenizer_path) == (str(run_dir), 3, str(student))
    assert files.describe() == f"{run_dir} (checkpoint step 3: LoRA r4 folded into {student})"
    check_vocabulary(cfg, str(student), files.tokenizer_path)
    with pytest.raises(ConfigError, match="jaxrl compile` reads a teacher's architecture from a model folder"):
        teacher_model_of(cfg)  # a run has no config.json of its own: one line, not a traceback
    mesh = make_mesh({})
    teacher = load_teacher(cfg, mesh, jnp.float32, files)
    mcfg, base = teacher.config, qwen3_hf_weights(student)
    lora = exporter.restore_trained(files.run, mcfg).lora
    ids = jnp.asarray([[9707, 1879, 11, 1246, 151644]])
    positions = jnp.arange(5)[None]
    scale = files.run.lora_alpha / files.run.lora_rank
    want = decoder.logits(base, decoder.forward(mcfg, base, ids, positions, lora=lora, lora_scale=scale)[0])
    got = decoder.logits(teacher.weights, decoder.forward(mcfg, teacher.weights, ids, positions)[0])
    assert float(jnp.abs(want - decoder.logits(base, decoder.forward(mcfg, base, ids, positions)[0])).max()) > 1e-3
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
    (tmp_path / "neither").mkdir()
    with pytest.raises(ConfigError) as err:
        find_teacher(load_config(_toml(tmp_path, student, 'model = "neither"')))
    assert str(err.value).count("\n") == 0 and "jax.teacher.model: the teacher " in str(err.value)
    assert "is neither a model folder (config.json + safetensors) nor a jaxrl run or checkpoint" in str(err.value)
    other = _other_tokenizer(tmp_path, student)  # `jaxrl validate` compares a run teacher's tokenizer
    path = tmp_path / "other-student.toml"
    path.write_text(f'model = "{student}"\n[[env]]\nid = "jaxrl/lowercase"\n[jax]\ntokenizer_path = "{other}"\n'
                    f'[jax.loss]\nteacher_tau = 1.0\nadv_tau = 0.0\n[jax.teacher]\nmodel = "{run_dir}/checkpoints/2"\n')
    done = jaxrl("validate", path)
    assert done.returncode == 2, done.stdout + done.stderr
    line, = done.stderr.strip().splitlines()
    assert line.startswith(f"{path}: jax.teacher.model: the teacher's tokenizer ({student}, ")
    assert f"is not the student's ({other}, " in line


def qwen3_hf_weights(folder):
    from jaxrl.model import hf

    return hf.load_hf(str(folder))[1]


def _other_tokenizer(tmp_path, tiny_model_dir):
    """The tiny model's tokenizer files with the ids of "Hello" and " world" swapped: it loads and encodes,
    into other ids."""
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, other / name)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["Hello"], vocab["Ġworld"] = vocab["Ġworld"], vocab["Hello"]
    (other / "tokenizer.json").write_text(json.dumps(data))
    return other


def test_a_gcs_teachers_tokenizer_is_compared(tmp_path, tiny_model_dir, gcs):
    """A `gs://` teacher's tokenizer, read through the real GCS emulator before any weight loads: the same
    files pass, another vocabulary is one line naming both folders and the first id they differ on."""
    from etils import epath

    from jaxrl.run.teacher import check_vocabulary

    other = _other_tokenizer(tmp_path, tiny_model_dir)
    for url, folder in (("gs://jaxrl-test/teacher-same", tiny_model_dir), ("gs://jaxrl-test/teacher-other", other)):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (epath.Path(url) / name).write_text((folder / name).read_text())
    cfg = load_config(_toml(tmp_path, tiny_model_dir, 'model = "gs://jaxrl-test/teacher-other"'))
    check_vocabulary(cfg, str(tiny_model_dir), "gs://jaxrl-test/teacher-same")
    with pytest.raises(ConfigError) as err:
        check_vocabulary(cfg, str(tiny_model_dir), "gs://jaxrl-test/teacher-other")
    vocab, size = vocabulary(tiny_model_dir), len(vocabulary(tiny_model_dir))
    first = min(vocab["Hello"], vocab["Ġworld"])
    assert str(err.value).splitlines() == [
        f"{tmp_path / 'distill.toml'}: jax.teacher.model: the teacher's tokenizer (gs://jaxrl-test/teacher-other, "
        f"{size} tokens) is not the student's ({tiny_model_dir}, {size} tokens): token id "
        f"{first} is {'Ġworld' if first == vocab['Hello'] else 'Hello'!r} there, "
        f"{'Hello' if first == vocab['Hello'] else 'Ġworld'!r} here; distillation scores the student's token ids, "
        "so the teacher must share its vocabulary"]
    with pytest.raises(ConfigError, match="no tokenizer in gs://jaxrl-test/nothing-here"):
        check_vocabulary(cfg, str(tiny_model_dir), "gs://jaxrl-test/nothing-here")
