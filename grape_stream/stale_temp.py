"""Remove what killed runs leave in the temp directory: Python multiprocessing's ``pymp-*`` folders.

torch's DataLoader workers hand tensors to the main process by passing file descriptors over a Unix
socket that multiprocessing creates in ``$TMPDIR/pymp-XXXXXX/listener-XXXXXX``; a normal exit removes the
folder, a SIGKILL cannot. Left alone they pile up (22 after 11 killed runs). A folder is stale when every
socket in it is bound by no live process on this machine: the kernel lists every bound Unix socket path
in ``/proc/net/unix`` (Linux), so this never touches a folder a live process still uses. Empty folders
(a live process may be about to bind) are left unless they are over an hour old.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import time

__all__ = ["sweep_stale_multiprocessing_dirs"]

logger = logging.getLogger(__name__)
_EMPTY_MIN_AGE_S = 3600.0


def _bound_unix_socket_paths() -> set[str] | None:
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            return {parts[7] for line in f if len(parts := line.split()) >= 8}
    except OSError:
        return None  # not Linux / no procfs: nothing can be proven stale


def _listing(path: str) -> tuple[os.stat_result, list[str]] | None:
    """The folder's stat and entries, or None when it is not a folder of this user."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        return st, os.listdir(path)
    except OSError:
        return None


def _is_stale(path: str, st: os.stat_result, entries: list[str], bound: set[str], now: float) -> bool:
    if not entries:
        return now - st.st_mtime > _EMPTY_MIN_AGE_S
    for name in entries:
        full = os.path.join(path, name)
        try:
            if not stat.S_ISSOCK(os.lstat(full).st_mode) or full in bound:
                return False
        except OSError:
            return False
    return True


def sweep_stale_multiprocessing_dirs(tmpdir: str | None = None) -> list[str]:
    """Delete stale ``pymp-*`` folders in `tmpdir` (default: the temp dir); returns the paths removed."""
    root = tmpdir or tempfile.gettempdir()
    now = time.time()
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith("pymp-")]
    except OSError:
        return []
    # The folders' entries first, the bound sockets after: a socket a live process binds between the two readings
    # is either not listed yet or already bound (read the other way round, a listener bound just after the
    # reading of /proc was taken for a dead one, and a live DataLoader's folder was deleted under it).
    listed = {os.path.join(root, n): found for n in names if (found := _listing(os.path.join(root, n))) is not None}
    bound = _bound_unix_socket_paths()
    if bound is None:
        return []
    for path, (st, entries) in listed.items():
        if _is_stale(path, st, entries, bound, now):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    if removed:
        logger.info("removed %d stale multiprocessing temp folder(s) left by killed runs", len(removed))
    return removed
