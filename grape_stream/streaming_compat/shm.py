"""Streaming's shared memory and file locks: registered safely, released on close, reclaimed after crashes.

Every mosaicml-streaming ``StreamingDataset`` registers machine-global POSIX shared memory named
``/dev/shm/<prefix:06>_<name>`` (the prefix is the first free number) and file locks
``/tmp/<prefix:06>_*_filelock``. Written for mosaicml-streaming >=0.12,<0.14 (the names below are
those releases'; 0.12.0 and 0.13.0 have the same shared-memory code); traps seen with streaming 0.13,
and what this module does:

* **Leaks after a crash.** A SIGKILL of the process group (Python's resource tracker included) leaves
  the segments; the next run fails with "Reused local directory" (same ``local`` and a remote) or walks
  to ever higher prefixes. ``streaming.base.util.clean_stale_shared_memory()`` stops at the first clean
  prefix, leaves the file locks, and unlinks segments without asking whether a live process uses them
  (it breaks a concurrent job on the same machine). :func:`cleanup_stale_streaming_shm` removes exactly
  what belongs to dead processes.
* **Liveness.** A prefix is alive while its owner lives. The mixer records the owner of each prefix it
  creates (:func:`record_owner`: pid, process start time and the segments' inode numbers, in
  ``/dev/shm/grape_stream_owner.<prefix>``). For other prefixes, a prefix is alive while any process
  maps or holds open one of its segments (read from ``/proc``).
* **Scanner attachments.** To pick a prefix, streaming attaches to every existing segment and keeps the
  mappings until the interpreter exits, so any process that merely *scanned* a dead job's leftovers
  keeps them looking alive. Owner records make such mappings irrelevant for the mixer's own prefixes,
  and :func:`detach_scanner_attachments` unmaps them in this process.
* **Leaks on normal close.** Streaming unlinks at exit only, never its file locks: :func:`release_streaming_dataset`.
* **Ending by name.** Prefix numbers are reused at once, so a name may belong to another job by the time
  it is unlinked: segments are ended by identity (:mod:`grape_stream.streaming_compat.segments`), and
  a sweep unlinks only the files it judged stale (same inode).
* **Racy registration** (two jobs picking one prefix) and the release at exit:
  :mod:`grape_stream.streaming_compat.registration`.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import tempfile
from typing import Any, NamedTuple

import numpy as np

from grape_stream.atomic import atomic_write_json
from grape_stream.streaming_compat.processes import (  # noqa: F401 - segments_in_use_elsewhere re-exported
    mapped_shm_names,
    process_alive,
    process_start_time,
    segments_in_use_elsewhere,
)
from grape_stream.streaming_compat.segments import close_segment, end_created_segment, unlink_if_unchanged
from grape_stream.streaming_compat.shm_lock import SHM_DIR, removal_lock

logger = logging.getLogger(__name__)

__all__ = [
    "SHM_NAMES",
    "cleanup_stale_streaming_shm",
    "describe_local_users",
    "detach_scanner_attachments",
    "live_streaming_datasets",
    "record_owner",
    "release_streaming_dataset",
    "segments_in_use_elsewhere",
]

#: Shared-memory names streaming 0.13 creates per dataset (streaming.base.constant), plus its file locks.
SHM_NAMES = (
    "locals", "barrier", "next_epoch", "cache_usage", "shard_states", "shard_access_times",
    "resume", "epoch_shape", "epoch_data",
)
FILELOCK_NAMES = ("barrier_filelock", "cache_filelock")
_SHM_RE = re.compile(r"^(\d{6})_(" + "|".join(SHM_NAMES) + r")$")
_LOCK_RE = re.compile(r"^(\d{6})_(" + "|".join(FILELOCK_NAMES) + r")$")
_OWNER_RE = re.compile(r"^grape_stream_owner\.(\d{6})(?:\.\d+)?$")  # .<uid> since per-user names


# --------------------------------------------------------------------------------------------------
# streaming objects in this process
# --------------------------------------------------------------------------------------------------
def live_streaming_datasets() -> list[Any]:
    """The StreamingDatasets alive in this process."""
    return _streaming_objects()[0]


def _streaming_objects() -> tuple[list[Any], list[Any]]:
    """Live StreamingDatasets and streaming SharedMemory objects of this process (via the gc)."""
    try:
        from streaming.base.dataset import StreamingDataset
        from streaming.base.shared.memory import SharedMemory
    except ImportError:  # pragma: no cover
        return [], []
    datasets, shms = [], []
    for obj in gc.get_objects():
        t = type(obj)  # not isinstance: that may trigger a module's deprecated-attribute hook
        if t is SharedMemory:
            shms.append(obj)
        elif issubclass(t, StreamingDataset):
            datasets.append(obj)
    return datasets, shms


def _dataset_shms(dataset: Any) -> list[Any]:
    """The streaming SharedMemory objects a StreamingDataset holds."""
    out = []
    for attr in ("_locals_shm", "_next_epoch", "_cache_usage", "_shard_states", "_shard_access_times",
                 "_shared_barrier", "_resume_shm"):
        obj = getattr(dataset, attr, None)
        for _ in range(3):  # SharedScalar -> SharedArray -> SharedMemory
            if obj is None or hasattr(obj, "created_shms"):
                break
            obj = getattr(obj, "shm", None) or getattr(obj, "arr", None) or getattr(obj, "_arr", None)
        if obj is not None and hasattr(obj, "created_shms"):
            out.append(obj)
    return out


def _holds_segments(dataset: Any) -> bool:
    """Whether a dataset still has its shared memory mapped (False once released)."""
    return any(o.created_shms or o.opened_shms for o in _dataset_shms(dataset))


def detach_scanner_attachments() -> int:
    """Unmap the other jobs' segments this process attached while streaming looked for a free prefix.

    Streaming's prefix registration attaches to every existing prefix's segments to compare local
    directories, and keeps them mapped until the interpreter exits (an ``atexit`` reference). Such a
    mapping makes a dead job's leftovers look alive to a mapping-based liveness check. Segments held by
    a live dataset of this process are kept. Returns the number of segments unmapped.
    """
    datasets, shms = _streaming_objects()
    keep = {id(o) for ds in datasets for o in _dataset_shms(ds)}
    n = 0
    for obj in shms:
        if id(obj) in keep or obj.created_shms or not obj.opened_shms:
            continue
        for seg in obj.opened_shms:
            close_segment(seg)
            n += 1
        obj.opened_shms.clear()
    return n


# --------------------------------------------------------------------------------------------------
# owner records
# --------------------------------------------------------------------------------------------------
def _owner_path(prefix: int, shm_dir: str = SHM_DIR) -> str:
    """Per user: a name another user planted (a shared /dev/shm) cannot block this user's record."""
    return os.path.join(shm_dir, f"grape_stream_owner.{prefix:06}.{os.geteuid()}")


