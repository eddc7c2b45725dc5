"""The mixer leaves no shared memory or lock files behind: after close, after exit, after a SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from _mds_fixtures import write_domains
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from grape_stream.streaming_compat.shm import cleanup_stale_streaming_shm, segments_in_use_elsewhere

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("mdss"), [60, 40], samples_per_shard=10)


def segments(prefixes) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n[:6].isdigit() and int(n[:6]) in prefixes}


def inodes(names) -> set[int]:
    """The segments' identities: /dev/shm is machine-wide, and once a dead job's prefix is reclaimed another
    streaming job on the machine may register the same prefix number; its segments are new files."""
    out = set()
    for n in names:
        try:
            out.add(os.stat(f"/dev/shm/{n}").st_ino)
        except FileNotFoundError:
            pass
    return out


def locks(prefixes) -> set[str]:
    tmp = tempfile.gettempdir()
    return {n for n in os.listdir(tmp) if n[:6].isdigit() and n.endswith("_filelock") and int(n[:6]) in prefixes}


def foreign(names: set[str]) -> set[str]:
    """Names that some other live process uses now (the prefix was reused by a concurrent job)."""
    return names & segments_in_use_elsewhere()


def test_close_releases_shared_memory_and_locks(dirs):
    m = WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(dirs)], batch_size=8)
    prefixes = m.shm_prefixes
    assert len(segments(prefixes)) >= 6 * len(dirs)
    for _, _b in zip(range(12), m.dataloader(num_workers=2)):  # decompresses shards: creates the cache locks
        pass
    assert locks(prefixes)
    m.close()
    assert segments(prefixes) - foreign(segments(prefixes)) == set()
    assert locks(prefixes) == set() or all(p[:6] in {s[:6] for s in foreign(segments(prefixes))}
                                           for p in locks(prefixes))
    with pytest.raises(RuntimeError, match="closed"):
        iter(m)


def _start(cfg: dict, path: Path) -> subprocess.Popen:
    path.write_text(json.dumps(cfg))
    return subprocess.Popen([sys.executable, str(HERE / "_mixer_run.py"), str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.timeout(180)
def test_exit_without_close_leaves_nothing(dirs, tmp_path):
    proc = _start({"dirs": dirs, "seed": 0, "batch_size": 8, "workers": 2, "batches": 15}, tmp_path / "c.json")
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err
    prefixes = json.loads(out.splitlines()[0])["prefixes"]
    time.sleep(0.2)
    assert segments(prefixes) - foreign(segments(prefixes)) == set()
    assert not locks(prefixes) - {n for n in locks(prefixes) if n[:6] in {s[:6] for s in segments_in_use_elsewhere()}}


@pytest.mark.timeout(180)
def test_sigkill_leak_is_cleaned_only_when_its_owner_is_dead(dirs, tmp_path):
    caches = [str(tmp_path / f"cache{k}") for k in range(len(dirs))]
    proc = _start({"dirs": dirs, "caches": caches, "seed": 0, "batch_size": 8, "workers": 0, "hold": True},
                  tmp_path / "hold.json")
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        prefixes = json.loads(line)["prefixes"]
        held = segments(prefixes)
        assert len(held) >= 6 * len(dirs)
        # A live owner's segments are never touched, however old.
        cleanup_stale_streaming_shm()
        assert segments(prefixes) == held
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # main process and its resource tracker: nothing cleans up
        proc.wait()
    leaked = segments(prefixes)
    assert leaked == held  # the trap: the segments outlive their process
    leaked_inodes = inodes(leaked)
    dead_pid = proc.pid

    # Another live process now tries streaming directly: it is refused the directory (the trap), and its
    # scan leaves the dead job's segments mapped in it, which a mapping-based liveness check would take
    # for a live user.
    scanner = subprocess.Popen([sys.executable, "-c", SCANNER, dirs[0], caches[0]],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        report = json.loads(scanner.stdout.readline() or "{}")
        assert report.get("trap") in ("reused", "cleaned-meanwhile"), scanner.stderr.read()
        if report["trap"] == "reused":
            assert segments(prefixes) & segments_in_use_elsewhere()  # held by the scanner
        # The mixer knows the dead job's owner (its owner record) and reclaims everything it left.
        with WeightedStreamingMixer([DomainStream(f"d{k}", remote=d, local=c)
                                     for k, (d, c) in enumerate(zip(dirs, caches))], batch_size=8) as m:
            batch = next(iter(m.dataloader()))
            assert batch["tokens"].shape == (8, 16)
            mine = set(m.shm_prefixes)
            stale = inodes(n for n in segments(prefixes) if int(n[:6]) not in mine) & leaked_inodes
            assert stale == set()  # every segment the dead job left is gone (a reused prefix is another job's)
            dead_records = []
            for p in prefixes:
                try:
                    with open(f"/dev/shm/grape_stream_owner.{p:06}.{os.geteuid()}") as f:
                        dead_records += [p] if json.load(f).get("pid") == dead_pid else []
                except (FileNotFoundError, ValueError):
                    pass
            assert dead_records == []  # and so are its owner records
    finally:
        os.killpg(scanner.pid, signal.SIGKILL)
        scanner.wait()


SCANNER = """
import json, os, sys, time
from streaming import StreamingDataset
remote, local = sys.argv[1:3]
try:
    ds = StreamingDataset(remote=remote, local=local, batch_size=8)
    del ds  # unregisters the directory (streaming's __del__)
    trap = "cleaned-meanwhile"
