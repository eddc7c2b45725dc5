"""Decompressing a shard safely when several jobs share one local dataset directory.

Streaming 0.12 / 0.13 decompresses ``shard.N.mds.zstd`` into ``shard.N.mds.tmp`` and renames that to
``shard.N.mds`` (``Stream._decompress_shard_part``). The temporary name is the same in every process, and
streaming coordinates processes only within one job (its shared memory): two jobs reading the same local
directory with no remote (it allows that, as it must: ``make demo`` trains uniform and GRAPE side by side on
the corpus it converted) decompress the same shard at once. One renames the file while the other still writes
it (the renamed shard can be read short), and the other's rename then fails: ``FileNotFoundError:
'.../shard.00000.mds.tmp' -> '.../shard.00000.mds'``, which stopped a demo run in CI.

:func:`install_atomic_decompress` replaces that one method: the same checks and decompression (streaming's own
``get_hash`` and ``decompress``), written to a temporary name of this process and thread, moved into place
with ``os.replace`` (atomic: a reader sees no file or a whole one, and the last writer's identical bytes win).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from grape_stream.streaming_compat.method_patch import replace_method

__all__ = ["install_atomic_decompress"]

_PARAMETERS = ["self", "zip_info", "zip_filename", "raw_filename", "compression"]


def _decompress_shard_part(self: Any, zip_info: Any, zip_filename: str, raw_filename: str,
                           compression: str | None) -> None:
    from streaming.base.compression import decompress
    from streaming.base.hashing import get_hash

    with open(zip_filename, "rb") as f:
        data = f.read()
    algo = self.validate_hash
    if algo:
        if algo not in zip_info.hashes:
            raise ValueError(f"hash algorithm {algo!r} chosen to validate the data is not one the dataset was "
                             f"written with ({sorted(zip_info.hashes)}); choose one of those")
        if get_hash(algo, data) != zip_info.hashes[algo]:
            raise ValueError(f"Checksum failure: {zip_filename}")
    raw = decompress(compression, data)
    tmp = f"{raw_filename}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as out:
            out.write(raw)
        os.replace(tmp, raw_filename)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if not self.safe_keep_zip:
        with contextlib.suppress(FileNotFoundError):  # another process of the job may have dropped it already
            os.remove(zip_filename)


def install_atomic_decompress() -> bool:
    """Make streaming decompress shards through a per-process temporary name (idempotent; False when this
    streaming has no ``Stream._decompress_shard_part(self, zip_info, zip_filename, raw_filename, compression)``)."""
    try:
        from streaming.base.stream import Stream
    except ImportError:  # pragma: no cover
        return False
    return replace_method(Stream, "_decompress_shard_part", _decompress_shard_part, _PARAMETERS)
