"""What every TOML table of the run config shares: unknown keys are errors, TOML types are not coerced,
and numbers stay within what the device takes (int32, finite float32); and the constrained field types
several tables use (paths, folder names, environment ids, counts where -1 means all)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

INT_MAX = 2**31 - 1
"""Largest integer any field takes: counts, steps, token lengths and seeds reach the device as int32."""
FLOAT_MAX = 3.4028234663852886e38
"""Largest float any field takes (float32's): sampling settings reach the device as float32."""
NAME_MAX_CHARS = 128
"""Longest run or env name, in characters: a sane cap below the filesystem's (a name is a folder, a metric
key segment and a W&B label, and is printed in every status line)."""
NAME_MAX_BYTES = 255
"""Longest run or env name in UTF-8 bytes: NAME_MAX of Linux filesystems (ext4, xfs, tmpfs) and macOS's
APFS; a longer folder name fails with `OSError: [Errno 36] File name too long`."""
ENV_ID = re.compile(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+(@[A-Za-z0-9._-]+)?")
"""An Environments Hub id: `owner/name` with an optional `@version`."""


class ConfigError(Exception):
    """A config that cannot be used. `problems` holds `(key, reason)` pairs, `key` dotted (`env.0.id`)
    or "" for the file as a whole; str() is one `<file>: <key>: <reason>` line per problem."""

    def __init__(self, source: str | Path, problems: list[tuple[str, str]]):
        self.source, self.problems = str(source), problems
        super().__init__("\n".join(f"{self.source}: {k + ': ' if k else ''}{r}" for k, r in problems))


def read_toml(path: Path) -> dict[str, Any]:
    """The tables of the TOML file at `path`.

    Raises:
        ConfigError: the file is missing, unreadable, not UTF-8 or not TOML (naming the file).
    """
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(path, [("", "file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, [("", f"cannot read: {exc}")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, [("", f"invalid TOML: {exc}")]) from None


def json_object(text: str) -> dict[str, Any]:
    """`text` parsed as a JSON object (a command-line flag's value, a JSONL line).

    Raises:
        ValueError: not JSON ("not JSON: <decoder's message>") or not an object ("must be a JSON object, got
            <type>").
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {type(value).__name__}")
    return value


class BrokenRules(ValueError):
    """Raised by a table's cross-field check (`RunConfig`'s, `[sampling]`'s, `[jax.teacher]`'s) with every
    broken rule as `(dotted key from the file's top, reason)`, so all of them are reported."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("; ".join(f"{k}: {r}" for k, r in problems))
        self.problems = problems


class Table(BaseModel):
    """Base of every TOML table: unknown keys are errors and TOML types are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _fits_the_device(cls, value: Any) -> Any:
        """Integers within int32 and floats within float32 (TOML integers are unbounded, and inf and nan
        are refused by `allow_inf_nan`): a value past them would overflow where the run uses it."""
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_MAX:
            raise ValueError(f"{value} is beyond {INT_MAX} (2**31 - 1), the largest integer jaxrl takes")
        if isinstance(value, float) and abs(value) > FLOAT_MAX:
            raise ValueError(f"{value} is beyond float32's range ({FLOAT_MAX:.4g})")
        return value


def minus_one_or_positive(meaning: str) -> AfterValidator:
    """A validator of int fields where -1 means `meaning` (e.g. "all", "off") and other values count: -1 or >= 1."""

    def check(value: int) -> int:
        if value == -1 or value >= 1:
            return value
        raise ValueError(f"must be -1 ({meaning}) or >= 1, got {value}")

    return AfterValidator(check)


def _env_id(value: str) -> str:
    if not ENV_ID.fullmatch(value):
        raise ValueError(f"{value!r} is not in owner/name[@version] form")
    return value


def _control_chars(value: str) -> list[str]:
    return [repr(c) for c in dict.fromkeys(value) if ord(c) < 32 or 127 <= ord(c) < 160]


def folder_name_problem(value: str) -> str | None:
    """Why `value` cannot be one folder's name (empty, `.`, `..`, a path separator, a control character,
    longer than `NAME_MAX_CHARS` characters or `NAME_MAX_BYTES` UTF-8 bytes), None when it can. Run names
    become `<output_dir>/<name>`, and `jaxrl delete` removes that folder."""
    if value in ("", ".", ".."):
        return f"{value!r} cannot name a folder (it must not be empty, '.' or '..')"
    size = len(value.encode("utf-8", "surrogatepass"))
    if len(value) > NAME_MAX_CHARS or size > NAME_MAX_BYTES:
        return (f"{value[:40]!r}... is {len(value)} characters ({size} bytes in UTF-8); a name is at most "
                f"{NAME_MAX_CHARS} characters and {NAME_MAX_BYTES} bytes (a folder's name)")
    if "/" in value or "\\" in value:
        return f"{value!r} holds a path separator; a name is one folder, not a path"
    if bad := _control_chars(value):
        return f"{value!r} holds control characters ({', '.join(bad)})"
    return None


def _folder_name(value: str) -> str:
    if problem := folder_name_problem(value):
        raise ValueError(problem)
    return value


def _path(value: str) -> str:
    if not value:
        raise ValueError("an empty path names no folder")
    if bad := _control_chars(value):
        raise ValueError(f"{value!r} holds control characters ({', '.join(bad)})")
    return value


AllOrPositive = Annotated[int, minus_one_or_positive("all")]
EnvId = Annotated[str, AfterValidator(_env_id)]
FolderName = Annotated[str, AfterValidator(_folder_name)]
"""A name that becomes one folder or one metric key segment: no '.', '..', separators or control characters."""
PathStr = Annotated[str, AfterValidator(_path)]
"""A file or folder path (or `gs://` URL): not empty, no control characters."""
