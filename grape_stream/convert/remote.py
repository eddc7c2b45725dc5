"""Object storage for conversions: is OUT remote, where to stage it, fail-fast checks and uploads.

All transfers go through mosaicml-streaming's `CloudUploader` (S3 and compatible stores; the endpoint
comes from S3_ENDPOINT_URL). streaming imports torch, so it is imported on first use only: a local
conversion and `grape-stream convert --help` never load it from here.

Every call that reaches the store runs under :func:`grape_stream.retry.storage_call`: the bucket check
that building an uploader does (HeadBucket), each upload, the merged indexes, report and manifest. One
uploader (one boto3 session and client, one credential lookup) serves a process for the whole
conversion: a pool worker builds it for its first unit and keeps it. Credentials refused mid-run drop
it, and the next attempt builds a new one that reads the (possibly rotated) credentials again.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grape_stream.retry import RetryPolicy, default_policy, endpoint_note, storage_call

__all__ = ["is_remote", "default_local", "check_remote", "upload", "upload_partitions"]

_LOCK = threading.Lock()
_UPLOADERS: dict[tuple[int, str, str], Any] = {}  # (pid, local root, remote) -> CloudUploader


def _build(local_root: str, remote: str) -> Any:
    from streaming.base.storage.upload import CloudUploader

    # keep_local: this module deletes uploaded shards itself, once a unit's partitions are all up
    return CloudUploader.get((local_root, remote), keep_local=True, exist_ok=True)  # checks the bucket


def _uploader(local_root: str, remote: str) -> Any:
    """This process's uploader for (local_root, remote), built (and the bucket checked) on first use."""
    key = (os.getpid(), local_root, remote)  # a forked worker builds its own: a client is not fork-safe
    with _LOCK:
        cu = _UPLOADERS.get(key)
        if cu is None:
            cu = _UPLOADERS[key] = _build(local_root, remote)
        return cu


def _forget(local_root: str, remote: str) -> None:
    """Drop the uploader, so the next attempt builds a new one that reads the credentials again."""
    with _LOCK:
        _UPLOADERS.pop((os.getpid(), local_root, remote), None)


def _upload_one(local_root: str, remote: str, name: str, policy: RetryPolicy) -> None:
    where = f"{remote}/{name}{endpoint_note(remote)}"
    storage_call(lambda: _uploader(local_root, remote).upload_file(name), policy=policy, url=remote,
                 what=f"uploading {where}; re-run the same command to resume",
                 refresh=lambda: _forget(local_root, remote))


def is_remote(out: str) -> bool:
    """True for a URL such as s3://bucket/prefix (not for a local path or file://)."""
    return urllib.parse.urlparse(out).scheme not in ("", "file") and "://" in out


def default_local(remote: str) -> str:
    """The staging (and resume-state) directory of a remote OUT: one per URL under the user's cache."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha1(remote.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(cache, "grape_stream", "convert", digest)


def check_remote(remote: str) -> None:
    """Fail before any work when the bucket is unreachable (wrong endpoint, missing bucket, no creds).

    An outage at start-up is ridden out like one mid-way; refused or missing credentials fail at once
    with one line saying what to set; a missing bucket too."""
    endpoint = os.environ.get("S3_ENDPOINT_URL", "(default AWS)")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            storage_call(lambda: _build(tmp, remote), policy=default_policy(), url=remote,
                         what=f"cannot reach {remote} (S3_ENDPOINT_URL={endpoint})")
        except ConnectionError:
            raise  # StorageError (retries spent, credentials) and the network's own: already clear
        except Exception as e:
            raise ConnectionError(f"cannot write to {remote} (S3_ENDPOINT_URL={endpoint}): {e}") from e


def upload(local_root: str, remote: str, names: list[str]) -> None:
    """Upload files (paths relative to `local_root`, to the same paths under `remote`) in the order
    given: the manifest last.

    Each file is retried with backoff under the default retry deadline (an outage of a minute is ridden
    out); past it the conversion stops with one error, and re-running the command resumes (finished
    units are kept, and uploads of the same bytes are idempotent)."""
    for name in names:
        _upload_one(local_root, remote, name, default_policy())


def upload_partitions(local_root: str, remote: str, dirs: list[str], *, keep_local: bool) -> None:
    """Upload finished MDS partitions (shards first, each partition's index.json last); local shards are
    then deleted unless keep_local, the small index.json files stay (finalising merges them without
    downloading)."""
    shards: list[str] = []
    indexes: list[str] = []
    for d in dirs:
        for name in sorted(os.listdir(d)):
            rel = os.path.relpath(os.path.join(d, name), local_root).replace(os.sep, "/")
            (indexes if name == "index.json" else shards).append(rel)

    def one(name: str) -> None:
        _upload_one(local_root, remote, name, default_policy())

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, shards))
        list(pool.map(one, indexes))
    if not keep_local:
        for rel in shards:
            os.remove(os.path.join(local_root, rel))
