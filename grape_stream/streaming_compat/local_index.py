"""Workarounds for mosaicml-streaming 0.12 / 0.13 traps that bite a long-running, crash-prone training job.

Written for mosaicml-streaming >=0.12,<0.14 (the supported range; 0.12.0 and 0.13.0 share this code);
each function handles one trap that was seen with that release on a real machine, and docs/mixer.md lists them.

(Shared-memory traps are handled in :mod:`grape_stream.streaming_compat.shm`.)

* **A stale local ``index.json``.** A local cache directory that already holds an ``index.json`` is
  reused without looking at the remote, even when the remote is a different dataset or has been
  re-converted since: :func:`sync_local_index` compares it with the remote's index and a marker file.
* **S3 without credentials.** Streaming's boto3 client signs every request, so an S3-compatible
  endpoint (MinIO, R2, an emulator) fails after all retries when no credentials are configured, even
  for a public bucket: :func:`check_s3_credentials` says so before the first request.
* **``local`` must be the same on all ranks of a node**, or streaming's shared-memory registration
  fails with an "Internal error": :func:`check_same_locals_across_ranks` names the ranks that differ.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch.distributed as dist

from grape_stream.atomic import atomic_open, atomic_write_json
from grape_stream.errors import StorageError, redact_url
from grape_stream.retry import CredentialsError, RetryError, default_policy, endpoint_note, storage_call
from grape_stream.streaming_compat.index_check import UnsafeIndexError, check_index, inside
from grape_stream.streaming_compat.s3_session import install_shared_s3_session, refresh_credentials, shared_session
from grape_stream.streaming_compat.shm import (  # noqa: F401 - re-exported: grape.tasks / apps.demo import them from here
    cleanup_stale_streaming_shm,
    detach_scanner_attachments,
    release_streaming_dataset,
)
from grape_stream.user_dir import UnsafeCacheError, user_temp_dir
from grape_stream.world import dist_active, process_world

logger = logging.getLogger(__name__)

__all__ = [
    "cleanup_stale_streaming_shm",
    "release_streaming_dataset",
    "sync_local_index",
    "fetch_remote_file",
    "check_s3_credentials",
    "check_same_locals_across_ranks",
    "MARKER_NAME",
    "RemoteMismatchError",
    "DomainUnavailableError",
    "UnsafeCacheError",
    "UnsafeIndexError",
]

#: Written next to a cached ``index.json``: which remote it came from and the index's digest.
MARKER_NAME = ".grape_stream_source.json"


class RemoteMismatchError(StorageError, RuntimeError):
    """A local cache directory holds a dataset that is not the configured remote's (one line on the CLI)."""


class DomainUnavailableError(StorageError, RuntimeError):
    """A domain's data cannot be read (missing index, unreachable remote, no credentials); one line on the CLI."""


# --------------------------------------------------------------------------------------------------
# Local index vs remote
# --------------------------------------------------------------------------------------------------
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _remote_join(remote: str, *parts: str | None) -> str:
    out = remote.rstrip("/")
    for p in parts:
        if p:
            out = out + "/" + p.strip("/")
    return out


def fetch_remote_file(url: str, dest: str, *, what: str, timeout: float = 60.0,
                      retry_deadline: float | None = None, throttled_as: str | None = None) -> None:
    """Download one object to ``dest`` with streaming's downloader, under the retry policy.

    Network and server errors are retried under the retry deadline (a job started during an outage
    waits it out; throttling is said once); refused credentials are read again once (rotated), then
    raise :class:`~grape_stream.retry.CredentialsError`; a missing object is raised as streaming raises it.
    Throttling is said under `throttled_as` (the prefix the object lies under, e.g. its domain's remote) if given.
    """
    from streaming.base.storage.download import CloudDownloader

    install_shared_s3_session()

    def attempt() -> None:
        if os.path.exists(dest):
            os.unlink(dest)
        CloudDownloader.direct_download(url, dest, timeout)

    # the deadline bounds the attempts (streaming's download_retry is per shard download)
    storage_call(attempt, policy=default_policy().with_deadline(retry_deadline), what=f"{what}{endpoint_note(url)}",
                 url=url, refresh=refresh_credentials, throttled_as=throttled_as)


def _download_index(domain: str, remote: str, split: str | None, dest: str, timeout: float,
                    retry_deadline: float | None) -> None:
    """Download ``remote[/split]/index.json`` to ``dest``; every failure is one DomainUnavailableError (a
    missing object told apart from refused credentials: streaming reports both as "not found")."""
    url = _remote_join(remote, split, "index.json")
    try:
        # throttling said under the domain's remote, as its shard reads say it (one line per domain)
        fetch_remote_file(url, dest, what=f"domain {domain!r}: cannot read {url}", timeout=timeout,
                          retry_deadline=retry_deadline, throttled_as=remote)
    except RetryError as exc:
        raise DomainUnavailableError(str(exc)) from exc
    except Exception as exc:
        raise DomainUnavailableError(f"domain {domain!r}: {_explain_missing(url, exc)}") from exc


