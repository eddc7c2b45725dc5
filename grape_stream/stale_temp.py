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


def _is_stale(path: str, bound: set[str], now: float) -> bool:
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        entries = os.listdir(path)
    except OSError:
        return False
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
    bound = _bound_unix_socket_paths()
    if bound is None:
        return []
    root = tmpdir or tempfile.gettempdir()
    now = time.time()
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith("pymp-")]
    except OSError:
        return []
    for name in names:
        path = os.path.join(root, name)
        if _is_stale(path, bound, now):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    if removed:
        logger.info("removed %d stale multiprocessing temp folder(s) left by killed runs", len(removed))
    return removed
