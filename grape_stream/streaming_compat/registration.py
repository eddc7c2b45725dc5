"""Registering streaming's shared memory: one process of the machine at a time, released at exit safely.

* **Racy registration.** Two jobs that start at once can pick the same prefix (streaming 0.12 / 0.13
  scan /dev/shm, then create, with no lock) and share each other's shard states: :func:`registration_lock`
  serialises registration among this user's jobs on this machine with an ``flock`` on a per-user file
  beside the segments it protects (``/dev/shm/grape_stream_registration.<uid>.lock``), so jobs with
  different ``TMPDIR``s (test workers, schedulers that give each job its own) still exclude each other.
  Every rank of a job scans for the prefix on its own (streaming 0.13 ``get_shm_prefix``), so the non-leader
  ranks must scan while their leader holds the lock too, or another job's registration between their scan
  and the leader's makes them disagree ("shared memory registered does not match local leader"):
  :func:`create_registered` puts a barrier after the leader has the lock and before any rank scans.
  A job that does not take the lock (plain streaming, another user) can still take the prefix between
  the scan and the create: :func:`create_registered` retries then, with every rank of a job retrying
  together (a leader failing alone used to leave its ranks waiting at streaming's barrier).
* **Unlinking by name at exit.** A dataset this process created and never released (a task's splits,
  a mixer not closed) would be unlinked by name at exit by streaming's own hook, whatever the name holds
  by then; :func:`create_registered` arranges for grape_stream's release (by identity, see
  :mod:`grape_stream.streaming_compat.segments`) to run first, in the creating process only.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import stat
import time
from typing import Any, Callable, Iterator, TypeVar

from grape_stream.streaming_compat.processes import flock_holder
from grape_stream.streaming_compat.shm import (
    SHM_DIR,
    live_streaming_datasets,
    record_owner,
    release_streaming_dataset,
)
from grape_stream.user_dir import user_temp_dir
from grape_stream.world import dist_active

__all__ = ["create_registered", "registration_lock"]

T = TypeVar("T")
_CREATOR = "_grape_stream_creator_pid"
logger = logging.getLogger(__name__)
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_lock_file(shm_dir: str) -> int:
    """A descriptor on this user's registration lock file.

    The lock belongs where the names it protects live: /dev/shm is one per machine (or per container /
    mount namespace), while ``$TMPDIR`` may differ per job. The file is per user (another user cannot hold
    this user's jobs up), opened without following a symlink and checked to be a regular file this user
    owns: a name another user planted in the shared /dev/shm is not used; the per-user temp folder's lock
    is then the fallback (it serialises the jobs that share a ``TMPDIR``; the retry in
    :func:`create_registered` covers the rest)."""
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


def _release_at_exit() -> None:
    """Release every StreamingDataset this process created and still holds (runs before streaming's hooks)."""
    for ds in live_streaming_datasets():
        if getattr(ds, _CREATOR, None) == os.getpid():
            try:
                release_streaming_dataset(ds)
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def _release_before_streaming_at_exit(dataset: Any) -> None:
    """Mark `dataset` as created here and (re-)register the exit hook: atexit runs hooks last-in first-out,
    so registering it after streaming registered the dataset's segment hooks makes it run before them."""
    try:
        setattr(dataset, _CREATOR, os.getpid())
    except AttributeError:  # not a StreamingDataset (a test's stand-in): nothing to release
        return
    atexit.unregister(_release_at_exit)
    atexit.register(_release_at_exit)


@contextlib.contextmanager
def registration_lock(enabled: bool = True, timeout: float = 600.0, *, shm_dir: str = SHM_DIR) -> Iterator[None]:
    """Serialise streaming's shared-memory registration among the processes of this machine.

    Streaming picks its prefix by scanning /dev/shm and then creating the segments, without a lock: two
    jobs that start at the same moment can pick the same prefix and share each other's shard states.
    This takes an exclusive ``flock`` on this user's lock file beside the segments (:func:`_open_lock_file`;
    a lock any user could take, such as one on ``$TMPDIR`` itself, would let another user stall every job
    on the host) while this process registers its datasets; another user's racing job is handled by the
    retry in :func:`create_registered`. Take it on the local leader only: the other ranks wait at
    :func:`create_registered`'s barrier until the leader has it, then scan.
    """
    if not enabled:
        yield
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = _open_lock_file(shm_dir)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout:.0f} s for another process registering "
                                       f"StreamingDatasets on this machine{flock_holder(fd)}") from None
                time.sleep(0.01)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def create_registered(factory: Callable[[], T], *, enabled: bool = True, attempts: int = 20) -> T:
    """``factory()`` (a StreamingDataset constructor) under :func:`registration_lock`, retried when the
    shared-memory prefix streaming chose was taken meanwhile by a job that does not take our lock (a plain
    streaming job, another library): streaming 0.13 then raises ``FileExistsError: '/NNNNNN_locals'``
    before it registered anything, so trying again after a short random pause picks the next prefix.
    ``enabled``: this process is its node's leader (the other ranks wait at the barrier); without a process group
    every process takes the lock. With a process group every rank retries together (:func:`_create_on_ranks`)."""
    # Without a process group no barrier orders this process after a leader: it registers on its own (a single
    # process, or ranks simulated in one process, as an elastic resume's planning does), so it takes the lock.
    if dist_active():
        return _create_on_ranks(factory, lock=enabled, attempts=attempts)
    for attempt in range(attempts):
        try:
            with registration_lock():
                dataset = factory()
            return _owned(dataset)
        except FileExistsError as exc:
            if not _prefix_taken(exc) or attempt == attempts - 1:
                raise
            time.sleep(random.uniform(0.05, 0.25))
    raise AssertionError("unreachable")  # pragma: no cover


