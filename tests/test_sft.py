"""Supervised fine-tuning: the JSONL forms and their errors, the assistant-only mask through the real Qwen3
chat template, packing (positions, segments), the epoch order, the SFT loss, and a tiny `jaxrl sft` run
whose checkpoint an RL run warm-starts from."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import REPO, jaxrl, read_metrics, tiny_model_config, tiny_trainer
from rich.console import Console
from typer.testing import CliRunner

from jaxrl.cli.main import app
from jaxrl.config.schema import ConfigError, load_config
from jaxrl.config.sft import DataError, parse_line, read_jsonl
from jaxrl.model import assets, hf_lora
from jaxrl.parallel.sharding import make_mesh
from jaxrl.rl import losses, sft
from jaxrl.run import runner
from jaxrl.run.checkpoint import Checkpointer
from jaxrl.run.runner import Run
from jaxrl.run.sft import SftRun

CFG = tiny_model_config()
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"}]


@pytest.fixture(scope="module")
def template(qwen3_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir), local_files_only=True)


# -- the JSONL forms ---------------------------------------------------------------------------------------


def test_parse_line_forms():
    assert parse_line(json.dumps({"messages": CHAT})) == (CHAT, 0, None)
    messages, context, _ = parse_line(json.dumps({"prompt": "hi", "completion": "hello"}))
    assert messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] and context == 0
    prompt, completion = CHAT[:4], [CHAT[4]]
    assert parse_line(json.dumps({"prompt": prompt, "completion": completion})) == (CHAT, 1, None)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert parse_line(json.dumps({"messages": CHAT, "tools": tools})) == (CHAT, 0, tools)


@pytest.mark.parametrize(("line", "reason"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ('{"text": "x"}', "needs 'messages', or 'prompt' and 'completion'; has ['text']"),
    ('{"prompt": "x"}', "needs 'messages', or 'prompt' and 'completion'"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role 'robot' is not one of"),
    ('{"messages": [{"role": "user", "content": 3}]}', "messages[0].content must be a string, got int"),
    ('{"messages": [{"role": "user"}]}', "messages[0] must be an object with exactly 'role' and 'content'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message to train on"),
    ('{"prompt": [{"role": "assistant", "content": "x"}], "completion": [{"role": "user", "content": "y"}]}',
     "no assistant message to train on"),
    ('{"prompt": "x", "completion": "y", "extra": 1}', "other keys ['extra']"),
    ('{"prompt": "x", "completion": "y", "tools": {"f": 1}}', "'tools' must be a list of objects"),
])
def test_parse_line_refuses(line, reason):
    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        parse_line(line)


def test_a_bad_line_is_named_by_its_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n\n" + '{"prompt": 1, "completion": "b"}\n')
    with pytest.raises(DataError, match=r"d.jsonl line 3: prompt must be a string or a non-empty list"):
        read_jsonl(path)
    path.write_text("\n \n")
    with pytest.raises(DataError, match=r"d.jsonl: no conversation in the file"):
        read_jsonl(path)


SFT_TABLE = '\n[jax.sft]\ndata = "{data}"\n'


def _sft_config(tmp_path: Path, data: str, extra: str = "", env: bool = False) -> Path:
    path = tmp_path / "sft.toml"
    path.write_text(f'model = "m"\n{extra}\n' + ('[[env]]\nid = "jaxrl/lowercase"\n' if env else "")
                    + SFT_TABLE.format(data=data))
    return path


def test_config_errors_name_file_key_and_line(tmp_path):
    with pytest.raises(ConfigError, match=r"sft.toml: jax.sft.data: file not found: .*missing.jsonl"):
        load_config(_sft_config(tmp_path, "missing.jsonl"))
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"messages": []}\n')
    with pytest.raises(ConfigError, match=r"sft.toml: jax.sft.data: .*d.jsonl line 2: messages must be a string or"):
        load_config(_sft_config(tmp_path, "d.jsonl"))
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    cfg = load_config(_sft_config(tmp_path, "d.jsonl"))  # no [[env]]: fine in an SFT config
    assert cfg.env == [] and cfg.jax.sft.data == str(tmp_path / "d.jsonl") and cfg.jax.sft.batch_size == 8
    with pytest.raises(ConfigError, match=r"sft.toml: eval: plays the \[\[env\]\] environments by default"):
        load_config(_sft_config(tmp_path, "d.jsonl", extra="[eval]\n"))
    with pytest.raises(ConfigError, match=r"jax.sft.batch_size: Input should be greater than or equal to 1"):
        load_config(_write(tmp_path / "sft.toml", _sft_config(tmp_path, "d.jsonl").read_text() + "batch_size = 0\n"))


def test_epochs_in_place_of_max_steps(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    epochs = '\nepochs = 2.5\n[jax.optim]\nwarmup_steps = 200\n'  # warmup checked once the steps are known
    assert load_config(_write(tmp_path / "sft.toml", _sft_config(tmp_path, "d.jsonl").read_text() + epochs))
    with pytest.raises(ConfigError, match=r"jax.sft.epochs: set \[jax.sft\] epochs or max_steps, not both"):
        load_config(_write(tmp_path / "sft.toml", "max_steps = 10\n" + (tmp_path / "sft.toml").read_text()))
    assert [sft.epoch_steps(e, 10, 4) for e in (1, 2, 2.5, 0.01)] == [3, 5, 7, 1]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_run_and_sft_commands_take_their_own_kind(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    sft_cfg = _sft_config(tmp_path, "d.jsonl", env=True)
    out = CliRunner().invoke(app, ["run", str(sft_cfg)])
    assert out.exit_code == 2 and "jax.sft: this is an SFT config; train it with `jaxrl sft" in out.output
    rl_cfg = _write(tmp_path / "rl.toml", 'model = "m"\n[[env]]\nid = "jaxrl/lowercase"\n')
    out = CliRunner().invoke(app, ["sft", str(rl_cfg)])
    assert out.exit_code == 2 and "jax.sft: required by `jaxrl sft`" in out.output


# -- tokens and the assistant mask -------------------------------------------------------------------------


def _trained_text(tok, ids, mask) -> list[str]:
    """The decoded runs of masked-in tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def test_mask_covers_assistant_replies_only(template):
    tok = sft.Tokenizer.from_tokenizer(template, enable_thinking=False)
    ids, mask = tok.encode(sft.Conversation(1, CHAT, 0))
    assert template.decode(ids) == template.apply_chat_template(CHAT, tokenize=False, enable_thinking=False)
    # each reply and its end-of-turn; the last turn's empty think block is the generation prompt's, not trained
    assert _trained_text(template, ids, mask) == ["hello there<|im_end|>", "ok<|im_end|>"]
    ids, mask = tok.encode(sft.Conversation(1, CHAT, 1))  # prompt/completion: the prompt's reply is context
    assert _trained_text(template, ids, mask) == ["ok<|im_end|>"]
    thinking = sft.Tokenizer.from_tokenizer(template, enable_thinking=True)
    ids, mask = thinking.encode(sft.Conversation(1, CHAT, 1))  # thinking on: the model writes the think block
    assert _trained_text(template, ids, mask) == ["<think>\n\n</think>\n\nok<|im_end|>"]


