"""Every rank of a job scans for streaming's shared-memory prefix on its own (streaming 0.13), so a non-leader
must not scan before its leader holds the registration lock: otherwise another job registering in between
makes the ranks pick different prefixes ("shared memory registered does not match local leader").

Deterministic: a holder process takes the lock, waits until rank 1 is about to open its dataset, registers a
dataset of its own at the first free prefix, and only then releases the lock to rank 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

from grape_stream.testing.mds import write_domain

HOLDER = """
import os, sys, time
from pathlib import Path
from streaming import StreamingDataset
from grape_stream.streaming_compat.registration import registration_lock
from grape_stream.streaming_compat.shm import release_streaming_dataset
tmp = Path(sys.argv[1])
with registration_lock(timeout=120):
    (tmp / "held").write_text("")
    while not (tmp / "ready-1").exists():
        time.sleep(0.05)
    time.sleep(2.0)  # rank 1 would scan now without the barrier (it found the prefix below free)
    ds = StreamingDataset(local=str(tmp / "other"), batch_size=1, shuffle=False)
    (tmp / "holder.json").write_text(str(ds._shm_prefix_int))
while not (tmp / "done").exists():
    time.sleep(0.05)
release_streaming_dataset(ds)
"""


def _rank(rank: int, tmp: str) -> None:
    import torch.distributed as dist
    from streaming import StreamingDataset

    from grape_stream.streaming_compat.registration import create_registered
    from grape_stream.streaming_compat.shm import release_streaming_dataset

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    out: dict = {}
    try:
        Path(tmp, f"ready-{rank}").write_text("")
        ds = create_registered(lambda: StreamingDataset(local=os.path.join(tmp, "mine"), batch_size=1,
                                                        shuffle=False), enabled=rank == 0)
        out = {"prefix": ds._shm_prefix_int, "samples": ds.num_samples}
        dist.barrier()
        release_streaming_dataset(ds)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def test_ranks_agree_on_the_prefix_when_another_job_registers_meanwhile(tmp_path: Path) -> None:
    write_domain(tmp_path / "mine", 0, 8)
    write_domain(tmp_path / "other", 1, 8)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "held").exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder did not take the lock"
            time.sleep(0.05)
        mp.spawn(_rank, args=(str(tmp_path),), nprocs=2, join=True)
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        assert all("error" not in r for r in ranks), ranks
        assert ranks[0]["prefix"] == ranks[1]["prefix"] and ranks[0]["samples"] == 8
        assert int((tmp_path / "holder.json").read_text()) != ranks[0]["prefix"]
    finally:
        (tmp_path / "done").write_text("")
        try:
            holder.wait(timeout=60)
        finally:
            holder.kill()