def _owned(dataset: T) -> T:
    record_owner(dataset)  # every dataset's segments are judged by their owner, not by who maps them
    _release_before_streaming_at_exit(dataset)
    return dataset


def _prefix_taken(exc: BaseException) -> bool:
    """Streaming's local leader found its prefix's ``_locals`` segment created by someone else."""
    return isinstance(exc, FileExistsError) and "_locals" in str(exc)


def _create_on_ranks(factory: Callable[[], T], *, lock: bool, attempts: int) -> T:
    """The retry of :func:`create_registered` when several ranks register together.

    Streaming 0.13's ``get_shm_prefix`` has every rank scan, then a barrier, then the local leader creates the
    ``_locals`` segment, then a second barrier, then the other ranks attach to it. A leader whose create fails
    (another job took the name after the scan) used to raise between the two barriers, leaving its ranks
    waiting at the second one until the process group timed out. Here that leader still meets the second
    barrier, its ranks then fail to find its registration (they raise), and all ranks learn from one
    ``all_gather_object`` whether any leader collided: then every rank releases what it opened and all try
    again, on the next free prefix. Any other failure is raised on every rank, in one line naming the rank, so
    no rank is left waiting at a collective the others never reach."""
    import torch.distributed as dist

    for attempt in range(attempts):
        dataset: Any = None
        error: BaseException | None = None
        collided = False
        with registration_lock(enabled=lock):
            dist.barrier()  # no rank scans for the prefix before this node's leader holds the lock
            try:
                dataset = factory()
            except FileExistsError as exc:
                if not (lock and _prefix_taken(exc)):
                    error = exc
                else:  # the ranks wait at streaming's second barrier: meet it, then all retry below
                    collided = True
                    dist.barrier()
            except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below
                error = exc
        outcomes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (collided, None if error is None else f"{type(error).__name__}: {error}"))
        if any(c for c, _ in outcomes) and attempt < attempts - 1:
            if dataset is not None:  # this node's leader did not collide: release its registration too
                release_streaming_dataset(dataset)
            logger.info("another job took streaming's shared-memory prefix meanwhile; registering again (%d/%d)",
                        attempt + 2, attempts)
            time.sleep(0.05 + 0.05 * attempt)
            continue
        if error is not None:
            raise error
        failed = [(rank, msg or "its shared-memory prefix stayed taken") for rank, (c, msg) in enumerate(outcomes)
                  if c or msg is not None]
        if failed:
            if dataset is not None:
                release_streaming_dataset(dataset)
            rank, msg = failed[0]
            raise RuntimeError(f"rank {rank} could not open its StreamingDataset ({msg}); every rank stops here")
        return _owned(dataset)
    raise AssertionError("unreachable")  # pragma: no cover