def test_load_names_a_line_the_template_cannot_render(tmp_path, template):
    class Refusing:
        chat_template = "x"

        def encode(self, text, add_special_tokens=False):
            return template.encode(text, add_special_tokens=add_special_tokens)

        def apply_chat_template(self, messages, **kw):
            raise ValueError("bad role order")

    (tmp_path / "d.jsonl").write_text('\n{"prompt": "a", "completion": "b"}\n')
    with pytest.raises(DataError, match=r"d.jsonl line 2: the chat template cannot render it: .*bad role order"):
        sft.load(tmp_path / "d.jsonl", sft.Tokenizer.from_tokenizer(Refusing(), None), 64, 0)


# -- packing -----------------------------------------------------------------------------------------------


def test_pack_rows_positions_and_segments():
    samples = [([1, 2, 3, 4], [False, False, True, True]),   # 3 pairs
               ([5, 6, 7], [False, True, True]),              # 2 pairs: fits the first row (5 of 6)
               ([8, 9, 10, 11, 12], [False] * 4 + [True]),    # 4 pairs: a new row
               ([13, 14], [True, False]),                     # no loss token after the first: dropped
               (list(range(20, 30)), [False, True] * 5)]      # 10 tokens: cut to 7, a third row
    d = sft.pack(samples, 6)
    assert (d.rows, d.conversations, d.truncated) == (3, 4, 1)
    assert d.inputs.tolist()[:2] == [[1, 2, 3, 5, 6, 0], [8, 9, 10, 11, 0, 0]]
    assert d.targets.tolist()[0] == [2, 3, 4, 6, 7, 0]
    assert d.positions.tolist()[:2] == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert d.segment_ids.tolist()[:2] == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]]
    assert d.loss_mask.tolist()[:2] == [[False, True, True, True, True, False],
                                        [False, False, False, True, False, False]]
    assert d.inputs.tolist()[2] == list(range(20, 26)) and d.targets.tolist()[2] == list(range(21, 27))
    b = d.batch(np.array([0, 1]))  # as wide as row 0 needs, the fullest, in every batch
    assert b.loss_positions.tolist() == [[1, 2, 3, 4] + [6] * 2, [3] + [6] * 5]
    wide = sft.pack([(list(range(22)), [True] * 22), ([1, 2], [False, True])], 21)  # rows of 21 and 1 loss tokens
    assert wide.batch(np.array([1])).loss_positions.shape == (1, 21)  # not 16: one shape, one compile
    assert b.temperature.tolist() == [1.0, 1.0] and not b.advantages.any()
    with pytest.raises(ValueError, match="no conversation has an assistant token"):
        sft.pack([([1, 2], [True, False])], 6)


