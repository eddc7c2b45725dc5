"""The machine-wide registration lock: it lives beside the shared memory it protects (so jobs with different
TMPDIRs on one machine exclude each other), a job stuck while holding it costs the next job a bounded wait and
one line that names the holder, and a lock file another user planted is not used."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from grape_stream.streaming_compat.registration import registration_lock

HOLD = """
import fcntl, os, sys, tempfile, time
from grape_stream.streaming_compat.shm_lock import _open_lock_file
if sys.argv[1] == "mine":
    fd = _open_lock_file(sys.argv[2])
else:
    fd = os.open(tempfile.gettempdir(), os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def _hold(tmp_dir, what: str, shm_dir) -> subprocess.Popen:
    env = {"TMPDIR": str(tmp_dir), "PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, what, str(shm_dir)], stdout=subprocess.PIPE,
                              text=True, env=env)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """A private 'shm' folder and this test's own TMPDIR: no other job on the machine is touched."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return shm, tmp


def test_a_stuck_holder_is_named_after_the_timeout(dirs):
    shm, tmp = dirs
    holder = _hold(tmp, "mine", shm)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            with registration_lock(timeout=0.5, shm_dir=str(shm)):
                pass
        assert time.monotonic() - t0 < 10
        assert f"held by pid {holder.pid}" in str(err.value)
    finally:
        holder.kill()
        holder.wait()
    with registration_lock(timeout=5, shm_dir=str(shm)):  # released with its holder's death
        pass


def test_jobs_with_different_tmpdirs_exclude_each_other(dirs, tmp_path):
    """The shared-memory names are per machine, so the lock is too: a job with another TMPDIR (another xdist
    worker, a scheduler's per-job folder) holding it makes this one wait."""
    shm, _ = dirs
    other_tmp = tmp_path / "other-job-tmp"
    other_tmp.mkdir()
    holder = _hold(other_tmp, "mine", shm)
    try:
        with pytest.raises(TimeoutError):
            with registration_lock(timeout=0.3, shm_dir=str(shm)):
                pass
    finally:
        holder.kill()
        holder.wait()
    assert [p.name for p in shm.iterdir()] == [f"grape_stream_registration.{os.geteuid()}.lock"]


def test_a_lock_on_the_temp_dir_itself_blocks_no_one(dirs):
    """Any user can flock $TMPDIR; the registration lock is this user's own file, so that holds up nothing."""
    shm, tmp = dirs
    holder = _hold(tmp, "tmpdir", shm)
    try:
        with registration_lock(timeout=0.5, shm_dir=str(shm)):
            pass
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file owned by another user needs root")
def test_a_lock_file_another_user_planted_is_not_used(dirs, caplog):
    """In a shared /dev/shm another user could create this user's lock name first and hold it: such a file
    is refused (with one warning) and the per-user temp folder's lock serves instead."""
    shm, tmp = dirs
    planted = shm / f"grape_stream_registration.{os.geteuid()}.lock"
    planted.write_text("")
    os.chmod(planted, 0o666)
    os.chown(planted, 65534, 65534)
    import fcntl
    fd = os.open(planted, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the planter holds it
    try:
        with caplog.at_level(logging.WARNING, logger="grape_stream.streaming_compat.shm_lock"):
            with registration_lock(timeout=0.5, shm_dir=str(shm)):
                pass
        assert "owned by uid 65534" in caplog.text
        assert (tmp / f"grape_stream-{os.getuid()}" / "registration.lock").exists()
    finally:
        os.close(fd)


def test_a_symlink_in_place_of_the_lock_is_not_followed(dirs, tmp_path):
    shm, tmp = dirs
    target = tmp_path / "victim"
    target.write_text("keep")
    (shm / f"grape_stream_registration.{os.geteuid()}.lock").symlink_to(target)
    with registration_lock(timeout=0.5, shm_dir=str(shm)):
        pass
    assert target.read_text() == "keep"
    assert (tmp / f"grape_stream-{os.getuid()}" / "registration.lock").exists()


def test_a_process_without_a_process_group_takes_the_lock_whatever_its_rank(monkeypatch):
    """Ranks simulated in one process (a non-zero local rank, no torch.distributed) register on their own: they
    must hold the lock, or they race a real job's leader for a prefix (seen: "shared memory registered does not
    match local leader" in a 2-rank job beside an in-process 8-rank simulation)."""
    from grape_stream.streaming_compat import registration

    taken: list[bool] = []
    real = registration.registration_lock

    def spy(enabled: bool = True, **kw):  # type: ignore[no-untyped-def]
        taken.append(enabled)
        return real(enabled=enabled, **kw)

    monkeypatch.setattr(registration, "registration_lock", spy)
    assert registration.create_registered(lambda: "dataset", enabled=False) == "dataset"
    assert taken == [True]


def test_a_removal_waits_for_a_registration_in_progress(dirs):
    """Every rank of a job scans /dev/shm for its prefix on its own; a stale segment swept away between the
    leader's scan and a follower's made them disagree ("prefix=64 was not registered by local leader"). So a
    sweep, like a registration, waits for the lock: the stale name is still there while the lock is held, and
    gone once its holder ends."""
    from grape_stream.streaming_compat.shm import cleanup_stale_streaming_shm

    shm, tmp = dirs
    stale = shm / "999999_locals"  # a dead job's segment (liveness is by name: a number no live job has)
    stale.write_bytes(b"\0" * 64)
    holder = _hold(tmp, "mine", shm)
    sweep = threading.Thread(target=cleanup_stale_streaming_shm, kwargs={"shm_dir": str(shm), "lock_dir": str(tmp)})
    try:
        sweep.start()
        sweep.join(timeout=1.0)
        assert sweep.is_alive() and stale.exists(), "the sweep removed a name while a registration held the lock"
    finally:
        holder.kill()
        holder.wait()
    sweep.join(timeout=30)
    assert not sweep.is_alive() and not stale.exists()


def test_a_stuck_holder_costs_a_removal_a_bounded_wait(dirs, caplog):
    """A removal that cannot get the lock goes ahead after its timeout (a leak is worse than the race), with
    one warning that names the holder."""
    from grape_stream.streaming_compat.shm_lock import removal_lock

    shm, tmp = dirs
    holder = _hold(tmp, "mine", shm)
    try:
        with caplog.at_level(logging.WARNING, logger="grape_stream.streaming_compat.shm_lock"):
            t0 = time.monotonic()
            with removal_lock(timeout=0.3, shm_dir=str(shm)):
                waited = time.monotonic() - t0
        assert 0.3 <= waited < 10
        assert f"held by pid {holder.pid}" in caplog.text
    finally:
        holder.kill()
        holder.wait()


def test_a_process_holding_the_lock_removes_without_waiting_for_itself(dirs):
    """flock on a second descriptor of the same process would wait for the first: a release inside a
    registration (an error path) must not deadlock."""
    from grape_stream.streaming_compat.shm_lock import removal_lock

    shm, _ = dirs
    with registration_lock(timeout=0.5, shm_dir=str(shm)):
        t0 = time.monotonic()
        with removal_lock(timeout=5, shm_dir=str(shm)):
            pass
        assert time.monotonic() - t0 < 1
    with removal_lock(timeout=0.5, shm_dir=str(shm)):  # and the lock is free afterwards
        pass
