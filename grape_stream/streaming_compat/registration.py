"""Registering streaming's shared memory: one process of the machine at a time, released at exit safely.

* **Racy registration.** Two jobs that start at once can pick the same prefix (streaming 0.12 / 0.13
  scan /dev/shm, then create, with no lock) and share each other's shard states: :func:`registration_lock`
  serialises registration among this user's jobs on this machine with an ``flock`` on a per-user file
  beside the segments it protects (``/dev/shm/grape_stream_registration.<uid>.lock``), so jobs with
  different ``TMPDIR``s (test workers, schedulers that give each job its own) still exclude each other.
  Every rank of a job scans for the prefix on its own (streaming 0.13 ``get_shm_prefix``), so the non-leader
  ranks must scan while their leader holds the lock too, or another job's registration between their scan
  and the leader's makes them disagree ("shared memory registered does not match local leader"):
  :func:`create_registered` puts a barrier after the leader has the lock and before any rank scans. Removals
  (a job closing its datasets, a sweep of a dead job's) would change the names under the scans just as well:
  they take the same lock (:mod:`grape_stream.streaming_compat.shm_lock`), so the leader takes it only after a
  first barrier, when none of its own ranks can be waiting in a removal for it.
  A job that does not take the lock (plain streaming, another user) can still take the prefix between
  the scan and the create: :func:`create_registered` retries then (one process only: see there).
* **Unlinking by name at exit.** A dataset this process created and never released (a task's splits,
  a mixer not closed) would be unlinked by name at exit by streaming's own hook, whatever the name holds
  by then; :func:`create_registered` arranges for grape_stream's release (by identity, see
  :mod:`grape_stream.streaming_compat.segments`) to run first, in the creating process only.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import time
from typing import Any, Callable, TypeVar

from grape_stream.streaming_compat.shm import (
    live_streaming_datasets,
    record_owner,
    release_streaming_dataset,
)
from grape_stream.streaming_compat.shm_lock import registration_lock
from grape_stream.world import dist_active

__all__ = ["create_registered", "registration_lock"]

T = TypeVar("T")
_CREATOR = "_grape_stream_creator_pid"
logger = logging.getLogger(__name__)


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


def create_registered(factory: Callable[[], T], *, enabled: bool = True, attempts: int = 20) -> T:
    """``factory()`` (a StreamingDataset constructor) under :func:`registration_lock`, retried when the
    shared-memory prefix streaming chose was taken meanwhile by a job that does not take our lock (a plain
    streaming job, another library): streaming 0.13 then raises ``FileExistsError: '/NNNNNN_locals'``
    before it registered anything, so trying again after a short random pause picks the next prefix.
    ``enabled``: this process is its node's leader (the other ranks wait at the barrier); without a process group
    every process takes the lock."""
    # Without a process group no barrier orders this process after a leader: it registers on its own (a single
    # process, or ranks simulated in one process, as an elastic resume's planning does), so it takes the lock.
    ranks = dist_active()
    barrier = _barrier if ranks else _no_barrier
    lock = enabled or not ranks
    for attempt in range(attempts):
        try:
            barrier()  # every rank is here, so none waits in a removal_lock for its own leader's lock
            with registration_lock(enabled=lock):
                barrier()  # no rank scans for the prefix before this node's leader holds the lock
                dataset = factory()
            record_owner(dataset)  # every dataset's segments are judged by their owner, not by who maps them
            _release_before_streaming_at_exit(dataset)
            return dataset
        except FileExistsError as exc:
            if "_locals" not in str(exc) or attempt == attempts - 1 or ranks:
                raise  # (several ranks: only the leader saw it, the others wait inside streaming's barriers)
            time.sleep(random.uniform(0.05, 0.25))
    raise AssertionError("unreachable")  # pragma: no cover


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _no_barrier() -> None:
    pass