def test_step_rows_cover_each_epoch_once_and_resume_alike():
    taken = np.concatenate([sft.step_rows(s, 3, 7, seed=5) for s in range(7)])  # 21 rows = 3 epochs of 7
    for e in range(3):
        assert sorted(taken[7 * e: 7 * e + 7].tolist()) == list(range(7))
    assert not np.array_equal(taken[:7], taken[7:14])  # each epoch in its own order
    assert sft.step_rows(4, 3, 7, seed=5).tolist() == taken[12:15].tolist()


# -- the loss ----------------------------------------------------------------------------------------------


@pytest.mark.numerics
def test_sft_loss_is_the_token_mean_nll():
    logp = np.log(np.array([[0.5, 0.25, 0.9], [0.1, 1.0, 0.2]], np.float32))
    mask = np.array([[True, True, False], [False, False, True]])
    loss, _ = losses.sft_loss(logp, mask)
    assert float(loss) == pytest.approx(-(np.log(0.5) + np.log(0.25) + np.log(0.2)) / 3, rel=1e-6)
    assert float(losses.sft_loss(logp, np.zeros_like(mask))[0]) == 0.0


def _rows(seed: int, n: int, width: int):
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        k = int(rng.integers(5, 10))
        ids = rng.integers(0, CFG.vocab_size, k).tolist()
        samples.append((ids, [i >= 2 for i in range(k)]))
    return samples


@pytest.mark.numerics
def test_sft_step_packed_equals_one_sample_per_row_and_loss_falls():
    """The SFT loss of packed rows equals the loss of the same samples one per row (segments keep them
    apart in the train step), and a few steps on a tiny set lower it."""
    mesh = make_mesh({}, jax.devices()[:1])
    base, trainer, state = tiny_trainer(CFG, mesh, objective="sft")
    samples = _rows(0, 6, 32)
    packed, single = sft.pack(samples, 32), sft.pack(samples, 9)  # 9 pairs: room for one sample per row
    assert packed.rows < single.rows == 6
    params, loss = {"base": base, "lora": state.lora}, jax.jit(lambda p, b: trainer.loss(p, b)[0])
    one = loss(params, trainer.shard_batch(packed.batch(np.arange(packed.rows))))
    alone = loss(params, trainer.shard_batch(single.batch(np.arange(single.rows))))
    assert float(one) == pytest.approx(float(alone), rel=1e-5)
    batch = packed.batch(np.arange(packed.rows))
    seen = []
    for _ in range(4):
        state, metrics = trainer.step(state, base, batch)
        seen.append(float(metrics["loss"]))
    assert seen[0] == pytest.approx(float(one), rel=1e-5) and seen[-1] < seen[0] - 0.1


# -- a run, then an RL run from its checkpoint ------------------------------------------------------------


def _warm_start_files(tmp_path: Path, *, learning_rate: float, jax_extra: str) -> tuple[Path, str]:
    """The tiny model's folder, and `tmp_path/d.jsonl` (4 prompt/completion pairs) written; returns the folder
    and the TOML shared by a warm-start test's SFT and RL configs (lowercase env, checkpoints every 2 steps,
    runs under `tmp_path/runs`, seq_len 128), its `[jax]` table ending with `jax_extra`."""
    model = assets.ensure_tiny_assets(REPO / "assets").resolve()
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"say {w}", "completion": f"{w} {w}"}) + "\n"
                                              for w in ("cat", "dog", "sun", "sea")))
    common = f"""model = "jaxrl/qwen3-tiny"
learning_rate = {learning_rate}
[[env]]
id = "jaxrl/lowercase"
[checkpoints]
interval = 2
[jax]
model_path = "{model}"
output_dir = "{tmp_path / 'runs'}"
seq_len = 128
"""
    return model, common + jax_extra