def _explain_missing(url: str, exc: BaseException) -> str:
    """Streaming turns S3 403 and 404 alike into "not found": ask S3 which one it was."""
    if url.startswith("s3://"):
        try:
            import botocore.exceptions

            bucket, _, key = url[len("s3://"):].partition("/")
            shared_session().client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None).get_object(
                Bucket=bucket, Key=key, Range="bytes=0-0")  # not HEAD: its error has no body, so no code
        except botocore.exceptions.ClientError as err:
            code = str(err.response.get("Error", {}).get("Code", ""))
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 403 or code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return (f"access to {url}{endpoint_note(url)} was refused (HTTP 403 {code}): check "
                        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the profile) for this endpoint")
            if code in ("NoSuchBucket",):
                return f"bucket of {url} does not exist{endpoint_note(url)} (NoSuchBucket)"
        except Exception:  # noqa: BLE001 - the explanation is best effort; the original error stands
            pass
    if isinstance(exc, CredentialsError):
        return str(exc)
    return f"{url} not found{endpoint_note(url)}: was this domain converted there? ({type(exc).__name__}: {exc})"


def sync_local_index(domain: str, remote: str | None, local: str, split: str | None = None, *,
                     download_retry: int = 2, download_timeout: float = 60.0,
                     overwrite_local: bool = False, retry_deadline: float | None = None) -> str:
    """Make ``local[/split]/index.json`` trustworthy before streaming reads it; return its path.

    * ``remote is None``: the index must exist (else :class:`DomainUnavailableError` naming the domain
      and the path, with the sub-directories that do hold an ``index.json`` as a hint).
    * With a remote, the remote's ``index.json`` is fetched (streaming's retries) and compared with the
      local one. Missing locally: it is installed. Identical: nothing to do. Different and the marker
      says the same remote (the dataset was re-converted): the stale index and its shards are removed
      with a warning, so streaming downloads the new ones. Different and the local copy came from
      another (or an unknown) remote: :class:`RemoteMismatchError`, unless ``overwrite_local``.
    Call on the local leader only; other ranks of the node wait on a barrier.
    """
    local_dir = os.path.join(local, split) if split else local
    index = os.path.join(local_dir, "index.json")
    if remote is None:
        if not os.path.isfile(index):
            hint = ""
            if os.path.isdir(local_dir):
                subs = sorted(p.parent.name for p in Path(local_dir).glob("*/index.json"))
                if subs:
                    hint = f" (sub-directories with an index.json: {subs}; pass split=...?)"
            raise DomainUnavailableError(
                f"domain {domain!r}: no MDS index at {index}{hint}; convert the data first "
                "(grape-stream convert) or pass remote=..."
            )
        check_index(domain, index, local_dir)
        return index
    os.makedirs(local_dir, exist_ok=True)
    marker_path = os.path.join(local_dir, MARKER_NAME)
    source = redact_url(_remote_join(remote, split))  # shown in messages and kept in the marker: no password
    tmp = os.path.join(local_dir, f"index.json.remote.{os.getpid()}.tmp")
    _download_index(domain, remote, split, tmp, download_timeout, retry_deadline)
    try:
        check_index(domain, tmp, local_dir, sizes=False)  # before anything is deleted or installed by it
        new_digest = _sha256(tmp)
        marker: dict[str, Any] = {}
        if os.path.isfile(marker_path):
            try:
                marker = json.loads(Path(marker_path).read_text())
            except (OSError, ValueError):
                marker = {}
        if os.path.isfile(index):
            old_digest = _sha256(index)
            if old_digest != new_digest or (marker and marker.get("remote") != source):
                same_source = marker.get("remote") == source
                if not same_source and not overwrite_local:
                    origin = f"from {marker['remote']}" if marker.get("remote") else "of unknown origin"
                    raise RemoteMismatchError(
                        f"domain {domain!r}: local directory {local_dir} already holds a dataset {origin}, "
                        f"which is not {source} (its index.json differs). Streaming would silently read "
                        "the old shards. Use a different local directory per remote, delete it, or pass "
                        "overwrite_local=True."
                    )
                if old_digest != new_digest:
                    if same_source:
                        warnings.warn(
                            f"domain {domain!r}: {source}/index.json changed since {local_dir} was cached "
                            "(dataset re-converted?); discarding the stale local shards",
                            stacklevel=3,
                        )
                    _remove_cached_shards(domain, local_dir, index)
        if not os.path.isfile(index):
            with atomic_open(index, "wb") as f, open(tmp, "rb") as src:
                shutil.copyfileobj(src, f)
        atomic_write_json(marker_path, {"remote": source, "index_sha256": new_digest})
        check_index(domain, index, local_dir)  # the sizes too, against the shards already cached
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return index


