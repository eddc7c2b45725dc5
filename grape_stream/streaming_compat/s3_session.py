"""One boto3 session per process for streaming's S3 downloads: credentials looked up once, refreshed on refusal.

mosaicml-streaming 0.12 / 0.13 build every S3 client from a new ``boto3.session.Session()``
(``S3Downloader._create_s3_client``), and drop the client after every failed download, so each index
download and each failed shard download resolves credentials again: an instance-metadata request, an
SSO cache read or a ``credential_process`` run per shard under a throttled or flaky store (the session
reuse streaming users asked for). Installed here, every such client comes from one session per process
(a forked DataLoader worker makes its own on first use), so credentials are resolved once; refreshable
credentials (instance roles, assume-role, SSO, a ``credential_process`` with an expiry) renew
themselves inside it as botocore does.

Credentials that a store refuses mid-run (rotated by a sidecar rewriting the credentials file, a revoked
key) call :func:`refresh_credentials`: the session is dropped, once per rotation and process, and the
next client reads the credentials again. The patch is version-guarded: on a streaming without the
expected hook, streaming's own behaviour stays.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from grape_stream.streaming_compat.method_patch import replace_method

__all__ = ["install_shared_s3_session", "refresh_credentials", "shared_session", "session_generation"]

_LOCK = threading.RLock()
_STATE: dict[str, Any] = {"pid": None, "session": None, "generation": 0}
_GEN_ATTR = "_grape_stream_session_generation"


def shared_session() -> Any:
    """This process's boto3 session (made on first use, and again after a fork or a refresh)."""
    with _LOCK:
        if _STATE["session"] is None or _STATE["pid"] != os.getpid():
            import boto3

            _STATE.update(pid=os.getpid(), session=boto3.session.Session(), generation=_STATE["generation"] + 1)
        return _STATE["session"]


def session_generation(downloader: Any) -> int | None:
    """Which session a streaming downloader's client came from (None: not from the shared one)."""
    return getattr(downloader, _GEN_ATTR, None)


def refresh_credentials(used_generation: int | None = None) -> None:
    """Drop the shared session so the next client reads the credentials again. With `used_generation`
    (the refused client's session), only if that session is still the current one: a rotation refreshes
    once per process, not once per domain."""
    with _LOCK:
        if used_generation is None or used_generation == _STATE["generation"]:
            _STATE["session"] = None


def _create_s3_client(self: Any, unsigned: bool = False, timeout: float = 60.0) -> Any:
    """streaming's ``S3Downloader._create_s3_client`` (0.12 / 0.13: adaptive retries, the read timeout,
    unsigned for public buckets, S3_ENDPOINT_URL), with the client made from the shared session."""
    from botocore import UNSIGNED
    from botocore.config import Config

    retries = {"mode": "adaptive"}
    if unsigned:
        config = Config(read_timeout=timeout, signature_version=UNSIGNED, retries=retries)
    else:
        config = Config(read_timeout=timeout, retries=retries)
    with _LOCK:  # creating clients from one session is not thread-safe (the prefetch thread, the reader)
        session = shared_session()
        self._s3_client = session.client("s3", config=config, endpoint_url=os.environ.get("S3_ENDPOINT_URL"))
        setattr(self, _GEN_ATTR, _STATE["generation"])
    return self._s3_client


def install_shared_s3_session() -> bool:
    """Make streaming's S3 downloads use :func:`shared_session` (idempotent; False when this streaming
    has no ``S3Downloader._create_s3_client(self, unsigned, timeout)`` to replace)."""
    try:
        from streaming.base.storage.download import S3Downloader
    except ImportError:  # pragma: no cover
        return False
    return replace_method(S3Downloader, "_create_s3_client", _create_s3_client, ["self", "unsigned", "timeout"])