def record_owner(dataset: Any, shm_dir: str = SHM_DIR) -> None:
    """Record that this process created ``dataset``'s segments (only if it did: the local leader)."""
    prefix = getattr(dataset, "_shm_prefix_int", None)
    locals_shm = getattr(dataset, "_locals_shm", None)
    if prefix is None or locals_shm is None or not locals_shm.created_shms:
        return
    inodes = {}
    for name in SHM_NAMES:
        path = os.path.join(shm_dir, f"{prefix:06}_{name}")
        try:
            inodes[name] = os.stat(path).st_ino
        except OSError:
            pass
    # Where its file locks live: a sweep in another TMPDIR then knows the locks it finds there are not this job's.
    record = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "inodes": inodes,
              "lock_root": os.path.realpath(_lock_root(dataset))}
    # /dev/shm is memory: nothing to make durable, but a half-written record must never be read.
    try:
        atomic_write_json(_owner_path(prefix, shm_dir), record, fsync=False)
    except OSError as exc:  # a full or foreign /dev/shm: the prefix is then judged by who maps it, as others are
        logger.warning("cannot record the owner of shared-memory prefix %06d (%s); stale-segment cleanup falls "
                       "back to process mappings for it", prefix, exc)


def _lock_root(dataset: Any) -> str:
    """The folder streaming keeps ``dataset``'s file locks in."""
    return getattr(dataset, "_filelock_root", None) or tempfile.gettempdir()


def _drop_owner_record(prefix: int, shm_dir: str = SHM_DIR) -> None:
    path = _owner_path(prefix, shm_dir)
    try:
        with open(path) as f:
            record = json.load(f)
        if record.get("pid") == os.getpid():
            os.unlink(path)
    except (OSError, ValueError):
        pass


