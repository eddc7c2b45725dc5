"""The machine-wide lock over streaming's shared-memory names: registrations and removals, one at a time.

Streaming 0.12 / 0.13 chooses a dataset's prefix by scanning ``/dev/shm`` (and the file locks in ``$TMPDIR``)
for the first free number, on *every* rank of a job, each on its own, and then checks that the ranks agree.
So the names must not change while a job registers: not by another job registering (two jobs would pick the
same prefix), and not by a removal either. A job closing a dataset (or a sweep of a dead job's segments)
that frees a number below the first free one while the leader and its followers scan makes them disagree:
``shared memory prefix=64 was not registered by local leader``, seen between test workers' multi-rank jobs.

:func:`registration_lock` is held while a job registers; :func:`removal_lock` while a process unlinks
streaming names (:func:`~grape_stream.streaming_compat.shm.release_streaming_dataset`,
:func:`~grape_stream.streaming_compat.shm.cleanup_stale_streaming_shm`). Both are one ``flock`` on this user's
file beside the segments (``/dev/shm/grape_stream_registration.<uid>.lock``), so jobs with different
``TMPDIR``s still exclude each other. A removal never waits forever: after ``timeout`` it goes ahead without the
lock (a leak is worse than the rare race), and a process that already holds the lock does not take it again
(``flock`` on a second descriptor would wait for itself).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from typing import Iterator

from grape_stream.streaming_compat.processes import flock_holder
from grape_stream.user_dir import user_temp_dir

__all__ = ["registration_lock", "removal_lock"]

SHM_DIR = "/dev/shm"
logger = logging.getLogger(__name__)
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_held = 0  # how many registration_lock / removal_lock blocks of this process hold the flock now


def _open_lock_file(shm_dir: str) -> int:
    """A descriptor on this user's lock file.

    The lock belongs where the names it protects live: /dev/shm is one per machine (or per container /
    mount namespace), while ``$TMPDIR`` may differ per job. The file is per user (another user cannot hold
    this user's jobs up), opened without following a symlink and checked to be a regular file this user
    owns: a name another user planted in the shared /dev/shm is not used; the per-user temp folder's lock
    is then the fallback (it serialises the jobs that share a ``TMPDIR``; the retry in
    :func:`~grape_stream.streaming_compat.registration.create_registered` covers the rest)."""
    if os.path.isdir(shm_dir):
        path = os.path.join(shm_dir, f"grape_stream_registration.{os.geteuid()}.lock")
        try:
            fd = os.open(path, _OPEN_FLAGS, 0o600)
        except OSError as exc:
            why = str(exc)
        else:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                return fd
            os.close(fd)
            why = f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid() else "not a regular file"
        logger.warning("not using %s as the shared-memory registration lock (%s); using a lock in this user's "
                       "temp folder instead, which only jobs sharing TMPDIR take", path, why)
    return os.open(os.path.join(user_temp_dir(), "registration.lock"), _OPEN_FLAGS, 0o600)


@contextlib.contextmanager
def _flock(shm_dir: str, timeout: float, on_timeout: str) -> Iterator[None]:
    """Hold the lock (``on_timeout="raise"``: TimeoutError naming the holder; ``"proceed"``: go on unlocked)."""
    global _held
    if _held:
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = _open_lock_file(shm_dir)
    try:
        deadline = time.monotonic() + timeout
        locked = True
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    if on_timeout == "raise":
                        raise TimeoutError(f"waited {timeout:.0f} s for another process registering "
                                           f"StreamingDatasets on this machine{flock_holder(fd)}") from None
                    logger.warning("removing streaming's shared memory without the registration lock after "
                                   "waiting %.0f s%s", timeout, flock_holder(fd))
                    locked = False
                    break
                time.sleep(0.01)
        _held += locked
        try:
            yield
        finally:
            _held -= locked
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def registration_lock(enabled: bool = True, timeout: float = 600.0, *, shm_dir: str = SHM_DIR) -> Iterator[None]:
    """Serialise streaming's shared-memory registration (and removals) among the processes of this machine.

    Take it on the local leader only, once every rank of the job has arrived (then none of them waits in a
    :func:`removal_lock` for it): :func:`~grape_stream.streaming_compat.registration.create_registered`.
    A holder that stays past ``timeout`` (a hung job) costs one TimeoutError that names its pid.
    """
    if not enabled:
        yield
        return
    with _flock(shm_dir, timeout, "raise"):
        yield


@contextlib.contextmanager
def removal_lock(timeout: float = 60.0, *, shm_dir: str = SHM_DIR) -> Iterator[None]:
    """Hold the lock while unlinking streaming's names, so no job's ranks scan a changing ``/dev/shm``."""
    with _flock(shm_dir, timeout, "proceed"):
        yield
