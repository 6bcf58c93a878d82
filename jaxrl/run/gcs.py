"""`gs://` paths: recognising and joining them, and a fast, retried reachability probe.

Orbax writes `gs://` through gcsfs (folders, metadata), google-cloud-storage (bucket checks, deletes)
and tensorstore (arrays), each with its own retries; gcsfs alone retries a failing request six times
over about 35 s. The probe runs before a run starts and before each checkpoint, with a short retry
budget of its own, so an unreachable or unwritable bucket fails in seconds with a message naming the
URL, instead of after every layer's retries (or in the middle of a half-written checkpoint).

Credentials are Google's application default ones; `STORAGE_EMULATOR_HOST` points the clients at an
emulator (anonymous), as the tests do.
"""

from __future__ import annotations

import functools
import time
import uuid

PREFIX = "gs://"


class GCSUnavailable(OSError):
    """A `gs://` location that could not be written after every retry; the message names the URL,
    the attempts and the last error."""


def is_gcs(path: str) -> bool:
    """True for a `gs://bucket/...` URL."""
    return path.startswith(PREFIX)


def join(base: str, *parts: str) -> str:
    """`base/part/...` for a local path or a `gs://` URL (no doubled or trailing slashes)."""
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def split(url: str) -> tuple[str, str]:
    """`gs://bucket/a/b` -> ("bucket", "a/b"). Raises ValueError for a URL without a bucket."""
    if not is_gcs(url) or not url[len(PREFIX):].split("/", 1)[0]:
        raise ValueError(f"{url!r} is not a gs://bucket[/path] URL")
    bucket, _, path = url[len(PREFIX):].partition("/")
    return bucket, path.strip("/")


def forget_listings(url: str) -> None:
    """Drop gcsfs's cached folder listings under `url`: another process may have written there since
    this one last looked (the filesystem instance is the one etils, hence Orbax, uses)."""
    import fsspec

    fsspec.filesystem("gs", finalize_on_close=True).invalidate_cache(url)


@functools.cache
def _client():
    from google.cloud import storage  # imported late: only runs that use gs:// need it

    return storage.Client()


def probe(url: str, attempts: int = 4, backoff_s: float = 0.5, timeout_s: float = 10.0) -> None:
    """Write and delete a small object under `url`, retrying `attempts` times with exponential backoff
    (`backoff_s`, doubling).

    Raises:
        GCSUnavailable: every attempt failed (unreachable, refused, 5xx answers, no permission...).
        ValueError: `url` is not a `gs://bucket[/path]` URL.
    """
    bucket_name, path = split(url)
    error: Exception | None = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            # The client's own retries are off: this loop is the retry budget.
            blob = _client().bucket(bucket_name).blob(join(path, f".jaxrl-probe-{uuid.uuid4().hex}").lstrip("/"))
            blob.upload_from_string(b"", timeout=timeout_s, retry=None)
            blob.delete(timeout=timeout_s, retry=None)
            return
        except Exception as exc:  # noqa: BLE001 - any failure of the storage stack is retried, then reported
            error = exc
    raise GCSUnavailable(f"{url} is not writable after {attempts} attempts: {type(error).__name__}: "
                         f"{_first_line(error)}")


def _first_line(exc: BaseException | None) -> str:
    return str(exc).strip().splitlines()[0][:300] if exc and str(exc).strip() else "no detail"
