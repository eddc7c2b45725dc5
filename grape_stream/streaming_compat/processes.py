"""Which processes are alive and which /dev/shm segments they map: the liveness facts of shm cleanup.

Streaming 0.12 / 0.13 (>=0.12,<0.14) judges nothing about liveness itself (its ``clean_stale_shared_memory``
unlinks whatever it finds), so :mod:`grape_stream.streaming_compat.shm` decides from these facts, read
from ``/proc`` (Linux): a process is identified by pid *and* start time, so a reused pid is not taken
for the process that wrote an owner record.
"""

from __future__ import annotations

import os

__all__ = ["flock_holder", "mapped_shm_names", "process_alive", "process_start_time", "segments_in_use_elsewhere"]


def process_start_time(pid: int) -> int | None:
    """Start time of a process (clock ticks since boot), None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])  # field 22 of stat; fields[0] is field 3
    except (IndexError, ValueError):  # pragma: no cover
        return None


def process_alive(pid: int, start_time: int | None) -> bool:
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def mapped_shm_names() -> dict[str, set[int]]:
    """Basenames under /dev/shm that processes we can inspect map or hold open, with their pids."""
    names: dict[str, set[int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        ipid = int(pid)
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    i = line.find(b"/dev/shm/")
                    if i >= 0:
                        name = line[i + 9:].split(b" ")[0].strip().decode("utf-8", "replace")
                        names.setdefault(name, set()).add(ipid)
        except OSError:
            pass
        # An open descriptor without a mapping (between shm_open and mmap) also counts.
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                names.setdefault(target[9:].split(" ")[0], set()).add(ipid)
    return names


def segments_in_use_elsewhere() -> set[str]:
    """/dev/shm names that some *other* process maps or holds open right now."""
    me = os.getpid()
    return {name for name, pids in mapped_shm_names().items() if pids - {me}}


def flock_holder(fd: int) -> str:
    """' (held by pid N)' for the flock on ``fd``'s file, from /proc/locks (Linux), else ''."""
    try:
        st = os.fstat(fd)
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == key:
                    return f" (held by pid {parts[4]}: a hung job? kill it, or give jobs separate TMPDIRs)"
    except (OSError, ValueError):
        pass
    return ""
