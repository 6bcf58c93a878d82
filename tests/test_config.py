"""jaxrl.config.schema: the Hosted Training schema, its rules, error messages, .env files and the starter."""

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from jaxrl.config.env_file import load_env_file
from jaxrl.config.schema import ConfigError, RunConfig, load_config, resolve_model_path, resolve_tokenizer_path
from jaxrl.config.starter import STARTER_TOML

EXAMPLES = sorted((Path(__file__).parent.parent / "configs" / "examples").glob("*.toml"))
MINIMAL = """\
model = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"
max_steps = 100
batch_size = 128
rollouts_per_example = 8

[sampling]
max_tokens = 2048

[[env]]
id = "primeintellect/reverse-text"
"""


def top(line: str, text: str = MINIMAL) -> str:
    """`text` with the top-level `line` first, replacing that key's line if there is one."""
    key = line.split("=")[0].strip()
    return line + "\n" + re.sub(rf"^{key} = .*\n", "", text, count=1, flags=re.M)


def write(tmp_path: Path, text: str, name: str = "rl.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(tmp_path: Path, text: str) -> list[str]:
    """The ConfigError lines of a config file, with the file's path taken off the front."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert all(line.startswith(f"{path}: ") for line in lines)
    return [line.removeprefix(f"{path}: ") for line in lines]


def test_seed_examples_are_all_here():
    names = {p.stem for p in EXAMPLES}
    assert names == {"minimal", "env-args", "multi-env", "eval", "validation", "buffer", "wandb", "env-files",
                     "full"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_seed_examples_load(path):
    cfg = load_config(path)
    assert cfg.model == "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"
    assert cfg.config_dir == path.parent.resolve()
    assert all(Path(f).is_absolute() and Path(f).is_file() for f in cfg.env_file)


def test_defaults_follow_the_reference(tmp_path):
    cfg = load_config(write(tmp_path, 'model = "m"\n[[env]]\nid = "o/n"\n'))
    assert (cfg.max_steps, cfg.batch_size, cfg.rollouts_per_example) == (100, 128, 8)
    assert (cfg.learning_rate, cfg.lora_alpha) == (1e-4, 16)
    assert (cfg.oversampling_factor, cfg.max_async_level) == (2.0, 2)
    assert cfg.trajectory_strategy == "interleaved" and cfg.env_file == [] and cfg.checkpoint_id is None
    assert (cfg.sampling.max_tokens, cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k) == (
        None, 1.0, 1.0, -1)
    assert cfg.eval is None and cfg.val is None and cfg.wandb is None
    assert cfg.buffer.model_dump() == {
        "online_difficulty_filtering": False, "easy_threshold": 0.8, "hard_threshold": 0.2,
        "easy_fraction": 0.0, "hard_fraction": 0.0, "env_ratios": None, "skip_verification": False,
        "seed": 42}
    assert (cfg.checkpoints.interval, cfg.checkpoints.keep_cloud) == (10, 5)
    assert (cfg.adapters.interval, cfg.adapters.keep_last) == (0, 3)
    assert cfg.infrastructure.compute_size == "M"
    assert cfg.jax.model_dump(exclude={"loss", "advantage", "optim"}) == {  # those: test_training_knobs_load...
        "model_path": None, "model_revision": None, "tokenizer_path": None,
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1},
        "seq_len": 4096, "finetune": "lora", "lora_rank": 16,
        "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "dtype": "float32", "output_dir": "runs", "checkpoint_dir": None, "rollout_timeout": 600.0, "seed": 0,
        "decode_slots": 32, "kv_cache_tokens": None, "decode_steps_per_dispatch": None, "kv_reuse_turns": False,
        "remat": False, "micro_batch_size": None, "engine_hosts": 0, "host": "127.0.0.1", "port": 0,
        "teacher": None, "sft": None}


def test_eval_defaults_and_overrides(tmp_path):
    cfg = load_config(EXAMPLES[[p.stem for p in EXAMPLES].index("eval")])
    assert cfg.eval.interval == 100 and cfg.eval.eval_base_model is True
    assert cfg.eval.env[0].model_dump() == {
        "id": "your-username/eval-env", "name": None, "args": {"split": "test"}, "max_retries": None,
        "version": None, "num_examples": 30, "rollouts_per_example": 4}
    cfg = load_config(write(tmp_path, MINIMAL + "[eval]\n[val]\n"))
    assert (cfg.eval.num_examples, cfg.eval.rollouts_per_example, cfg.eval.env) == (-1, 1, [])
    assert (cfg.val.num_examples, cfg.val.rollouts_per_example, cfg.val.interval) == (64, 1, 5)


def test_every_field_is_documented():
    def walk(model: type[BaseModel]):
        for name, field in model.model_fields.items():
            yield model, name, field
            for sub in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    yield from walk(sub)

    undocumented = [f"{m.__name__}.{n}" for m, n, f in walk(RunConfig) if not f.description]
    assert undocumented == []


def test_v1_taskset_and_harness_pass_through(tmp_path):
    text = MINIMAL + '[env.taskset]\nsplit = "train"\n[env.harness]\nmax_turns = 3\n'
    cfg = load_config(write(tmp_path, text))
    assert cfg.env[0].taskset == {"split": "train"} and cfg.env[0].harness == {"max_turns": 3}
    assert cfg.env[0].display_name == "primeintellect/reverse-text"


NO_ENV = MINIMAL.replace('[[env]]\nid = "primeintellect/reverse-text"\n', "")


@pytest.mark.parametrize(("text", "expected"), [
    (top("batch_size = 100"), "batch_size: 100 is not divisible by rollouts_per_example (8)"),
    (MINIMAL.replace("max_tokens = 2048", "max_tokens = 2048\ntemperature = -0.5"),
     "sampling.temperature: Input should be greater than or equal to 0, got -0.5"),
    (MINIMAL.replace("primeintellect/reverse-text", "foo"),
     "env.0.id: 'foo' is not in owner/name[@version] form"),
    (MINIMAL.replace("max_tokens = 2048", "max_tokens = 4096"),
     "sampling.max_tokens: 4096 must be < jax.seq_len (4096); raise [jax] seq_len"),
    (top("max_async_level = 1"), "max_async_level: 1 must be >= oversampling_factor (2.0)"),
    (top("oversampling_factor = 2.5"), "max_async_level: 2 must be >= oversampling_factor (2.5)"),
    (top("max_async_level = 0"),
     "oversampling_factor: 2.0 must be 1 with max_async_level = 0 (synchronous: a rollout beyond the batch "
     "would be stale at the next step)"),
    (top("max_async_level = -1\noversampling_factor = 1"),
     "max_async_level: Input should be greater than or equal to 0, got -1"),
    (top("max_steps = 0"), "max_steps: Input should be greater than or equal to 1, got 0"),
    (top("rollouts_per_example = -8"),
     "rollouts_per_example: Input should be greater than or equal to 1, got -8"),
    (top("learning_rate = 0.0"), "learning_rate: Input should be greater than 0, got 0.0"),
    (top("oversampling_factor = 0.5"),
     "oversampling_factor: Input should be greater than or equal to 1, got 0.5"),
    (MINIMAL.replace("max_tokens = 2048", "max_tokens = 0"),
     "sampling.max_tokens: Input should be greater than or equal to 1, got 0"),
    (MINIMAL.replace("max_tokens = 2048", "top_k = 0"), "sampling.top_k: must be -1 (off) or >= 1, got 0"),
    (MINIMAL.replace("max_tokens = 2048", "top_p = 0.0"),
     "sampling.top_p: Input should be greater than 0, got 0.0"),
    (MINIMAL.replace('id = "primeintellect/reverse-text"', 'name = "x"'),
     "env.0.id: required key is missing"),
    (NO_ENV, "env: required key is missing (at least one [[env]]; only an SFT config, with [jax.sft], may "
             "have none)"),
    (top("env = []", NO_ENV), "env: required key is missing (at least one [[env]]; only an SFT config, with "
                              "[jax.sft], may have none)"),
    (re.sub("^model = .*\n", "", MINIMAL), "model: required key is missing"),
])
def test_rule_violations_name_the_key(tmp_path, text, expected):
    assert problems(tmp_path, text) == [expected]


GE = "Input should be greater than or equal to"
LE = "Input should be less than or equal to"


@pytest.mark.parametrize(("table", "expected"), [
    ("[buffer]\neasy_threshold = 0.3\nhard_threshold = 0.5",
     "buffer.hard_threshold: 0.5 must be <= easy_threshold (0.3)"),
    ("[buffer]\neasy_threshold = 1.5", f"buffer.easy_threshold: {LE} 1, got 1.5"),
    ("[buffer]\nhard_threshold = -0.1", f"buffer.hard_threshold: {GE} 0, got -0.1"),
    ("[buffer]\neasy_fraction = 1.01", f"buffer.easy_fraction: {LE} 1, got 1.01"),
    ("[buffer]\nhard_fraction = -1.0", f"buffer.hard_fraction: {GE} 0, got -1.0"),
    ("[buffer]\nenv_ratios = [0.0]", "buffer.env_ratios: entries must be >= 0 with a positive sum"),
    ("[buffer]\nenv_ratios = [-1.0, 2.0]", "buffer.env_ratios: entries must be >= 0 with a positive sum"),
    ("[checkpoints]\nkeep_cloud = 0", "checkpoints.keep_cloud: must be -1 (all) or >= 1, got 0"),
    ("[checkpoints]\ninterval = 0", f"checkpoints.interval: {GE} 1, got 0"),
    ("[adapters]\nkeep_last = -2", "adapters.keep_last: must be -1 (all) or >= 1, got -2"),
    ("[adapters]\ninterval = -1", f"adapters.interval: {GE} 0, got -1"),
    ('[infrastructure]\ncompute_size = "XL"',
     "infrastructure.compute_size: Input should be 'S', 'M' or 'L', got 'XL'"),
    ("[eval]\nnum_examples = 0", "eval.num_examples: must be -1 (all) or >= 1, got 0"),
    ('[eval]\n[[eval.env]]\nid = "bad"', "eval.env.0.id: 'bad' is not in owner/name[@version] form"),
    ('[eval]\n[[eval.env]]\nid = "o/n"\nrollouts_per_example = 0',
     f"eval.env.0.rollouts_per_example: {GE} 1, got 0"),
    ("[val]\ninterval = 0", f"val.interval: {GE} 1, got 0"),
    ("[jax.mesh]\ntensor = 0", f"jax.mesh.tensor: {GE} 1, got 0"),
    ('[jax]\nlora_targets = ["qkv"]',
     "jax.lora_targets.0: Input should be 'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj' or "
     "'down_proj', got 'qkv'"),
    ('[jax]\nlora_targets = ["q_proj", "q_proj"]', "jax.lora_targets: lists a projection twice"),
    ("[jax]\nlora_targets = []",
     "jax.lora_targets: List should have at least 1 item after validation, not 0, got []"),
    ('[jax]\ndtype = "float16"', "jax.dtype: Input should be 'float32' or 'bfloat16', got 'float16'"),
    ("[jax]\nport = 70000", f"jax.port: {LE} 65535, got 70000"),
    ("[jax]\ndecode_slots = 0", f"jax.decode_slots: {GE} 1, got 0"),
    ("[jax]\nseq_len = 1", f"jax.seq_len: {GE} 2, got 1"),
    ("[jax]\nkv_cache_tokens = 4000", "jax.kv_cache_tokens: 4000 must be >= jax.seq_len (4096): one sequence must "
                                      "fit the pool"),
    ("[jax]\nkv_reuse_turns = true", "jax.kv_reuse_turns: needs the paged cache: set [jax] kv_cache_tokens"),
])
def test_table_rules(tmp_path, table, expected):
    assert problems(tmp_path, MINIMAL + table + "\n") == [expected]


FULL_ONLY = 'has no effect with [jax] finetune = "full" (every weight trains, there is no LoRA); remove it'


def test_full_finetuning_refuses_lora_settings(tmp_path):
    """`[jax] finetune = "full"` trains no LoRA: each LoRA setting the file sets away from its default is an
    error naming its key; the defaults are not (a saved run config holds every field)."""
    cfg = load_config(write(tmp_path, MINIMAL + '[jax]\nfinetune = "full"\n'))
    assert cfg.jax.finetune == "full" and load_config(write(tmp_path, MINIMAL)).jax.finetune == "lora"
    assert type(cfg).model_validate(cfg.model_dump(mode="json")).jax.finetune == "full"  # as run_config.json
    text = top("lora_alpha = 32", MINIMAL) + '[adapters]\ninterval = 5\n[jax]\nfinetune = "full"\nlora_rank = 8\n' \
        'lora_targets = ["q_proj"]\n'
    assert problems(tmp_path, text) == [f"jax.lora_rank: {FULL_ONLY}", f"jax.lora_targets: {FULL_ONLY}",
                                        f"lora_alpha: {FULL_ONLY}",
                                        f"adapters: {FULL_ONLY}; `jaxrl export` writes the whole model"]
    assert problems(tmp_path, MINIMAL + '[jax]\nfinetune = "partial"\n') == [
        "jax.finetune: Input should be 'lora' or 'full', got 'partial'"]


def test_env_ratios_must_match_the_envs_when_there_are_several(tmp_path):
    two_envs = MINIMAL + '[[env]]\nid = "primeintellect/alphabet-sort"\n'
    assert problems(tmp_path, two_envs + "[buffer]\nenv_ratios = [0.2, 0.3, 0.5]\n") == [
        "buffer.env_ratios: has 3 entries for 2 [[env]] tables"]
    cfg = load_config(write(tmp_path, two_envs + "[buffer]\nenv_ratios = [1.0, 3.0]\n"))
    assert cfg.buffer.env_ratios == [1.0, 3.0]
    # The seeds' buffer example gives two ratios for a single env: "multi-env only", so ignored there.
    assert load_config(write(tmp_path, MINIMAL + "[buffer]\nenv_ratios = [0.5, 0.5]\n")).buffer.env_ratios


def test_envs_need_distinct_display_names(tmp_path):
    """Each [[env]] labels its metrics (`reward/<name>/mean`): one id twice needs two names."""
    twice = MINIMAL + '[[env]]\nid = "primeintellect/reverse-text"\nargs = { split = "test" }\n'
    assert problems(tmp_path, twice) == ["env.1.name: 'primeintellect/reverse-text' is also the name of env.0; "
                                         "give each [[env]] a distinct `name` (it labels its metrics)"]
    named = load_config(write(tmp_path, twice.replace('args = { split = "test" }', 'name = "rt-test"\nargs = '
                                                      '{ split = "test" }')))
    assert [e.display_name for e in named.env] == ["primeintellect/reverse-text", "rt-test"]


def test_seq_len_can_be_raised_for_long_completions(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL.replace("2048", "6000") + "[jax]\nseq_len = 8192\n"))
    assert (cfg.sampling.max_tokens, cfg.jax.seq_len) == (6000, 8192)


@pytest.mark.parametrize("env_id", ["a/b", "primeintellect/reverse-text", "A.b_c-1/x.y-z_2@0.1.2", "o/n@v2"])
def test_good_env_ids(tmp_path, env_id):
    cfg = load_config(write(tmp_path, MINIMAL.replace("primeintellect/reverse-text", env_id)))
    assert cfg.env[0].id == env_id


@pytest.mark.parametrize("env_id", ["reverse-text", "a/b/c", "/b", "a/", "a/b@", "a b/c", "a/b@1@2", "é/b"])
def test_bad_env_ids(tmp_path, env_id):
    text = MINIMAL.replace("primeintellect/reverse-text", env_id)
    assert problems(tmp_path, text) == [f"env.0.id: {env_id!r} is not in owner/name[@version] form"]


def test_every_field_problem_is_listed(tmp_path):
    text = MINIMAL.replace("max_steps = 100", 'max_steps = "100"').replace("2048", "2048\ntemperature = -1.0")
    text = text.replace("primeintellect/reverse-text", "nope") + "[jax]\nmesh = { data = 0 }\n"
    assert problems(tmp_path, text) == [
        "max_steps: Input should be a valid integer, got '100'",
        "sampling.temperature: Input should be greater than or equal to 0, got -1.0",
        "env.0.id: 'nope' is not in owner/name[@version] form",
        "jax.mesh.data: Input should be greater than or equal to 1, got 0",
    ]


def test_every_cross_field_problem_is_listed(tmp_path):
    text = MINIMAL.replace("batch_size = 128", "batch_size = 12\nmax_async_level = 1").replace("2048", "5000")
    assert problems(tmp_path, text + "[buffer]\nhard_threshold = 0.9\n") == [
        "batch_size: 12 is not divisible by rollouts_per_example (8)",
        "max_async_level: 1 must be >= oversampling_factor (2.0)",
        "sampling.max_tokens: 5000 must be < jax.seq_len (4096); raise [jax] seq_len",
        "buffer.hard_threshold: 0.9 must be <= easy_threshold (0.8)",
    ]


@pytest.mark.parametrize(("text", "expected"), [
    (top("learning_rat = 1e-4"), "learning_rat: unknown key (did you mean 'learning_rate'?)"),
    (top("seq_len = 4096"), "seq_len: unknown key (it belongs in the [jax] table: jax.seq_len)"),
    (MINIMAL.replace("max_tokens = 2048", "max_tokens = 8\ntemprature = 0.7"),
     "sampling.temprature: unknown key (did you mean 'temperature'?)"),
    (MINIMAL + '[[env]]\nid = "o/n"\narg = { a = 1 }\n', "env.1.arg: unknown key (did you mean 'args'?)"),
    (MINIMAL + "[jax]\nlora_rnak = 8\n", "jax.lora_rnak: unknown key (did you mean 'lora_rank'?)"),
    (MINIMAL + "[jax.mesh]\npipeline = 2\n",
     "jax.mesh.pipeline: unknown key (known: data, fsdp, tensor, expert)"),
    (MINIMAL + "[buffer]\nseeds = 1\n", "buffer.seeds: unknown key (did you mean 'seed'?)"),
    (MINIMAL + "[eval]\nintervals = 5\n", "eval.intervals: unknown key (did you mean 'interval'?)"),
    (MINIMAL + '[[eval.env]]\nid = "o/n"\nnum_example = 3\n',
     "eval.env.0.num_example: unknown key (did you mean 'num_examples'?)"),
    (MINIMAL + "[val]\nevery = 5\n",
     "val.every: unknown key (known: num_examples, rollouts_per_example, interval)"),
    (MINIMAL + "[wandb]\nteam = 'x'\n", "wandb.team: unknown key (known: project, entity, name)"),
    (MINIMAL + "[checkpoints]\nkeep = 3\n", "checkpoints.keep: unknown key (known: interval, keep_cloud)"),
    (MINIMAL + "[adapters]\nkeep_lasts = 3\n",
     "adapters.keep_lasts: unknown key (did you mean 'keep_last'?)"),
    (MINIMAL + "[infrastructure]\ngpus = 8\n", "infrastructure.gpus: unknown key (known: compute_size)"),
    (MINIMAL + "[trainer]\nlr = 1.0\n",
     "trainer: unknown key (known: " + ", ".join(RunConfig.model_fields) + ")"),
])
def test_unknown_keys_are_errors(tmp_path, text, expected):
    assert problems(tmp_path, text) == [expected]


@pytest.mark.parametrize(("text", "expected"), [
    (top('batch_size = "128"'), "batch_size: Input should be a valid integer, got '128'"),
    (top("max_steps = 10.0"), "max_steps: Input should be a valid integer, got 10.0"),
    (top("lora_alpha = true"), "lora_alpha: Input should be a valid integer, got True"),
    (top('learning_rate = "1e-4"'), "learning_rate: Input should be a valid number, got '1e-4'"),
    (top('env_file = "secrets.env"'), "env_file: Input should be a valid list, got 'secrets.env'"),
    (top("name = 3"), "name: Input should be a valid string, got 3"),
    (top('trajectory_strategy = "depth-first"'),
     "trajectory_strategy: Input should be 'interleaved' or 'branching', got 'depth-first'"),
    (top("sampling = 3", MINIMAL.replace("[sampling]\nmax_tokens = 2048\n", "")),
     "sampling: Input should be a valid dictionary or instance of SamplingConfig, got 3"),
])
def test_wrong_types_are_errors(tmp_path, text, expected):
    assert problems(tmp_path, text) == [expected]


def test_wrong_types_inside_tables(tmp_path):
    assert problems(tmp_path, MINIMAL + 'args = "split=train"\n') == [
        "env.0.args: Input should be a valid dictionary, got 'split=train'"]
    assert problems(tmp_path, MINIMAL + '[eval]\neval_base_model = "yes"\n') == [
        "eval.eval_base_model: Input should be a valid boolean, got 'yes'"]
    text = MINIMAL.replace('[[env]]\nid = "primeintellect/reverse-text"\n', '[env]\nid = "o/n"\n')
    assert problems(tmp_path, text) == ["env: Input should be a valid list, got {'id': 'o/n'}"]


def test_int_is_accepted_for_floats(tmp_path):
    cfg = load_config(write(tmp_path, "learning_rate = 1\noversampling_factor = 1\n" + MINIMAL))
    assert cfg.learning_rate == 1.0 and cfg.oversampling_factor == 1.0


def test_malformed_toml_names_file_line_and_column(tmp_path):
    (line,) = problems(tmp_path, MINIMAL.replace("max_steps = 100", "max_steps = "))
    assert line.startswith("invalid TOML: ")
    assert re.search(r"\(at line 2, column \d+\)", line)
    (line,) = problems(tmp_path, MINIMAL + "[sampling]\n")
    assert line == "invalid TOML: Cannot declare ('sampling',) twice (at line 11, column 10)"


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.toml: file not found$"):
        load_config(tmp_path / "nope.toml")


def test_env_files_resolve_against_the_config_folder(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "secrets.env").write_text("A=1\n")
    path = write(tmp_path / "conf", 'env_file = ["secrets.env"]\n' + MINIMAL)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(Path("conf/rl.toml"))
    assert cfg.env_file == [str(tmp_path.resolve() / "conf" / "secrets.env")]
    assert cfg.config_dir == path.parent.resolve() and cfg.source == path.resolve()
    dumped = cfg.model_dump()
    assert "config_dir" not in dumped and "_source" not in dumped and "source" not in dumped
    assert load_env_file(cfg.env_file) == {"A": "1"}


def test_missing_env_file_names_the_entry(tmp_path):
    (tmp_path / "here.env").write_text("A=1\n")
    lines = problems(tmp_path, 'env_file = ["here.env", "gone.env"]\n' + MINIMAL)
    assert lines == [f"env_file.1: file not found: {tmp_path.resolve() / 'gone.env'}"]


@pytest.mark.parametrize(("entry", "reason"), [
    ("folder", "a folder, not a .env file: {p}"),  # before: "file not found"
    ("/dev/zero", "not a regular file (a device or a pipe): {p}"),  # before: "file not found"
])
def test_an_env_file_that_is_a_folder_or_a_device_is_named_so(tmp_path, entry, reason):
    """Issue 35 item 7."""
    (tmp_path / "folder").mkdir()
    path = Path(entry) if entry.startswith("/") else tmp_path.resolve() / entry
    assert problems(tmp_path, f'env_file = ["{entry}"]\n' + MINIMAL) == [f"env_file.0: {reason.format(p=path)}"]


@pytest.mark.parametrize(("data", "reason"), [
    (b"\x89PNG\r\n\x1a\n\x00\xff", "not UTF-8 text (invalid start byte at byte 0): not a .env file"),
    (b"A=1\nthis is prose\n", "line 2: expected KEY=VALUE"),
    (b"A=" + b"x" * 2**20, "larger than 1048576 bytes: not a .env file"),
])
def test_a_non_env_file_is_an_error_under_the_configs_key(tmp_path, data, reason):
    """Issue 35 item 7: what the run loads (`load_env_file(cfg.env_file, cfg.source)`) names the config and its
    key, `rl.toml: env_file.0: <file>: <reason>` (before: `<file>: <reason>`, and a binary file a traceback)."""
    (tmp_path / "x.env").write_bytes(data)
    cfg = load_config(write(tmp_path, 'env_file = ["x.env"]\n' + MINIMAL))
    with pytest.raises(ConfigError) as info:
        load_env_file(cfg.env_file, cfg.source)
    assert str(info.value) == f"{cfg.source}: env_file.0: {tmp_path.resolve() / 'x.env'}: {reason}"


def test_load_env_file_syntax(tmp_path):
    first = write(tmp_path, """\
# a comment

PLAIN=value
SPACED = spaced value   # trailing comment
export EXPORTED=yes
SINGLE='single # quoted'
DOUBLE="line\\none \\"quoted\\" # kept"   # comment
HASH=a#b
EMPTY=
URL=https://example.com/?a=b
""", "a.env")
    second = write(tmp_path, "PLAIN=override\n", "b.env")
    assert load_env_file([first, second]) == {
        "PLAIN": "override", "SPACED": "spaced value", "EXPORTED": "yes", "SINGLE": "single # quoted",
        "DOUBLE": 'line\none "quoted" # kept', "HASH": "a#b", "EMPTY": "", "URL": "https://example.com/?a=b"}


def test_load_env_file_literal_single_quotes(tmp_path):
    path = write(tmp_path, "KEY='a \\n b # c'\n", "x.env")
    assert load_env_file([path]) == {"KEY": "a \\n b # c"}


@pytest.mark.parametrize(("text", "reason"), [
    ("GOOD=1\nno equals sign\n", "line 2: expected KEY=VALUE"),
    ("1BAD=1\n", "line 1: expected KEY=VALUE"),
    ('KEY="unterminated\n', 'line 1: unterminated or malformed "-quoted value'),
    ("KEY='a' b\n", "line 1: unterminated or malformed '-quoted value"),
])
def test_load_env_file_errors(tmp_path, text, reason):
    path = write(tmp_path, text, "bad.env")
    with pytest.raises(ConfigError) as info:
        load_env_file([path])
    assert str(info.value) == f"{path}: {reason}"


def test_load_env_file_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"gone\.env: env file not found"):
        load_env_file([tmp_path / "gone.env"])


# Characters that neither end a line (str.splitlines) nor are control characters.
VALUE_CHARS = st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp"))


@given(key=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
       value=st.text(VALUE_CHARS | st.sampled_from("\n\t"), max_size=40))
def test_double_quoted_env_values_round_trip(tmp_path_factory, key, value):
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    path = tmp_path_factory.mktemp("env") / "x.env"
    path.write_text(f'export {key}="{escaped}"  # note\n', encoding="utf-8")
    assert load_env_file([path]) == {key: value}


@given(batch_size=st.integers(1, 4096), rollouts=st.integers(1, 256))
def test_batch_size_valid_iff_divisible(batch_size, rollouts):
    data = {"model": "m", "batch_size": batch_size, "rollouts_per_example": rollouts, "env": [{"id": "o/n"}]}
    try:
        RunConfig.model_validate(data)
        valid = True
    except ValueError as exc:
        assert "is not divisible by rollouts_per_example" in str(exc)
        valid = False
    assert valid == (batch_size % rollouts == 0)


def test_resolve_model_path(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "tok").mkdir()
    cfg = load_config(write(tmp_path, MINIMAL.replace("PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT", "ckpt")))
    assert resolve_model_path(cfg) == str((tmp_path / "ckpt").resolve()) == resolve_tokenizer_path(cfg)
    cfg = load_config(write(tmp_path, MINIMAL + '[jax]\nmodel_path = "ckpt"\ntokenizer_path = "tok"\n'))
    assert resolve_model_path(cfg) == str((tmp_path / "ckpt").resolve())
    assert resolve_tokenizer_path(cfg) == str((tmp_path / "tok").resolve())
    cfg = load_config(write(tmp_path, MINIMAL + '[jax]\nmodel_path = "gs://bucket/qwen3"\n'))
    assert resolve_model_path(cfg) == "gs://bucket/qwen3"


def test_resolve_model_path_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(write(tmp_path, MINIMAL))
    with pytest.raises(ConfigError) as info:
        resolve_model_path(cfg)
    name = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"
    assert str(info.value) == (
        f"{cfg.source}: model: model {name}@main is not in the Hugging Face cache {tmp_path / 'hf-cache'} and "
        f"HF_HUB_OFFLINE is set, so it is not downloaded (and there is no folder {tmp_path / name})")
    cfg = load_config(write(tmp_path, MINIMAL + '[jax]\nmodel_path = "missing"\n'))
    with pytest.raises(ConfigError, match=r": jax\.model_path: model 'missing' not found: no folder "):
        resolve_model_path(cfg)
    with pytest.raises(ConfigError, match=r"jax\.model_revision: String should match pattern"):
        load_config(write(tmp_path, MINIMAL + '[jax]\nmodel_revision = "a b"\n'))


def test_starter_toml_is_valid_and_shows_every_field(tmp_path):
    load_config(write(tmp_path, STARTER_TOML))
    shown = set(re.findall(r"^#? ?(\w+) = ", STARTER_TOML, re.M))
    shown |= {t.rsplit(".", 1)[-1] for t in re.findall(r"^#? ?\[\[?([\w.]+)\]", STARTER_TOML, re.M)}
    shown |= set(re.findall(r"(\w+) = \d", STARTER_TOML))  # the inline mesh table

    def leaves(model: type[BaseModel]):
        for name, field in model.model_fields.items():
            yield name
            for sub in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    yield from leaves(sub)

    assert set(leaves(RunConfig)) - shown - {"env"} == set()


def test_load_env_file_takes_one_path_too(tmp_path):
    assert load_env_file(write(tmp_path, "A=1\n", "one.env")) == {"A": "1"}
    assert load_env_file([]) == {}


def _keys(table: dict, prefix: str = "") -> set[str]:
    """Dotted keys of a TOML document, arrays of tables merged (`env.id`, `eval.env.args`)."""
    out = set()
    for key, value in table.items():
        rows = value if isinstance(value, list) and value and all(isinstance(v, dict) for v in value) else [value]
        for row in rows:
            if isinstance(row, dict) and key != "args":
                out |= _keys(row, f"{prefix}{key}.")
            else:
                out.add(prefix + key)
    return out


def test_full_local_config_sets_every_field_of_the_seeds_full_example():
    """configs/full_local.toml is the seeds' full example run offline (docs/config.md): it sets every key the seed
    sets (values scaled, ids local), and loads."""
    import tomllib

    root = Path(__file__).parent.parent / "configs"
    seed = tomllib.loads((root / "examples" / "full.toml").read_text())
    local = tomllib.loads((root / "full_local.toml").read_text())
    assert _keys(seed) <= _keys(local), sorted(_keys(seed) - _keys(local))
    cfg = load_config(root / "full_local.toml")
    assert cfg.max_async_level == 4 and cfg.oversampling_factor == 2.0 and cfg.eval.eval_base_model


@pytest.mark.parametrize(("table", "expected"), [
    ('[jax.loss]\ntype = "grpo"', "jax.loss.type: Input should be 'is', 'ppo', 'gspo' or 'cispo', got 'grpo'"),
    ('[jax.loss]\naggregation = "mean"',
     "jax.loss.aggregation: Input should be 'token_mean', 'sequence_mean' or 'sequence_sum', got 'mean'"),
    ('[jax.loss]\nkl_estimator = "k4"', "jax.loss.kl_estimator: Input should be 'k1', 'k2' or 'k3', got 'k4'"),
    ("[jax.loss]\nkl_coef = -0.1", f"jax.loss.kl_coef: {GE} 0, got -0.1"),
    ("[jax.loss]\nentropy_coef = -1e-3", f"jax.loss.entropy_coef: {GE} 0, got -0.001"),
    ("[jax.loss]\nmismatch_kl_coef = -1.0", f"jax.loss.mismatch_kl_coef: {GE} 0, got -1.0"),
    ("[jax.loss]\nclip_low = 1.2", f"jax.loss.clip_low: {LE} 1, got 1.2"),
    ("[jax.loss]\nclip_high = 0.28",
     "jax.loss.clip_high: 0.28 must be >= 1: it bounds the ratio itself, 1 + eps_high (DAPO's eps_high 0.28 is "
     "clip_high = 1.28)"),
    ("[jax.loss]\ndual_clip = 0.5", "jax.loss.dual_clip: Input should be greater than 1, got 0.5"),
    ("[jax.loss]\nmask_low = 9.0", "jax.loss: mask_low 9.0 must be <= mask_high 8.0"),
    ("[jax.loss]\naggregation_length = 0", f"jax.loss.aggregation_length: {GE} 1, got 0"),
    ('[jax.advantage]\nestimator = "gae"',
     "jax.advantage.estimator: Input should be 'mean', 'std' or 'rloo', got 'gae'"),
    ("[jax.advantage]\nreward_min = 1.0\nreward_max = 0.0", "jax.advantage: reward_min 1.0 must be <= reward_max 0.0"),
    ("[jax.optim]\nwarmup_steps = 100", "jax.optim.warmup_steps: 100 must be < max_steps (100)"),
    ("[jax.optim]\nwarmup_steps = -1", f"jax.optim.warmup_steps: {GE} 0, got -1"),
    ('[jax.optim]\nschedule = "exp"',
     "jax.optim.schedule: Input should be 'constant', 'linear' or 'cosine', got 'exp'"),
    ("[jax.optim]\nweight_decay = -0.01", f"jax.optim.weight_decay: {GE} 0, got -0.01"),
    ("[jax.optim]\nbeta2 = 1.0", "jax.optim.beta2: Input should be less than 1, got 1.0"),
    ("[jax.optim]\nmax_grad_norm = 0.0", "jax.optim.max_grad_norm: Input should be greater than 0, got 0.0"),
    ("[jax.optim]\nlr_schedule = 1", "jax.optim.lr_schedule: unknown key (did you mean 'schedule'?)"),
])
def test_training_knob_errors_name_the_key(tmp_path, table, expected):
    assert problems(tmp_path, MINIMAL + table + "\n") == [expected]


def test_training_knobs_load_and_default_to_todays_training(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + '[jax.loss]\ntype = "ppo"\nclip_high = 1.28\ndual_clip = 3\n'
                                                '[jax.optim]\nschedule = "cosine"\nwarmup_steps = 10\n'))
    assert (cfg.jax.loss.type, cfg.jax.loss.clip_high, cfg.jax.loss.dual_clip) == ("ppo", 1.28, 3)
    assert (cfg.jax.optim.schedule, cfg.jax.optim.warmup_steps) == ("cosine", 10)
    default = load_config(write(tmp_path, MINIMAL)).jax
    assert (default.loss.type, default.loss.mask_low, default.loss.mask_high, default.loss.mismatch_kl_coef,
            default.loss.kl_coef, default.loss.entropy_coef, default.loss.aggregation) == (
        "is", 0.125, 8.0, 1e-3, 0.0, 0.0, "token_mean")
    assert (default.advantage.estimator, default.advantage.batch_normalize) == ("mean", False)
    assert (default.optim.schedule, default.optim.warmup_steps, default.optim.max_grad_norm) == ("constant", 0, 1.0)
