"""`env_file`: the .env files a run loads into its environment (secrets for environments and W&B)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from jaxrl.config.schema import ConfigError

MAX_ENV_FILE_BYTES = 2**20
"""Largest .env file read (1 MiB): secrets are a few lines; a larger file is not one."""


def load_env_file(paths: Iterable[str | Path] | str | Path, source: Path | None = None) -> dict[str, str]:
    """Parse .env files into a dict, later files overriding earlier ones. Lines are `KEY=VALUE`, with an
    optional `export ` prefix; `#` starts a comment (inside unquoted values only after a space); values
    may be single quoted (literal) or double quoted (`\\n`, `\\"`, `\\\\` escapes). Raises ConfigError for
    a missing file, one that is not a text file under `MAX_ENV_FILE_BYTES` (a folder, a device, binary
    data) or a malformed line: `<env file>: line N: reason`, or with `source` (the run config, whose
    `env_file` lists the files) `<source>: env_file.<i>: <env file>: line N: reason`."""
    values: dict[str, str] = {}
    for i, path in enumerate([paths] if isinstance(paths, str | Path) else paths):
        def fail(where: str, reason: str, path: str | Path = path, i: int = i) -> ConfigError:
            if source is None:
                return ConfigError(path, [(where, reason)])
            return ConfigError(source, [(f"env_file.{i}", f"{path}: {where + ': ' if where else ''}{reason}")])

        try:
            with Path(path).open("rb") as f:
                data = f.read(MAX_ENV_FILE_BYTES + 1)
            if len(data) > MAX_ENV_FILE_BYTES:
                raise fail("", f"larger than {MAX_ENV_FILE_BYTES} bytes: not a .env file")
            lines = data.decode("utf-8").splitlines()
        except FileNotFoundError:
            raise fail("", "env file not found") from None
        except IsADirectoryError:
            raise fail("", "a folder, not a .env file") from None
        except UnicodeDecodeError as exc:
            raise fail("", f"not UTF-8 text ({exc.reason} at byte {exc.start}): not a .env file") from None
        except OSError as exc:
            raise fail("", f"cannot be read: {exc.strerror or exc}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                key, value = _env_line(line)
            except ValueError as exc:
                raise fail(f"line {number}", str(exc)) from None
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
