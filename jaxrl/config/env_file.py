"""`env_file`: the .env files a run loads into its environment (secrets for environments and W&B)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from jaxrl.config.schema import ConfigError


def load_env_file(paths: Iterable[str | Path] | str | Path) -> dict[str, str]:
    """Parse .env files into a dict, later files overriding earlier ones. Lines are `KEY=VALUE`, with an
    optional `export ` prefix; `#` starts a comment (inside unquoted values only after a space); values
    may be single quoted (literal) or double quoted (`\\n`, `\\"`, `\\\\` escapes). Raises ConfigError for
    a missing file or a malformed line."""
    values: dict[str, str] = {}
    for path in [paths] if isinstance(paths, str | Path) else paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise ConfigError(path, [("", "env file not found")]) from None
        for number, line in enumerate(lines, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                key, value = _env_line(line)
            except ValueError as exc:
                raise ConfigError(path, [(f"line {number}", str(exc))]) from None
            values[key] = value
    return values


_ENV_LINE = re.compile(r"\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*")
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}


def _env_line(line: str) -> tuple[str, str]:
    """(key, value) of one `KEY=VALUE` line; ValueError saying why when it is malformed."""
    match = _ENV_LINE.fullmatch(line)
    if match is None:
        raise ValueError("expected KEY=VALUE")
    key, raw = match.groups()
    if not raw or raw[0] not in "'\"":
        return key, re.split(r"\s#", raw, maxsplit=1)[0].rstrip()
    quote, out, i = raw[0], [], 1
    while i < len(raw) and raw[i] != quote:
        escaped = quote == '"' and raw[i] == "\\" and i + 1 < len(raw)
        out.append(_ESCAPES.get(raw[i + 1], "\\" + raw[i + 1]) if escaped else raw[i])
        i += 2 if escaped else 1
    rest = raw[i + 1:].strip()
    if i >= len(raw) or (rest and not rest.startswith("#")):
        raise ValueError(f"unterminated or malformed {quote}-quoted value")
    return key, "".join(out)
