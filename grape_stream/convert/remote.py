"""Object storage for conversions: is OUT remote, where to stage it, fail-fast checks and uploads.

All transfers go through mosaicml-streaming's `CloudUploader` (S3 and compatible stores; the endpoint
comes from S3_ENDPOINT_URL). streaming imports torch, so it is imported on first use only: a local
conversion and `grape-stream convert --help` never load it from here.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from grape_stream.retry import RetryError, RetryPolicy, call_with_retry, default_policy, endpoint_note, is_transient

__all__ = ["is_remote", "default_local", "check_remote", "upload", "upload_partitions"]


def _upload_one(cu: object, remote: str, name: str, policy: RetryPolicy) -> None:
    where = f"{remote}/{name}{endpoint_note(remote)}"
    call_with_retry(lambda: cu.upload_file(name), policy=policy,  # type: ignore[attr-defined]
                    what=f"uploading {where}; re-run the same command to resume", retryable=is_transient)


def is_remote(out: str) -> bool:
    """True for a URL such as s3://bucket/prefix (not for a local path or file://)."""
    return urllib.parse.urlparse(out).scheme not in ("", "file") and "://" in out


def default_local(remote: str) -> str:
    """The staging (and resume-state) directory of a remote OUT: one per URL under the user's cache."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha1(remote.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(cache, "grape_stream", "convert", digest)


def check_remote(remote: str) -> None:
    """Fail before any work when the bucket is unreachable (wrong endpoint, missing bucket, no creds)."""
    from streaming.base.storage.upload import CloudUploader

    endpoint = os.environ.get("S3_ENDPOINT_URL", "(default AWS)")
    with tempfile.TemporaryDirectory() as tmp:
        try:  # an outage at start-up is ridden out like one mid-way; a wrong bucket or credential is not
            call_with_retry(lambda: CloudUploader.get((tmp, remote), exist_ok=True), policy=default_policy(),
                            what=f"cannot reach {remote} (S3_ENDPOINT_URL={endpoint})", retryable=is_transient)
        except RetryError:
            raise
        except Exception as e:
            raise ConnectionError(f"cannot write to {remote} (S3_ENDPOINT_URL={endpoint}): {e}") from e


def upload(local_root: str, remote: str, names: list[str]) -> None:
    """Upload files (paths relative to `local_root`) in the order given: the manifest last.

    Each file is retried with backoff under the default retry deadline (an outage of a minute is ridden
    out); past it the conversion stops with one error, and re-running the command resumes (finished
    units are kept, and uploads of the same bytes are idempotent)."""
    from streaming.base.storage.upload import CloudUploader

    cu = CloudUploader.get((local_root, remote), keep_local=True, exist_ok=True)
    for name in names:
        _upload_one(cu, remote, name, default_policy())


def upload_partitions(local_root: str, remote: str, dirs: list[str], *, keep_local: bool) -> None:
    """Upload finished MDS partitions (shards first, each partition's index.json last); local shards are
    then deleted unless keep_local, the small index.json files stay (finalising merges them without
    downloading)."""
    from streaming.base.storage.upload import CloudUploader

    cu = CloudUploader.get((local_root, remote), keep_local=True, exist_ok=True)
    shards: list[str] = []
    indexes: list[str] = []
    for d in dirs:
        for name in sorted(os.listdir(d)):
            rel = os.path.relpath(os.path.join(d, name), local_root).replace(os.sep, "/")
            (indexes if name == "index.json" else shards).append(rel)
    def one(name: str) -> None:
        _upload_one(cu, remote, name, default_policy())

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, shards))
        list(pool.map(one, indexes))
    if not keep_local:
        for rel in shards:
            os.remove(os.path.join(local_root, rel))
