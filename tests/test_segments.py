"""close_segment: a shared-memory segment's descriptor is closed even while a numpy view of it is alive."""

from __future__ import annotations

import os
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from grape_stream.streaming_compat.segments import close_segment


def test_a_segment_with_a_live_view_keeps_no_descriptor_and_the_view_stays_readable():
    seg = shared_memory.SharedMemory(create=True, size=64)
    try:
        view = np.frombuffer(seg.buf, dtype=np.int64)  # an export of the buffer (numpy keeps it)
        view[:] = np.arange(8)
        fd = seg._fd
        try:  # what streaming's own close meets: the view pins the buffer, and the descriptor stays open
            seg.close()
        except BufferError:
            pass
        assert os.fstat(fd)  # still open after the failed close
        close_segment(seg)
        assert seg._fd == -1
        try:
            os.fstat(fd)
            still_open = True
        except OSError:
            still_open = False
        assert not still_open
        assert view.tolist() == list(range(8))  # the mapping outlives the descriptor
        del view
    finally:
        try:
            shared_memory._posixshmem.shm_unlink(seg._name)  # type: ignore[attr-defined]
        except FileNotFoundError:
            pass
        resource_tracker.unregister(seg._name, "shared_memory")