# --------------------------------------------------------------------------------------------------
# cleanup
# --------------------------------------------------------------------------------------------------
def cleanup_stale_streaming_shm(*, shm_dir: str = SHM_DIR, lock_dir: str | None = None) -> dict[str, list[str]]:
    """Remove streaming shared memory and file locks that belong to no live process.

    For a prefix with an owner record, the segments whose inodes the record lists are stale exactly
    when the owner process is gone (whoever else still maps them). Any other segment is stale when no
    process maps or holds it open: a dataset keeps its segments mapped, and their descriptors open, for
    its whole life, and a segment's creator holds its descriptor from the instant the name exists, so
    a segment being created is never taken for a stale one (candidates are listed before the
    processes are inspected). In this process only the prefixes of live datasets count. Only entries
    of this user are touched; file locks of a prefix go only when no segment of it is alive, or when they
    are older than the prefix's live owner (an earlier holder's: see :func:`_lock_is_stale`). Safe to
    call on every rank at any time. Returns ``{"shm": [...], "locks": [...], "owners": [...]}``.
    """
    with removal_lock(shm_dir=shm_dir):  # a removal under another job's scans would split its ranks (shm_lock.py)
        return _cleanup_now(shm_dir, lock_dir or tempfile.gettempdir())


def _cleanup_now(shm_dir: str, lock_dir: str) -> dict[str, list[str]]:
    removed: dict[str, list[str]] = {"shm": [], "locks": [], "owners": []}
    real_lock_dir = os.path.realpath(lock_dir)
    shm = _listing(shm_dir, _SHM_RE)
    locks = _listing(lock_dir, _LOCK_RE)
    owners = _listing(shm_dir, _OWNER_RE)
    if not shm and not locks and not owners:
        return removed
    recorded = _read_owner_records(shm_dir, owners)
    live = _live_prefixes(shm_dir, shm, recorded)
    for name, prefix, inode in shm:  # by inode: a new job may have taken the name since the listing
        if prefix not in live and unlink_if_unchanged(os.path.join(shm_dir, name), inode):
            removed["shm"].append(name)
    for name, prefix, inode in locks:
        path = os.path.join(lock_dir, name)
        if _lock_is_stale(path, prefix, live, recorded, real_lock_dir) and unlink_if_unchanged(path, inode):
            removed["locks"].append(name)
    for name, prefix, inode in owners:
        if prefix in recorded and not recorded[prefix].alive:
            if unlink_if_unchanged(os.path.join(shm_dir, name), inode):
                removed["owners"].append(name)
    if any(removed.values()):
        logger.info("removed stale streaming state of dead processes: %s", removed)
    return removed


def _listing(directory: str, pattern: re.Pattern[str]) -> list[tuple[str, str, int]]:
    """(name, prefix, inode) of this user's entries of ``directory`` that match ``pattern``."""
    uid = os.geteuid()
    out: list[tuple[str, str, int]] = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return out
    for name in entries:
        m = pattern.match(name)
        if not m:
            continue
        try:
            st = os.stat(os.path.join(directory, name))
        except OSError:
            continue
        if st.st_uid == uid:
            out.append((name, m.group(1), st.st_ino))
    return out


class _Record(NamedTuple):
    """An owner record as read: is the owner alive, the inodes it created, when it registered them (the
    record's mtime), and the real path of its file locks' folder (None in records written before it was kept)."""

    alive: bool
    inodes: set[int]
    registered: float
    lock_root: str | None


def _read_owner_records(shm_dir: str, owners: list[tuple[str, str, int]]) -> dict[str, _Record]:
    """Owner records: prefix -> :class:`_Record` (unreadable records are skipped)."""
    recorded: dict[str, _Record] = {}
    for name, prefix, _ in owners:
        try:
            path = os.path.join(shm_dir, name)
            with open(path) as f:
                rec = json.load(f)
            alive = process_alive(int(rec["pid"]), rec.get("start_time"))
            root = rec.get("lock_root")
            recorded[prefix] = _Record(alive, set(rec.get("inodes", {}).values()), os.stat(path).st_mtime,
                                       root if isinstance(root, str) else None)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return recorded