def _remove_cached_shards(domain: str, local_dir: str, index: str) -> None:
    """Delete the shard files an outdated cached index names, every one checked to lie inside the cache
    (the whole index is refused before anything is deleted if one does not)."""
    try:
        json.loads(Path(index).read_text())
    except (OSError, ValueError):
        obj: dict[str, Any] = {"shards": []}  # unreadable: it names nothing; the index itself goes below
    else:
        obj = check_index(domain, index, local_dir, sizes=False)
    for shard in obj["shards"]:
        for key in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
            info = shard.get(key)
            path = inside(local_dir, info.get("basename")) if info else None
            if path is not None and os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
    if os.path.isfile(index):
        os.unlink(index)


# --------------------------------------------------------------------------------------------------
# S3 credentials
# --------------------------------------------------------------------------------------------------
def check_s3_credentials(domains: Iterable[tuple[str, str | None]], *, dummy_credentials: bool = False) -> None:
    """Fail early, naming the domain, when an ``s3://`` remote would be read without credentials.

    boto3 signs every request; with no credentials an S3-compatible endpoint answers only after all of
    streaming's retries, with a botocore error that names neither the domain nor the fix. With
    ``dummy_credentials=True`` (an emulator or a public bucket behind an endpoint that accepts any
    signature), placeholder credentials are put into this process's environment (inherited by
    DataLoader workers) instead.
    """
    s3 = [(name, remote) for name, remote in domains if remote and remote.startswith("s3://")]
    if not s3:
        return
    import boto3

    if boto3.session.Session().get_credentials() is not None:  # a fresh lookup: once per mixer, at start-up
        return
    if dummy_credentials:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "grape-stream-anonymous")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "grape-stream-anonymous")
        return
    endpoint = os.environ.get("S3_ENDPOINT_URL")
    where = f"the endpoint S3_ENDPOINT_URL={endpoint}" if endpoint else "AWS S3"
    name, remote = s3[0]
    raise DomainUnavailableError(
        f"domain {name!r} ({remote}): no AWS credentials found for {where}. Streaming's S3 client signs "
        "every request, even to a public bucket or an emulator. Set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (any non-empty values for an emulator without authentication), "
        "configure a profile, or pass s3_dummy_credentials=True."
    )


# --------------------------------------------------------------------------------------------------
# Same `local` on every rank of a node
# --------------------------------------------------------------------------------------------------
def check_same_locals_across_ranks(locals_: Sequence[str]) -> None:
    """With torch.distributed initialised, verify that the ranks of one node use identical local dirs.

    Streaming keys its shared memory on the local directories, so a rank with a different ``local``
    fails deep inside streaming ("Internal error: shared memory registered does not match") or hangs.
    A node is a host and ``RANK // LOCAL_WORLD_SIZE`` (two nodes' worth of ranks on one host may keep
    separate caches).
    """
    if not dist_active() or process_world().size == 1:
        return
    node = process_world().rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    mine = (f"{socket.gethostname()} (node {node})", [os.path.abspath(p) for p in locals_])
    gathered: list[Any] = [None] * process_world().size
    dist.all_gather_object(gathered, mine)
    by_host: dict[str, list[tuple[int, list[str]]]] = {}
    for rank, (host, locs) in enumerate(gathered):
        by_host.setdefault(host, []).append((rank, locs))
    for host, entries in by_host.items():
        first_rank, first = entries[0]
        for rank, locs in entries[1:]:
            if locs != first:
                diff = [(a, b) for a, b in zip(first, locs) if a != b]
                raise ValueError(
                    f"ranks {first_rank} and {rank} on host {host} use different local directories "
                    f"{diff}: every rank of a node must pass the same `local` for each domain "
                    "(streaming shares one cache per node)"
                )


def default_local_for(remote: str, split: str | None = None) -> str:
    """A per-remote cache directory in this user's private temp folder (:func:`grape_stream.user_dir.user_temp_dir`:
    refused in one line if another user could write it): node-local, the same on every rank of a node."""
    digest = hashlib.sha256(_remote_join(remote, split).encode()).hexdigest()[:16]
    return os.path.join(user_temp_dir(), "cache", digest)


def rmtree_quiet(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