def test_sft_run_checkpoints_and_an_rl_run_warm_starts_from_it(tmp_path):
    _, common = _warm_start_files(tmp_path, learning_rate=1e-2, jax_extra="lora_rank = 4\n")
    sft_cfg = _write(tmp_path / "sft.toml", f'name = "warm"\n{common}[adapters]\n[jax.sft]\ndata = "d.jsonl"\n'
                                            f'batch_size = 1\nepochs = 3\n')  # one row: 3 steps
    done = jaxrl("sft", sft_cfg)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SFT data: 4 conversations in 1 rows of 128 tokens" in done.stdout, done.stdout
    run_dir = tmp_path / "runs" / "warm"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["tokens_per_s"] > 0 and r["sft/loss_tokens"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # the one row, three times
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    # more steps: the same run resumes from its checkpoint 3 (in this process) and trains step 4 only
    _write(sft_cfg, "max_steps = 4\n" + sft_cfg.read_text().replace("epochs = 3\n", ""))
    runner.run(load_config(sft_cfg), Console(quiet=True), run_class=SftRun)
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    ckpt = Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    assert ckpt.all_steps() == [2, 3, 4]

    rl_cfg = load_config(_write(tmp_path / "rl.toml", f'name = "rl"\nmax_steps = 2\ncheckpoint_id = "warm"\n'
                                                      f'batch_size = 8\nrollouts_per_example = 4\n{common}'))
    rl = Run(rl_cfg, Console(quiet=True), [])
    rl.setup()  # loads the model, the environments and the warm start; starts no engine
    try:
        saved, _ = ckpt.restore(4, rl.state)
        # [adapters]: after the last step
        adapter = hf_lora.load_adapter(run_dir / "adapters" / "step_4", rl.model.config)
        assert sorted(p.name for p in (run_dir / "adapters").iterdir()) == ["step_3", "step_4"]
        for lora in (rl.state.lora, adapter.lora):
            jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), saved.lora, lora)
        assert int(rl.state.step) == 0 and rl.progress.start_step == 0  # the LoRA only: step and optimizer start fresh
    finally:
        rl.ckpt.close()
        ckpt.close()


def test_full_sft_run_trains_every_weight_and_a_full_rl_run_warm_starts_from_it(tmp_path):
    """`jaxrl sft` with `[jax] finetune = "full"` (in process, 2 steps): the loss falls, the checkpoint holds
    every weight, each moved from the model's; an RL run with `finetune = "full"` and `checkpoint_id` naming it
    starts from those weights (bit for bit: its train state and the weights its engine is given at start, so
    its first rollouts sample the SFT'd policy), at step 0 with a fresh optimizer."""
    from jaxrl.model import hf

    model, common = _warm_start_files(tmp_path, learning_rate=1e-3, jax_extra='finetune = "full"\n')
    sft_cfg = _write(tmp_path / "sft.toml", f'name = "full"\n{common}[jax.sft]\ndata = "d.jsonl"\nbatch_size = 1\n'
                                            f'epochs = 2\n')  # one packed row: 2 steps
    runner.run(load_config(sft_cfg), Console(quiet=True), run_class=SftRun)
    run_dir = tmp_path / "runs" / "full"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] < rows[0]["loss"]
    ckpt = Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    assert ckpt.all_steps() == [2] and ckpt.read_meta(2)["identity"]["finetune"] == "full"

    rl_cfg = load_config(_write(tmp_path / "rl.toml", f'name = "rl"\nmax_steps = 2\ncheckpoint_id = "full"\n'
                                                      f'batch_size = 8\nrollouts_per_example = 4\n{common}'))
    rl = Run(rl_cfg, Console(quiet=True), [])
    rl.setup()  # loads the model, the environments and the warm start; starts no engine
    try:
        saved, _ = ckpt.restore(2, rl.state)
        assert saved.lora == {} and int(rl.state.step) == 0 and rl.progress.start_step == 0
        _, start = hf.load_hf(model)
        moved = jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), np.asarray(b)), start, saved.base)
        assert all(jax.tree.leaves(moved))
        for weights in (rl.state.base, rl.engine_params()["base"]):  # float32: the engine's cast is exact
            jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), saved.base, weights)
        fresh = jax.tree.map(lambda x: float(np.abs(np.asarray(x)).max()), rl.state.opt_state)
        assert max(jax.tree.leaves(fresh)) == 0.0  # Adam's count and moments: the SFT run's are not carried over
    finally:
        rl.ckpt.close()
        ckpt.close()


def test_shipped_example_is_valid_and_regenerates():
    """configs/sft_lowercase.toml and configs/rl_from_sft.toml load; the shipped JSONL is what
    scripts/make_sft_lowercase.py writes, every completion scored 1 by the environment's reward."""
    import importlib.util

    from lowercase.taskset import lowercase_fraction

    cfg = load_config(REPO / "configs" / "sft_lowercase.toml")
    assert load_config(REPO / "configs" / "rl_from_sft.toml").checkpoint_id == cfg.name
    spec = importlib.util.spec_from_file_location("make_sft", REPO / "scripts" / "make_sft_lowercase.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    rows = make.rows(0)
    assert [json.loads(line) for line in Path(cfg.jax.sft.data).read_text().splitlines()] == rows
    assert len(rows) == 400 and all(lowercase_fraction(r["completion"]) == 1.0 for r in rows)
