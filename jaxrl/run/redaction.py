"""Secrets kept out of messages: the values of `env_file` and of secret-named environment variables,
replaced by `***` in every error and warning a run prints or logs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)


def secret_values(env_file_values: dict[str, str], environ: dict[str, str] | None = None) -> list[str]:
    """Values to keep out of every message: all `env_file` values, and environment variables whose
    name says secret (KEY, TOKEN, SECRET, PASSWORD, CREDENTIAL, AUTH). Values under 6 characters are
    left alone (redacting "1" or "true" would garble messages and protect nothing)."""
    environ = dict(os.environ) if environ is None else environ
    values = set(env_file_values.values()) | {v for k, v in environ.items() if _SECRET_NAME.search(k)}
    return sorted((v for v in values if len(v) >= 6), key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each secret replaced by `***`."""
    for s in secrets:
        text = text.replace(s, "***")
    return text