def _lock_is_stale(path: str, prefix: str, live: set[str], recorded: dict[str, _Record], real_lock_dir: str
                   ) -> bool:
    """A lock file is stale when no live process uses its prefix; or when the prefix's live owner keeps its
    locks in another folder; or when the lock is older than that owner (its record is written as it
    registers the segments; its own locks come later). The last two are a lock left by an earlier holder
    of the number, seen with a per-job TMPDIR beside a shared /dev/shm: another job swept the dead job's
    segments, not its locks, and took the number. The folder rule holds however soon after the earlier
    holder's death the number was taken (a killed job's cache lock is touched up to its last moment)."""
    if prefix not in live:
        return True
    owner = recorded.get(prefix)
    if owner is None or not owner.alive:
        return False  # a live user without a record (plain streaming, or registering now): its lock, maybe
    if owner.lock_root is not None and owner.lock_root != real_lock_dir:
        return True
    try:
        return os.stat(path).st_mtime < owner.registered - 1.0
    except OSError:
        return False


def _live_prefixes(shm_dir: str, shm: list[tuple[str, str, int]], recorded: dict[str, _Record]) -> set[str]:
    """Prefixes some live process still uses (see :func:`cleanup_stale_streaming_shm` for the rules)."""
    me = os.getpid()
    mapped = mapped_shm_names()
    live: set[str] = set()  # prefixes with a live user
    own_only: set[str] = set()
    shm_inodes = {name: ino for name, _, ino in shm}
    for name, pids in mapped.items():
        m = _SHM_RE.match(name)
        if not m:
            continue
        prefix = m.group(1)
        rec = recorded.get(prefix)
        if rec is not None and shm_inodes.get(name) in rec.inodes:
            continue  # judged by its owner record below
        if pids - {me}:
            live.add(prefix)
        else:
            own_only.add(prefix)
    live |= {prefix for prefix, rec in recorded.items() if rec.alive}
    if own_only - live:
        datasets, _ = _streaming_objects()
        mine = {f"{int(ds._shm_prefix_int):06}" for ds in datasets
                if hasattr(ds, "_shm_prefix_int") and _holds_segments(ds)}
        live |= own_only & mine
    # Segments of other users keep their prefix alive.
    try:
        for name in os.listdir(shm_dir):
            m = _SHM_RE.match(name)
            if m and name not in shm_inodes:
                live.add(m.group(1))
    except OSError:
        pass
    return live


def release_streaming_dataset(dataset: Any) -> None:
    """Unlink the shared memory a StreamingDataset created and delete its file locks, now.

    Streaming only does this at interpreter exit (and never for the locks). Call it once the dataset,
    its download threads and every DataLoader worker that used it are done. Safe to call twice. A segment
    whose name another job holds by now (ours was removed behind our back) is left to that job.
    """
    with removal_lock():  # no job's ranks may scan the names while they change (see shm_lock.py)
        _release_now(dataset)


def _release_now(dataset: Any) -> None:
    shms = _dataset_shms(dataset)
    locals_shm = getattr(dataset, "_locals_shm", None)
    if locals_shm is not None:
        try:
            locals_shm.buf[:4] = np.int32(0).tobytes()
        except Exception:
            pass
    for obj in shms:
        created, opened = list(obj.created_shms), list(obj.opened_shms)
        obj.created_shms.clear()  # streaming's atexit cleanup then has nothing left to do
        obj.opened_shms.clear()
        for seg in opened:
            close_segment(seg)
        for seg in created:
            end_created_segment(seg)  # unlinked only if the name is still this segment's (see segments.py)
    prefix = getattr(dataset, "_shm_prefix_int", None)
    root = _lock_root(dataset)
    if prefix is not None:
        _drop_owner_record(prefix)
        for lock in FILELOCK_NAMES:
            try:
                os.unlink(os.path.join(root, f"{prefix:06}_{lock}"))
            except OSError:
                pass


def describe_local_users(local: str) -> str:
    """Which shared-memory prefix registers ``local`` and which processes map it (for error messages)."""
    local = os.path.abspath(local)
    mapped = mapped_shm_names()
    found = []
    try:
        names = sorted(n for n in os.listdir(SHM_DIR) if n.endswith("_locals") and _SHM_RE.match(n))
    except OSError:
        return "unknown owner"
    for name in names:
        try:
            with open(os.path.join(SHM_DIR, name), "rb") as f:
                data = f.read()
        except OSError:
            continue
        if local in data[4:].decode("utf-8", "replace").split("\0"):
            pids = sorted(mapped.get(name, set()))
            found.append(f"prefix {name[:6]} mapped by pid(s) {pids}" if pids else f"prefix {name[:6]}, unmapped")
    if not found:
        return "unknown owner"
    return "; ".join(found) + (
        ". A crashed job's leftovers stay registered while a process that once scanned them is alive; "
        "restart such processes or use another local directory")
