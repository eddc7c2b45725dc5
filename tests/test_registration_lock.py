"""The machine-wide registration lock: a job stuck while holding it costs the next job a bounded wait and
one line that names the holder, not a silent hang."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import pytest

from grape_stream.streaming_compat.registration import registration_lock

HOLD = """
import fcntl, os, sys, tempfile, time
fd = os.open(tempfile.gettempdir(), os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_a_stuck_holder_is_named_after_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a private temp dir: no other job on the machine is touched
    monkeypatch.setattr(tempfile, "tempdir", None)
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True,
                              env={"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            with registration_lock(timeout=0.5):
                pass
        assert time.monotonic() - t0 < 10
        assert f"held by pid {holder.pid}" in str(err.value)
    finally:
        holder.kill()
        holder.wait()
    with registration_lock(timeout=5):  # released with its holder's death
        pass
