"""Test session setup: 8 emulated CPU devices (so sharded code paths run for real) and strict rank
promotion. These must be set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory):
    """A real Qwen3 tokenizer folder (tokenizer.json + config), built offline once per session."""
    from jaxrl.assets import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer"))