except ValueError as exc:
    trap = "reused" if "Reused local directory" in str(exc) else repr(exc)
print(json.dumps({"trap": trap}), flush=True)
time.sleep(3600)
"""


# -------------------------------------------------------------------------------------------------------
# Segments removed behind a job's back: the resource_tracker warnings at exit, and what caused them
# -------------------------------------------------------------------------------------------------------
_HOLDER = """
import json, sys
from grape_stream.grape.tasks import TaskStream
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
dirs, close = json.loads(sys.argv[1]), sys.argv[2] == "close"
m = WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(dirs)], batch_size=8)
t = TaskStream("t", local=dirs[0], split=None, test_split=None)
print(json.dumps(m.shm_prefixes + [int(t.dataset()._shm_prefix_int)]), flush=True)
sys.stdin.readline()
if close:
    m.close()
    t.close()
"""
_NAMES = ("locals", "barrier", "next_epoch", "cache_usage", "shard_states", "shard_access_times")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["close", "exit"])
def test_segments_removed_behind_a_jobs_back_neither_warn_nor_take_another_jobs(dirs, how):
    """Prefix numbers are reused at once on a busy machine: a job's segment removed by someone else (a
    sweep, or another job's resource tracker at its exit) and its name taken by the next job. Ending the
    first job must not unlink the newcomer's segment by name, and must not leave its resource tracker
    holding names (the "No such file or directory: '/000021_locals'" warnings at exit: the trackers of a
    process that trained 12 times beside other jobs)."""
    from multiprocessing.shared_memory import SharedMemory

    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, json.dumps(dirs), how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    newcomers = []
    try:
        gone, *taken = json.loads(proc.stdout.readline())
        for name in _NAMES:  # removed behind its back ...
            os.unlink(f"/dev/shm/{gone:06}_{name}")
        for p in taken:  # ... and removed, then the name taken by another job
            for name in _NAMES:
                os.unlink(f"/dev/shm/{p:06}_{name}")
                newcomers.append(SharedMemory(f"{p:06}_{name}", create=True, size=64))
        out, err = proc.communicate("go\n", timeout=90)
        assert proc.returncode == 0, err
        assert "resource_tracker" not in err and "leaked" not in err, err
        alive = [s.name for s in newcomers if os.path.exists(f"/dev/shm/{s.name}")]
        assert len(alive) == len(newcomers), "the other job's segments were unlinked by name"
    finally:
        proc.kill()
        for s in newcomers:
            s.close()
            try:
                s.unlink()
            except FileNotFoundError:
                pass


@pytest.mark.timeout(120)
def test_a_lock_left_by_an_earlier_holder_of_a_prefix_is_swept(dirs, tmp_path):
    """A job with its own TMPDIR beside a shared /dev/shm: its locks outlive its (swept) segments, and another
    job takes the prefix number. Such a lock is older than the prefix's live owner: it goes."""
    locks_dir = tmp_path / "jobtmp"
    locks_dir.mkdir()
    for p in range(300):  # the dead job's locks, for whatever number the next job takes
        (locks_dir / f"{p:06}_cache_filelock").write_text("")
    time.sleep(1.5)  # the next job starts strictly later than these locks
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, json.dumps(dirs), "close"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        prefixes = json.loads(proc.stdout.readline())[:-1]  # the mixer's (owner-recorded) prefixes
        removed = cleanup_stale_streaming_shm(lock_dir=str(locks_dir))["locks"]
        assert {f"{p:06}_cache_filelock" for p in prefixes} <= set(removed)
        proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()


@pytest.mark.timeout(120)
def test_a_lock_touched_just_before_its_holder_died_is_swept_when_the_number_moved_to_another_tmpdir(dirs, tmp_path):
    """As above, but with no time between them: a killed job's cache lock is touched up to its last moment,
    and on a busy machine another job (its own TMPDIR) takes the number within the second (the soak's
    resumed job then found the killed job's two locks still there: "temp files before / after 0 / 2").
    The live owner's record names where its locks are, so a lock elsewhere is not its; its own stay."""
    locks_dir, holder_tmp = tmp_path / "jobtmp", tmp_path / "holder_tmp"
    for d in (locks_dir, holder_tmp):
        d.mkdir()
    for p in range(300):
        (locks_dir / f"{p:06}_cache_filelock").write_text("")
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, json.dumps(dirs), "close"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, TMPDIR=str(holder_tmp)))
    try:
        prefixes = json.loads(proc.stdout.readline())[:-1]
        names = {f"{p:06}_cache_filelock" for p in prefixes}
        assert names  # the holder's mixer recorded owned prefixes: the checks below are about something
        for name in names:  # touched now: no older than the new owner's record
            (locks_dir / name).touch()
            (holder_tmp / name).touch()
        assert names <= set(cleanup_stale_streaming_shm(lock_dir=str(locks_dir))["locks"])
        assert not names & set(cleanup_stale_streaming_shm(lock_dir=str(holder_tmp))["locks"])
        assert all((holder_tmp / name).exists() for name in names)
        proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()
