"""Test session setup: 8 emulated CPU devices (so sharded code paths run for real) and strict rank
promotion. These must be set before jax is imported anywhere. The GCS clients are pointed at the
session's local GCS emulator (see gcs_fixtures.py) before gcsfs, fsspec or tensorstore are imported."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from gcs_fixtures import configure_clients, free_port

GCS_PROXY_PORT = free_port()
configure_clients(GCS_PROXY_PORT)

# No test reaches the real Hugging Face Hub: a model id that is not cached would be downloaded, so the
# session (and its subprocesses) point at a closed port; test_hub.py serves its own stand-in hub.
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_TOKEN_PATH"] = os.path.join(tempfile.gettempdir(), "jaxrl-tests-no-hf-token")  # no stored login

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# The session's processes (both xdist workers, which inherit these variables, and the `jaxrl` subprocesses) share
# one persistent compilation cache that keeps every program: the tiny model's train step and engine compile once
# per session instead of once per run or test, and a restarted run loads what an earlier one compiled. Set after
# jax is imported here, so this process turns it on itself (the tests' own programs: test_train.py 169 -> 150
# CPU-s, test_engine.py 135 -> 120, 2026-11-28), except around the files that compile for a TPU topology
# (`_no_compile_cache_for_topology_compiles`).
_COMPILE_CACHE = tempfile.mkdtemp(prefix="jaxrl-tests-jit-")
atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _COMPILE_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

# The files that take minutes, longest first (a 2-core machine; CI's run of 2026-11-27: the compile files about 900
# and 400 s, the one-test files test_tool_example 101 s, test_device_check 86 s). `--dist loadfile` hands whole
# files to the two workers in the order collected (pyproject.toml sets `--no-loadscope-reorder`; pytest-xdist's own
# order, most tests first, started these last, and the other worker then waited idle for the last of them); a
# worker is handed its next file while the last two tests of its current one run, so a long file left to the end
# (test_tool_example.py, alphabetically among the last, until 2026-11-28) keeps one worker busy alone.
LONGEST_FIRST = ("test_compile_hosted.py", "test_compile.py", "test_long_context.py", "test_run.py",
                 "test_distributed_async.py", "test_distributed_run.py", "test_distributed.py", "test_quickstart.py",
                 "test_train_parity.py", "test_teacher.py", "test_engine.py", "test_train.py", "test_tool_example.py",
                 "test_device_check.py", "test_teacher_server.py", "test_resume.py", "test_async.py", "test_moe.py",
                 "test_classic.py", "test_glm.py", "test_faults.py", "test_export.py", "test_gepa.py", "test_sft.py",
                 "test_runs.py", "test_multiturn.py", "test_metrics.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """LONGEST_FIRST's files first, in its order; the others after them, in the order collected. A name in it
    that is not a file here fails the session (a renamed file would silently lose its place)."""
    here = Path(__file__).parent
    missing = [name for name in LONGEST_FIRST if not (here / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST: no such test file: {', '.join(missing)}")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order

# The files whose tests compile for a TPU topology (libtpu, no TPU) with the cache off: jax writes those programs
# (tens of MB each for the Hosted models) but cannot read them back without a TPU attached, so a program compiled
# twice would be compiled again anyway, after a warning (docs/tpu.md; the cache is looked up once per process).
TOPOLOGY_COMPILES = ("test_compile_hosted.py", "test_compile.py")


def _use_compile_cache(on: bool) -> None:
    jax.config.update("jax_enable_compilation_cache", on)
    compilation_cache.reset_cache()  # jax decides once per process whether the cache is used: decide again


@pytest.fixture(scope="module", autouse=True)
def _no_compile_cache_for_topology_compiles(request):
    """The persistent compilation cache off for the module's tests when it is one of `TOPOLOGY_COMPILES`."""
    off = request.path.name in TOPOLOGY_COMPILES
    if off:
        _use_compile_cache(False)
    yield
    if off:
        _use_compile_cache(True)


# CI's 2 cores are sometimes shared: a property test's draws are not timed (no deadline, no too_slow
# health check); what they prove does not depend on how fast they come.
settings.register_profile("jaxrl", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("jaxrl")


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory):
    """A real Qwen3 tokenizer folder (tokenizer.json + config), built offline once per session."""
    from jaxrl.model.assets import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer"))


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """A real GCS emulator (fake-gcs-server, in memory) on 127.0.0.1 with bucket `jaxrl-test`, behind a
    fault proxy on the port every GCS client of the session (and its subprocesses) uses. Its log is
    `<tmp>/gcs*/fake-gcs-server.log`."""
    from gcs_fixtures import Emulator, FaultProxy

    emulator = Emulator(tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log")
    proxy = FaultProxy(GCS_PROXY_PORT, emulator.port)
    emulator.create_bucket()
    emulator.proxy = proxy
    yield emulator
    proxy.close()
    emulator.stop()


@pytest.fixture
def gcs_proxy(gcs):
    """The session emulator's fault proxy, set back to "pass" after the test."""
    yield gcs.proxy
    gcs.proxy.set_mode("pass")


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The offline tiny Qwen3 (config.json + safetensors + tokenizer) under `<repo>/assets`, built once."""
    from pathlib import Path

    from jaxrl.model import assets

    return assets.ensure_tiny_assets(Path(__file__).resolve().parents[1] / "assets").resolve()


@pytest.fixture(scope="session")
def recording_server(tiny_model_dir):
    """(server handle, `helpers.Recording` backend): the tiny Qwen3's scheduler (4 decode slots, 160 tokens, one
    device) behind a real rollout server on 127.0.0.1 with the model's chat template, shared by the test files
    that play environments against it."""
    from helpers import Recording

    from jaxrl.inference.engine import Engine
    from jaxrl.inference.scheduler import Scheduler
    from jaxrl.inference.server import start_server
    from jaxrl.inference.template import ChatTemplate
    from jaxrl.model import hf
    from jaxrl.parallel.sharding import make_mesh

    mcfg, base = hf.load_hf(tiny_model_dir)
    engine = Engine(mcfg, make_mesh({}, jax.devices()[:1]), max_concurrent_decodes=4, max_seq_len=160)
    backend = Recording(Scheduler(engine, {"base": base, "lora": None}, model_name="policy"))
    handle = start_server(backend, chat_template=ChatTemplate.load(tiny_model_dir))
    yield handle, backend
    handle.stop()
    backend.scheduler.stop()
