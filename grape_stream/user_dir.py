"""This user's private folder under the temp dir, for what grape_stream keeps per node: the remote cache
(``cache/<hash of the remote>``), and the shared-memory registration lock where /dev/shm cannot hold it
(:mod:`grape_stream.streaming_compat.registration`).

A folder every user can write (``$TMPDIR/grape_stream_cache``, a lock on ``$TMPDIR`` itself) lets another
user plant shards, indexes or symlinks that a job then reads or writes through, or hold a lock that makes
every job on the host wait. So the folder is ``$TMPDIR/grape_stream-<uid>``, created with mode 700, and one
that is not a real directory, is owned by another user or is writable by others is refused in one line
(:class:`UnsafeCacheError`) rather than used.
"""

from __future__ import annotations

import os
import stat
import tempfile

from grape_stream.errors import ConfigError

__all__ = ["UnsafeCacheError", "user_temp_dir"]


class UnsafeCacheError(ConfigError):
    """This user's temp folder is another user's, a symlink, or writable by others (one line on the CLI)."""


def user_temp_dir() -> str:
    """``$TMPDIR/grape_stream-<uid>``, created private on first use and checked on every use."""
    root = os.path.join(tempfile.gettempdir(), f"grape_stream-{os.getuid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.lstat(root)
    why = ("is not a directory (a symlink?)" if not stat.S_ISDIR(st.st_mode)
           else f"is owned by uid {st.st_uid}, not by you (uid {os.getuid()})" if st.st_uid != os.getuid()
           else f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})" if st.st_mode & 0o022 else None)
    if why:
        raise UnsafeCacheError(f"grape_stream's folder {root} {why}: another user could plant or replace files "
                               "there; remove it, set TMPDIR to a folder of yours, or pass local=... per domain")
    return root
