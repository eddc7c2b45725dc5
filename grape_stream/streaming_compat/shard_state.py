"""The few mosaicml-streaming internals the mixer's shard reader relies on, behind one version guard.

Written for mosaicml-streaming 0.12.x and 0.13.x (``>=0.12,<0.14``; llm-foundry 0.22 needs ``<0.13``).
``streaming/base/dataset.py`` (where every attribute below lives) and ``streaming/base/shared/`` are
byte-identical in 0.12.0 and 0.13.0, and ``tests/test_mixer_*`` pass on both
(``scripts/test_streaming_versions.sh`` runs them against 0.12.0). The public API covers downloading
(``prepare_shard``) and reading one sample (``get_item``), not the per-shard cache state, so that part
stays private and version-checked here. The mixer reads samples by random access straight out of memory-mapped
MDS shards (see :mod:`grape_stream.mixing.shard_reader`) while streaming keeps the node-wide shard cache.
To stay consistent with that cache it must see and update streaming's per-shard bookkeeping, which
streaming exposes only as private attributes of ``StreamingDataset``:

* ``_shard_states[shard]`` (a ``_ShardState``; ``LOCAL`` = downloaded and decompressed): a mapped shard
  that is no longer LOCAL was evicted, so the reader drops its mapping and lets the disk space go;
* ``_shard_access_times[shard]``: refreshed on every read, as ``get_item`` does, so that eviction picks
  the coldest shard;
* ``_shm_prefix_int``: the shared-memory prefix a dataset registered (leak checks);
* ``prepare_shard(shard, blocking)``: download / decompress with streaming's cache accounting.

A different streaming version may rename or re-type any of them, and the failure would then be an
``AttributeError`` deep inside a DataLoader worker; :func:`require_supported_streaming` turns that into
one clear error when the mixer starts. Streaming's submodules are imported inside the functions, after
that check, so that an unsupported release fails with that error rather than an ImportError at import.
"""

from __future__ import annotations

import functools
from time import time_ns
from typing import Any, Iterable

import streaming

from grape_stream.errors import UserFacingError

__all__ = [
    "SUPPORTED",
    "REQUIREMENT",
    "UnsupportedStreamingVersion",
    "check_dataset",
    "require_supported_streaming",
    "bytes_to_int",
    "is_mds_shard",
    "shard_is_local",
    "shards_of",
    "touch_shard",
    "prepare_shard",
    "reset_failed_download",
    "shard_is_preparing",
    "shm_prefix",
    "fetch_shards",
]

#: The streaming releases whose internals this module was written against: (major, minor).
SUPPORTED = ((0, 12), (0, 13))
#: The pip requirement matching SUPPORTED (said in the error).
REQUIREMENT = "mosaicml-streaming>=0.12,<0.14"
_REQUIRED_ATTRS = ("_shard_states", "_shard_access_times", "_shm_prefix_int")


class UnsupportedStreamingVersion(UserFacingError, RuntimeError):
    """The installed mosaicml-streaming is not a release whose internals the mixer knows."""


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (-1, -1)


@functools.lru_cache(maxsize=1)
def require_supported_streaming() -> int:
    """Check the installed streaming once; return the value of its ``_ShardState.LOCAL``.

    Raises :class:`UnsupportedStreamingVersion` naming the installed and the supported versions.
    """
    version = getattr(streaming, "__version__", "unknown")
    wanted = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
    if _version_tuple(version) not in SUPPORTED:
        raise UnsupportedStreamingVersion(
            f"grape_stream's mixer needs mosaicml-streaming {wanted} (it relies on internals of that release: "
            f"{', '.join(_REQUIRED_ATTRS)}, _ShardState.LOCAL); installed: {version}. "
            f"Install {REQUIREMENT}."
        )
    try:
        from streaming.base.dataset import _ShardState

        return int(_ShardState.LOCAL)
    except (ImportError, AttributeError) as exc:  # pragma: no cover - a patched release
        raise UnsupportedStreamingVersion(
            f"mosaicml-streaming {version} has no streaming.base.dataset._ShardState.LOCAL: {exc}"
        ) from exc


def _check_dataset(dataset: Any) -> None:
    missing = [a for a in _REQUIRED_ATTRS if not hasattr(dataset, a)]
    if missing:
        raise UnsupportedStreamingVersion(
            f"this StreamingDataset (mosaicml-streaming {getattr(streaming, '__version__', 'unknown')}) lacks "
            f"{missing}, which the mixer's shard reader uses; install {REQUIREMENT}"
        )


