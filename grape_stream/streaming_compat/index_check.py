"""What an MDS ``index.json`` may claim before streaming (or the library) acts on it.

An index comes from storage that others can write (a shared bucket, a cache folder), and streaming trusts
it: every shard file name in it (``raw_data`` / ``zip_data`` / ``raw_meta`` / ``zip_meta`` basenames) is
joined to the local cache directory and written there on a read, and evicted (deleted) from there later;
the library deletes what an outdated cached index names. A name such as ``../../.ssh/authorized_keys`` or
``/usr/lib/python3/site-packages/x.pth`` would write or delete outside the cache. Its sample counts size
the arrays opened for the domain: a 300-byte index claiming 10^9 samples allocates GBs. So every index the
library hands to streaming, and every one it deletes by, passes :func:`check_index` first: names stay
inside the folder, counts fit the bytes the shards hold (an MDS shard spends at least 4 bytes of offsets
per sample, and its uint32 offsets cap it at 4 GiB), and a shard file already present has the size its
index claims. A lie is one :class:`UnsafeIndexError` line naming the domain and the entry.
"""

from __future__ import annotations

import json
import os
from typing import Any

from grape_stream.errors import DataError

__all__ = ["UnsafeIndexError", "check_index", "inside"]

_FILE_KEYS = ("raw_data", "zip_data", "raw_meta", "zip_meta")
#: MDS shard layout: a uint32 sample count, then n + 1 uint32 offsets, then the samples.
_MDS_HEADER = 8
_MDS_PER_SAMPLE = 4
_MDS_MAX_BYTES = 1 << 32


class UnsafeIndexError(DataError):
    """An index.json names a file outside its folder, or claims more than its shards can hold."""


def inside(folder: str, basename: Any) -> str | None:
    """``folder/basename`` when it stays inside ``folder`` (relative, no ``..`` part, resolving under
    it through any symlink), else None."""
    if not isinstance(basename, str) or not basename or "\x00" in basename:
        return None
    if os.path.isabs(basename) or basename.startswith(("/", "\\")):
        return None
    if ".." in basename.replace("\\", "/").split("/"):
        return None
    root = os.path.realpath(folder)
    path = os.path.join(folder, basename)
    resolved = os.path.realpath(path)
    if os.path.commonpath([root, resolved]) != root or resolved == root:
        return None
    return path


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def check_index(domain: str, index_path: str, folder: str | None = None, *, sizes: bool = True) -> dict[str, Any]:
    """Parse ``index_path`` and refuse (:class:`UnsafeIndexError`, one line) an index whose file names
    leave ``folder`` (default: the index's own folder) or, with ``sizes``, whose counts its shards cannot
    hold; return it. ``sizes=False`` checks the names only (an outdated index, read to delete its files)."""
    folder = folder if folder is not None else os.path.dirname(os.path.abspath(index_path))
    try:
        with open(index_path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as exc:
        raise UnsafeIndexError(f"domain {domain!r}: cannot read {index_path} as an MDS index "
                               f"({type(exc).__name__}: {exc})") from None
    shards = obj.get("shards") if isinstance(obj, dict) else None
    if not isinstance(shards, list):
        raise UnsafeIndexError(f"domain {domain!r}: {index_path} is not an MDS index (no 'shards' list)")
    for n, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise UnsafeIndexError(f"domain {domain!r}: {index_path} shard {n} is not an object")
        _check_shard(domain, index_path, folder, n, shard, sizes)
    return obj


def _check_shard(domain: str, index_path: str, folder: str, n: int, shard: dict[str, Any], sizes: bool) -> None:
    where = f"domain {domain!r}: {index_path} shard {n}"
    for key in _FILE_KEYS:
        info = shard.get(key)
        if info is None:
            continue
        name = info.get("basename") if isinstance(info, dict) else None
        path = inside(folder, name)
        if path is None:
            raise UnsafeIndexError(f"{where}: refusing {key} basename {name!r}: it must be a relative path "
                                   f"inside the domain's folder {folder} (no absolute path, no '..')")
        if not sizes:
            continue
        claimed = _int(info.get("bytes"))
        if claimed is None:
            raise UnsafeIndexError(f"{where}: {key} bytes must be a non-negative integer, got {info.get('bytes')!r}")
        try:
            actual = os.stat(path).st_size
        except OSError:
            continue  # not downloaded yet
        if actual != claimed:
            raise UnsafeIndexError(f"{where}: {key} {name!r} is {actual} bytes on disk but the index claims "
                                   f"{claimed}: the index does not describe these shards")
    if not sizes:
        return
    samples = _int(shard.get("samples"))
    if samples is None:
        raise UnsafeIndexError(f"{where}: samples must be a non-negative integer, got {shard.get('samples')!r}")
    raw = shard.get("raw_data")
    if shard.get("format") == "mds" and isinstance(raw, dict):
        size = int(raw["bytes"])
        if size >= _MDS_MAX_BYTES or _MDS_HEADER + _MDS_PER_SAMPLE * samples > size:
            raise UnsafeIndexError(f"{where}: claims {samples} samples in a {size}-byte MDS shard, which holds at "
                                   f"most {max(0, (min(size, _MDS_MAX_BYTES - 1) - _MDS_HEADER) // _MDS_PER_SAMPLE)}"
                                   ": refusing an index that lies about its size")
