"""Where rollouts and reflection calls go: an OpenAI-compatible endpoint (`Endpoint`), either jaxrl's own
server over a local model (`jaxrl.cli.local_model`) or a remote one named by `-b/-k` or by an alias of
`configs/endpoints.toml`.

`endpoints.toml` is verifiers' registry format (`vf-eval -e`, `vf-gepa -e`):

    [[endpoint]]
    endpoint_id = "gpt-4.1-mini"      # the alias `-m` names
    model = "openai/gpt-4.1-mini"     # the model id sent to the endpoint
    url = "https://api.pinference.ai/api/v1"   # or api_base_url
    key = "PRIME_API_KEY"             # or api_key_var: the environment variable holding the key
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path


class EndpointError(ValueError):
    """An endpoint that cannot be used: a bad registry file or alias, or a missing key variable."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible endpoint serving `model`.

    base_url: ends in `/v1` (chat completions at `{base_url}/chat/completions`). api_key_var: the environment
    variable holding the key (its value is read where a request is made, never stored). tokenizer_path: the
    local model's tokenizer folder when the endpoint is jaxrl's own server (v1 environments then render
    chats to token ids themselves, as in training, through `/inference/v1/generate`); None for a remote one
    (v1 environments then use chat completions).
    """

    base_url: str
    model: str
    api_key_var: str = "JAXRL_API_KEY"
    tokenizer_path: str | None = None

    @property
    def local(self) -> bool:
        """Whether this is jaxrl's own in-process server."""
        return self.tokenizer_path is not None


def load_aliases(path: str | Path) -> dict[str, Endpoint]:
    """The `[[endpoint]]` entries of a registry file, by `endpoint_id` (the first entry of an id wins, as
    verifiers picks the first of a group); {} when the file does not exist.

    Raises:
        EndpointError: the file is not TOML, or an entry lacks `endpoint_id`, `model` or a URL, or sets
            both spellings of a key to different values.
    """
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise EndpointError(f"{path}: cannot read: {exc}") from None
    entries = raw.get("endpoint", [])
    if not isinstance(entries, list):
        raise EndpointError(f"{path}: endpoint: must be an array of [[endpoint]] tables")
    out: dict[str, Endpoint] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: endpoint.{i}"
        if not isinstance(entry, dict):
            raise EndpointError(f"{where}: must be a table")
        url = _one(entry, ("url", "api_base_url"), where)
        key = _one(entry, ("key", "api_key_var"), where) or "PRIME_API_KEY"
        for field, value in (("endpoint_id", entry.get("endpoint_id")), ("model", entry.get("model")),
                             ("url", url)):
            if not isinstance(value, str) or not value:
                raise EndpointError(f"{where}: {field}: required, a non-empty string")
        out.setdefault(entry["endpoint_id"], Endpoint(base_url=url, model=entry["model"], api_key_var=key))
    return out


def _one(entry: dict, keys: tuple[str, str], where: str) -> str | None:
    a, b = (entry.get(k) for k in keys)
    if a is not None and b is not None and a != b:
        raise EndpointError(f"{where}: {keys[0]} and {keys[1]} differ ({a!r}, {b!r}); set one")
    return a if a is not None else b


def remote(model: str, base_url: str | None, api_key_var: str | None, aliases: dict[str, Endpoint]) -> Endpoint:
    """The remote endpoint for `-m model` with `-b base_url` / `-k api_key_var` (each overriding an alias's).

    Raises:
        EndpointError: `model` is neither an alias nor given with `-b`. (An unset key variable is sent as
            "EMPTY", as verifiers does: a local vLLM needs none.)
    """
    if model in aliases:
        alias = aliases[model]
        found = Endpoint(base_url or alias.base_url, alias.model, api_key_var or alias.api_key_var)
    elif base_url:
        found = Endpoint(base_url, model, api_key_var or "OPENAI_API_KEY")
    else:
        raise EndpointError(f"-m {model!r} is not a local model folder (config.json + safetensors) or a jaxrl run / "
                            "checkpoint, not an alias of the endpoints file (-e), and no endpoint URL (-b) was given")
    return found


REACH_TIMEOUT_S = 10.0
"""How long `check_reachable` waits to connect and for the first answer."""


def check_reachable(endpoint: Endpoint) -> None:
    """Fails fast on an endpoint that is down: `GET {base_url}/models` must get an HTTP answer within
    `REACH_TIMEOUT_S` (any status counts: the route is optional, and a 401 still proves a server is there).

    Raises:
        EndpointError: no connection, or no answer in time (the transport's reason, one line).
    """
    import os

    import httpx

    key = os.environ.get(endpoint.api_key_var) or "EMPTY"
    try:
        httpx.get(f"{endpoint.base_url.rstrip('/')}/models", headers={"Authorization": f"Bearer {key}"},
                  timeout=REACH_TIMEOUT_S)
    except httpx.TransportError as exc:
        raise EndpointError(f"{endpoint.base_url}: the endpoint cannot be reached ({type(exc).__name__}: "
                            f"{exc or 'no reason given'}); is it running, and is the URL right?") from None