def check_dataset(dataset: Any) -> None:
    """Fail clearly when ``dataset`` lacks the internals used here (call once per dataset)."""
    require_supported_streaming()
    _check_dataset(dataset)


def bytes_to_int(size: int | str) -> int:
    """Streaming's parser of cache sizes such as ``"10gb"``, so limits mean what they mean to streaming."""
    from streaming.base.util import bytes_to_int as _bytes_to_int

    return int(_bytes_to_int(size))


def is_mds_shard(shard: Any) -> bool:
    """Whether a shard reader is streaming's MDS reader (the only format the mixer memory-maps)."""
    from streaming.base.format.mds.reader import MDSReader

    return isinstance(shard, MDSReader)


def shard_is_local(dataset: Any, shard_id: int) -> bool:
    """Whether streaming's cache says the shard is downloaded and decompressed (not evicted)."""
    return bool(dataset._shard_states[shard_id] == require_supported_streaming())


def touch_shard(dataset: Any, shard_id: int) -> None:
    """Mark the shard as just read, as ``StreamingDataset.get_item`` does, for LRU eviction."""
    dataset._shard_access_times[shard_id] = time_ns()


def prepare_shard(dataset: Any, shard_id: int, *, blocking: bool = True) -> None:
    """Download / decompress a shard through streaming's cache (evicting cold shards under cache_limit).

    Streaming 0.12 / 0.13 marks the shard PREPARING, downloads, and marks it LOCAL; when the download raises
    (an outage, a reset, a throttled request) it leaves the shard PREPARING for good, and every later
    ``prepare_shard`` of it, in any worker of the node, waits for it forever. So a failed attempt puts
    the shard back to REMOTE (under streaming's cache lock), and the caller's retry can download it again.
    """
    try:
        dataset.prepare_shard(shard_id, blocking=blocking)
    except BaseException:
        reset_failed_download(dataset, shard_id)
        raise


def reset_failed_download(dataset: Any, shard_id: int) -> None:
    """Put a shard this process left PREPARING back to REMOTE (a no-op in any other state)."""
    from streaming.base.dataset import _ShardState

    lock = getattr(dataset, "_cache_filelock", None)  # created by prepare_shard before any download starts
    if lock is None:
        return
    held = lock.is_locked  # streaming raised while holding its cache lock (during eviction): free it too
    with lock:
        if dataset._shard_states[shard_id] == _ShardState.PREPARING:
            dataset._shard_states[shard_id] = _ShardState.REMOTE
    if held:
        lock.release(force=True)


def shard_is_preparing(dataset: Any, shard_id: int) -> bool:
    """Whether some process of the node is downloading the shard right now."""
    from streaming.base.dataset import _ShardState

    return bool(dataset._shard_states[shard_id] == _ShardState.PREPARING)


def fetch_shards(dataset: Any, *, what: str, url: str, policy: Any = None,
                 shard_ids: Iterable[int] | None = None) -> int:
    """Download (and decompress) every shard of `dataset` not local yet (or only ``shard_ids``), each under the
    retry policy (see :func:`grape_stream.retry.storage_call`), so that later reads through streaming's own
    iteration find them local. Returns how many were fetched. All of them: for small datasets (target tasks)
    read without a cache_limit; ``shard_ids``: the shards a few samples of a large one live in
    (:func:`shards_of`)."""
    from grape_stream.retry import storage_call
    from grape_stream.streaming_compat.s3_session import refresh_credentials

    fetched = 0
    for shard_id in (range(len(dataset.shards)) if shard_ids is None else shard_ids):
        if shard_is_local(dataset, shard_id):
            continue
        name = dataset.shards[shard_id].raw_data.basename
        storage_call(functools.partial(prepare_shard, dataset, shard_id), policy=policy, url=url,
                     what=f"{what}: cannot fetch shard {name} from {url}", refresh=refresh_credentials)
        fetched += 1
    return fetched


def shards_of(dataset: Any, sample_ids: Iterable[int]) -> list[int]:
    """The shards (ids, ascending) that hold these samples of ``dataset`` (streaming's sample -> shard map)."""
    return sorted({int(dataset.spanner[int(i)][0]) for i in sample_ids})


def shm_prefix(dataset: Any) -> int:
    """The shared-memory prefix streaming registered for this dataset (``/dev/shm/<prefix:06>_*``)."""
    return int(dataset._shm_prefix_int)
