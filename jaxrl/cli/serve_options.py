"""`jaxrl serve`'s options checked before the model loads, each refusal naming its option (no JAX here: a
wrong option is answered at once)."""

from __future__ import annotations

import os


class OptionError(ValueError):
    """An option `serve` cannot run with; the message names it."""


def check(dtype: str | None, max_pending: int, api_key_env: str | None, jetstream: bool, port: int) -> str | None:
    """The API key read from `api_key_env` (None without it), after checking `--dtype`, `--max-pending`
    and what `--jetstream` cannot do.

    Raises:
        OptionError: the first option that is wrong.
    """
    if dtype not in (None, "float32", "bfloat16"):
        raise OptionError(f"--dtype: {dtype!r} is not float32 or bfloat16")
    if max_pending < 1:
        raise OptionError(f"--max-pending must be >= 1, got {max_pending}")
    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise OptionError(f"--api-key-env: the environment variable {api_key_env} is not set or empty")
    if jetstream:
        _check_jetstream(api_key, port)
    return api_key


def _check_jetstream(api_key: str | None, port: int) -> None:
    """Refuse what `serve --jetstream` cannot do, before the model loads."""
    if api_key is not None:
        raise OptionError("--jetstream: JetStream's gRPC server has no API keys; drop --api-key-env")
    if port == 0:
        raise OptionError("--jetstream needs a --port other than 0 (JetStream's server does not say which port it "
                          "got)")
    try:
        import jaxrl.inference.jetstream  # noqa: F401 - about 5 s (TensorFlow): paid here, before the model loads
    except ImportError as exc:
        raise OptionError(f"--jetstream needs the jetstream extra (pip install 'jaxrl[jetstream]'): {exc}") from None
