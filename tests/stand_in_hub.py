"""A stand-in Hugging Face Hub on 127.0.0.1 (stdlib `http.server` in a thread) for `huggingface_hub` 2.4
with `HF_ENDPOINT` pointed at it: the endpoints `snapshot_download` and `hf_hub_download` call, with the
status codes and headers the real Hub answers (shared/FACTS.md, "huggingface_hub 2.4 against a local
stand-in hub"):

- `GET /api/models/{repo}/revision/{rev}`: `{"id", "sha", "siblings"}`;
- `GET /api/models/{repo}/tree/{rev}?recursive=true`: `[{"type": "file", "oid", "size", "path"}]`;
- `HEAD` / `GET /{repo}/resolve/{rev}/{path}`: the bytes, with `X-Repo-Commit`, `ETag`, `Content-Length`;
- errors: 404 `X-Error-Code: RepoNotFound` / `RevisionNotFound` / `EntryNotFound`; a private repo without
  a token: 401 `RepoNotFound`; a wrong token: 401 `X-Error-Message: Invalid credentials in Authorization
  header`.

Every request is recorded in `Hub.requests` as `(method, path)`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    """One model repo: `revisions` maps a branch or tag to `(commit sha, {path: bytes})`; `token`: the
    bearer token a private repo needs (None: public); `claimed_sizes`: sizes the tree listing and a HEAD's
    `Content-Length` state in place of the real ones (a repo that claims more than the disk holds)."""

    revisions: dict[str, tuple[str, dict[str, bytes]]]
    token: str | None = None
    claimed_sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_folder(cls, folder: Path, sha: str = "a" * 40, **kw) -> Repo:
        """A repo whose `main` is the files of `folder`."""
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        return cls({"main": (sha, files)}, **kw)

    def at(self, rev: str) -> tuple[str, dict[str, bytes]] | None:
        """The `(sha, files)` of a branch, tag or commit sha, or None."""
        return self.revisions.get(rev) or next((v for v in self.revisions.values() if v[0] == rev), None)


def _oid(data: bytes) -> str:
    """Git's blob id of `data`, which the Hub sends as a non-LFS file's `oid` and `ETag`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Hub:
    """The server; `url` is what `HF_ENDPOINT` is set to. Use as a context manager."""

    def __init__(self, repos: dict[str, Repo]):
        self.repos, self.requests = repos, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Hub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def file_requests(self) -> list[tuple[str, str]]:
        """The requests for file bytes (`/resolve/`), HEAD or GET."""
        return [r for r in self.requests if "/resolve/" in r[1]]

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        raw = urlsplit(h.path).path
        self.requests.append((h.command, unquote(raw)))
        api = raw.startswith("/api/models/")
        parts = [unquote(p) for p in raw.removeprefix("/api/models/").strip("/").split("/")]
        repo_id, rest = "/".join(parts[:2]), "/".join(parts[4:])
        kind, rev = (parts[2:4] + ["", ""])[:2]
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._send(h, 404 if api else 401, b"{}", {"X-Error-Code": "RepoNotFound"}, body)
        auth = h.headers.get("Authorization")
        if repo.token is not None and auth != f"Bearer {repo.token}":
            headers = ({"X-Error-Message": "Invalid credentials in Authorization header"} if auth
                       else {"X-Error-Code": "RepoNotFound"})
            return self._send(h, 401, b"{}", headers, body)
        found = repo.at(rev)
        if found is None:
            return self._send(h, 404, b"{}", {"X-Error-Code": "RevisionNotFound"}, body)
        sha, files = found
        if api and kind == "revision":
            info = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.token is not None,
                    "siblings": [{"rfilename": p} for p in files]}
            return self._send(h, 200, json.dumps(info).encode(), {}, body)
        if api and kind == "tree":
            tree = [{"type": "file", "oid": _oid(d), "path": p, "size": repo.claimed_sizes.get(p, len(d))}
                    for p, d in files.items()]
            return self._send(h, 200, json.dumps(tree).encode(), {}, body)
        if not api and kind == "resolve" and rest in files:
            data = files[rest]
            size = {} if body else {"Content-Length": str(repo.claimed_sizes.get(rest, len(data)))}
            return self._send(h, 200, data, {"X-Repo-Commit": sha, "ETag": f'"{_oid(data)}"', **size}, body)
        return self._send(h, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        h.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)
