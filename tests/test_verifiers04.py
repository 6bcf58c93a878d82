"""jaxrl beside verifiers 0.4, which dropped the classic API (`verifiers.legacy`): v1 environments load and
play as on 0.3.1 (`.ci/run` runs test_envs.py and test_multiturn.py in a second virtualenv with verifiers
0.4.0), and a classic environment stops with one clear error. Skipped on verifiers 0.3.x."""

from __future__ import annotations

import pytest
import verifiers

from jaxrl.envs.loader import EnvLoadError, load_env

pytestmark = pytest.mark.skipif(verifiers.__version__.startswith("0.3."), reason="verifiers 0.3.x has the classic API")


def test_a_classic_env_needs_verifiers_03():
    with pytest.raises(EnvLoadError) as info:
        load_env("jaxrl/echo-word")
    assert str(info.value) == (
        f"environment 'jaxrl/echo-word' (module 'echo_word'): classic environments need verifiers 0.3.x (its "
        f"verifiers.legacy API), and verifiers {verifiers.__version__} is installed: pip install 'verifiers==0.3.1'")


def test_v1_tasksets_load():
    env = load_env("jaxrl/lowercase")
    assert env.tasks and not env.classic
