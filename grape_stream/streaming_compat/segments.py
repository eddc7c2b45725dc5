"""Ending a shared-memory segment by identity, never by name alone: what stops one job deleting another's.

A POSIX segment is a name in /dev/shm; streaming 0.12 / 0.13 numbers its prefixes from 0 and reuses a
free number at once, so the same name (``/000021_locals``) belongs to different jobs over time. Everything
that ends a segment by name can therefore hit a segment that is not the one it meant:

* Python's ``resource_tracker`` unlinks, when a process exits, every segment name the process created
  and did not unlink itself (``SharedMemory.unlink`` tells it; anything else does not);
* ``SharedMemory.unlink`` and streaming's exit hook unlink whatever now has the name.

The chain seen on a busy machine (a benchmark runner training 12 times in one process beside other
jobs): a job's segment is removed by someone else (a stale-state sweep, or another job's tracker); its
tracker keeps the name; at that job's exit the tracker unlinks the name, which by then is a *live* segment
of the next job to take the prefix; that job in turn fails to unlink it at close (``No such file or
directory: '/000021_locals'``), keeps the name, prints the resource_tracker warnings at its exit, and its
tracker deletes whatever holds the name then, and so on. So a segment this process created is ended
here only if the name still refers to the very file it created (same inode); either way the tracker
forgets the name, so nothing of this process unlinks it later. Sweeps unlink a stale name only if it is
still the file they judged stale.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["close_segment", "end_created_segment", "unlink_if_unchanged"]

SHM_DIR = "/dev/shm"


def _is_ours(seg: Any) -> bool:
    """Whether ``/dev/shm/<name>`` is still the file ``seg`` (a segment this process created) maps."""
    try:
        mine = os.fstat(seg._fd)
        now = os.stat(os.path.join(SHM_DIR, seg._name.lstrip("/")))
    except (OSError, AttributeError, TypeError):
        return False
    return (mine.st_ino, mine.st_dev) == (now.st_ino, now.st_dev)


def _forget(name: str) -> None:
    """Tell this process's resource tracker that `name` is not its to unlink at exit."""
    from multiprocessing import resource_tracker

    try:
        resource_tracker.unregister(name, "shared_memory")
    except Exception as exc:  # pragma: no cover - the tracker is gone at interpreter shutdown
        logger.debug("resource_tracker.unregister(%s) failed: %s", name, exc)


def close_segment(seg: Any) -> None:
    """Close a ``SharedMemory`` even while a numpy view of it is alive.

    ``SharedMemory.close`` (CPython 3.11) releases its buffer first and raises ``BufferError`` while a view
    is exported, before it closes its descriptor; its ``__del__`` then fails the same way, so every such
    segment kept one descriptor open for the life of the process (thousands over a test session or a
    benchmark that opens many datasets: "Too many open files"). The mapping needs no descriptor (mmap keeps
    its own until the last view dies), so the descriptor is closed here whatever the views.
    """
    try:
        seg.close()
        return
    except (BufferError, OSError):
        pass
    fd = getattr(seg, "_fd", -1)
    if isinstance(fd, int) and fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
        seg._fd = -1


def end_created_segment(seg: Any) -> bool:
    """Close a segment this process created (a ``multiprocessing.shared_memory.SharedMemory``); unlink it
    if the name is still that segment's; in every case the resource tracker forgets the name. Returns
    whether it unlinked. Call it once per segment (the caller drops it from streaming's lists)."""
    ours = _is_ours(seg)  # before close(): it needs the descriptor
    close_segment(seg)  # a numpy view may still be alive: the unlink below still frees the memory
    name = getattr(seg, "_name", None)
    if not name:
        return False
    if ours:
        try:
            seg.unlink()  # shm_unlink, then the tracker forgets the name
            return True
        except FileNotFoundError:
            pass  # removed between the check and here
        except OSError as exc:  # pragma: no cover - best effort, never mask the caller's error
            logger.debug("shared memory unlink failed: %s", exc)
    _forget(name)
    return False


def unlink_if_unchanged(path: str, inode: int) -> bool:
    """Unlink `path` if it is still the file with `inode` (what a sweep judged stale, not a segment a new
    job created under the same name since); False when it is gone, changed or cannot be removed."""
    try:
        if os.stat(path).st_ino != inode:
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:  # pragma: no cover - permissions on an odd system
        logger.debug("could not remove stale %s: %s", path, exc)
        return False
