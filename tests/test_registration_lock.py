"""The machine-wide registration lock: a job stuck while holding it costs the next job a bounded wait and
one line that names the holder, not a silent hang."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from grape_stream.streaming_compat.registration import registration_lock

HOLD = """
import fcntl, os, sys, tempfile, time
from grape_stream.user_dir import user_temp_dir
if sys.argv[1] == "mine":
    fd = os.open(os.path.join(user_temp_dir(), "registration.lock"), os.O_RDWR | os.O_CREAT, 0o600)
else:
    fd = os.open(tempfile.gettempdir(), os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def _hold(tmp_path, what: str) -> subprocess.Popen:
    env = {"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, what], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_stuck_holder_is_named_after_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a private temp dir: no other job on the machine is touched
    monkeypatch.setattr(tempfile, "tempdir", None)
    holder = _hold(tmp_path, "mine")
    try:
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


def test_a_lock_on_the_temp_dir_itself_blocks_no_one(tmp_path, monkeypatch):
    """Any user can flock $TMPDIR; the registration lock is this user's own file, so that holds up nothing."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    holder = _hold(tmp_path, "tmpdir")
    try:
        with registration_lock(timeout=0.5):
            pass
    finally:
        holder.kill()
        holder.wait()
