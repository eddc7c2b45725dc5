"""Atomic file writes: a reader (or a resumed run after SIGKILL) sees the old file or the whole new one.

Every file that a later run reads to decide what to do (markers, manifests, indexes, trajectories,
owner records) goes through here, so the write-to-temp-then-rename rule lives in one place.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import IO, Any, Iterator

__all__ = ["atomic_open", "atomic_write_json", "atomic_write_text"]


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", *, fsync: bool = True) -> Iterator[IO[Any]]:
    """Open a temporary sibling of `path` for writing; rename it over `path` only if the block succeeds.

    The temporary name carries the pid, so two processes never write the same temporary file, and a
    file left by a killed writer is never mistaken for the real one. It is created exclusively and not
    through a symlink (``O_EXCL | O_NOFOLLOW``): a name planted in a shared folder (``/dev/shm``) is
    removed, not written through; a left-over of a killed writer with the same pid is removed the same way.
    `fsync` makes the content durable before the rename (what a crash-consistent marker needs); skip it
    for files that are cheap to redo. `mode` is "w" or "wb".
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole new file: mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    encoding = None if "b" in mode else "utf-8"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            os.unlink(tmp)  # unlink removes a symlink itself, never its target
            fd = os.open(tmp, flags, 0o666)
        with open(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, fsync: bool = True) -> None:
    """Write `obj` as indented, key-sorted JSON (stable bytes for identical content)."""
    with atomic_open(path, fsync=fsync) as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")


def atomic_write_text(path: str | os.PathLike[str], text: str, *, fsync: bool = True) -> None:
    with atomic_open(path, fsync=fsync) as f:
        f.write(text)
