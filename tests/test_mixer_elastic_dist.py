"""Elastic resume with real processes: a torch.distributed (gloo) job on 4 ranks is SIGKILLed mid-run, resumes
on 2 ranks reading the same domains from S3 (moto_server behind the fault-injecting proxy: errors, resets,
latency), is SIGKILLed again, and finishes on 1 rank; every global batch any rank ever read is the
uninterrupted run's, and the batches the surviving checkpoints cover are exactly that run's, nothing
repeated or skipped. (A checkpoint names its domains and their sizes, not where they are read from.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import _warm
from _mds_fixtures import identity, write_domains
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from test_mixer_s3 import upload

HERE = Path(__file__).resolve().parent
SIZES = [60, 44, 36, 52, 28]
G = 24  # 4 ranks x 6, 2 x 12, 1 x 24
LAG = 4
N = 30
ALPHAS = np.random.default_rng(8).dirichlet(np.ones(len(SIZES)), size=3).tolist()
CHANGES = {5: ALPHAS[0], 11: ALPHAS[1], 19: ALPHAS[2]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("mdsed"), SIZES, samples_per_shard=8)


def _reference(dirs) -> list[list]:
    """The uninterrupted run on one rank, whole global batches, no workers: rows per global batch."""
    with WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(dirs)], batch_size=G,
                                seed=13, lag=LAG) as m:
        out = []
        for batch in m.dataloader():
            out.append([[*identity({"tokens": t}), int(e), int(v)] for t, e, v in
                        zip(np.asarray(batch["tokens"]), batch["epoch"].tolist(), batch["weights_version"].tolist())])
            if m.consumed_batches in CHANGES:
                m.set_weights(CHANGES[m.consumed_batches])
            if m.consumed_batches == N:
                return out
    raise AssertionError("the reference ended early")



def _run_warm(cfg: dict, world: int, tmp: Path, name: str) -> int:
    """``world`` ranks of _elastic_run.py forked from the worker's warm server (tests/_warm.py), as torchrun would
    start them; the launch's exit status (-9 when rank 0 SIGKILLed itself at ``kill_at``: the others go with it)."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = _warm.run(str(HERE / "_elastic_run.py"), str(path), cwd=str(tmp), env=env, timeout=300, ranks=world)
    assert proc.returncode in (0, -9), proc.stderr[-3000:]
    return proc.returncode


def _logged(log: Path) -> list[dict]:
    out = []
    for f in sorted(log.glob("rank*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def _kill_when(procs, log: Path, batches: int, timeout: float = 180) -> None:
    """SIGKILL every rank (and its DataLoader workers) once rank 0 has logged ``batches`` batches."""
    deadline = time.time() + timeout
    while sum(1 for r in _logged(log) if r["rank"] == 0) < batches:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a rank ended early: {p.stderr.read().decode()[-3000:]}")
        assert time.time() < deadline, "the job made no progress"
        time.sleep(0.1)
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def _phase_rows(log: Path, world: int) -> dict[int, dict[int, list]]:
    """{global batch: {rank: rows}} of one job."""
    out: dict[int, dict[int, list]] = {}
    for r in _logged(log):
        assert r["rank"] < world
        out.setdefault(r["batch"], {})[r["rank"]] = r["rows"]
    return out


@pytest.mark.timeout(900)
def test_gloo_4_ranks_killed_resume_on_2_from_s3_killed_resume_on_1(data, tmp_path, fault_proxy, s3_bucket):
    reference = _reference(data)
    remotes = [upload(fault_proxy.url, s3_bucket, d, f"el/d{k}") for k, d in enumerate(data)]
    caches = [str(tmp_path / f"cache{k}") for k in range(len(data))]  # one node: its ranks share a cache
    fault_proxy.set_faults(error_rate=0.1, reset_rate=0.05, latency=0.002)
    base = {"seed": 13, "global_batch_size": G, "lag": LAG, "every": 4,
            "changes": {str(k): v for k, v in CHANGES.items()}, "state": str(tmp_path / "state.json")}
    logs = [tmp_path / f"log{i}" for i in range(3)]
    for d in logs:
        d.mkdir()
    # 4 ranks x 1 worker, local shards: killed mid-run (rank 0 at its 10th batch, after its checkpoint of batch 8)
    assert _run_warm({**base, "dirs": data, "workers": 1, "until": N, "hold_after": 14, "kill_at": 10,
                      "log": str(logs[0])}, 4, tmp_path, "a") == -9
    first = json.loads((tmp_path / "state.json").read_text())
    assert first["batch"] in (8, 12) and first["written_by"] == {"world_size": 4, "batch_size": 6, "micro_batches": 1}
    # 2 ranks x 1 worker resume from S3 through the faulty proxy, are killed again
    assert _run_warm({**base, "remotes": remotes, "caches": caches, "workers": 1, "until": N,
                      "hold_after": first["batch"] + 9, "kill_at": first["batch"] + 7, "log": str(logs[1]),
                      "resume": str(tmp_path / "state.json")}, 2, tmp_path, "b") == -9
    second = json.loads((tmp_path / "state.json").read_text())
    assert second["batch"] > first["batch"] and second["written_by"]["world_size"] == 2
    assert fault_proxy.stats.errors > 0 and fault_proxy.stats.resets > 0  # the faults really happened
    # 1 rank, no workers, local shards: finishes
    assert _run_warm({**base, "dirs": data, "workers": 0, "until": N, "log": str(logs[2]),
                      "resume": str(tmp_path / "state.json")}, 1, tmp_path, "c") == 0
    phases = [(_phase_rows(logs[0], 4), 4, 0, first["batch"]),
              (_phase_rows(logs[1], 2), 2, first["batch"], second["batch"]),
              (_phase_rows(logs[2], 1), 1, second["batch"], N)]
    covered = []
    for rows, world, lo, hi in phases:
        per = G // world
        for i, by_rank in rows.items():  # everything any rank read is its slice of the uninterrupted batch
            for r, got in by_rank.items():
                assert got == reference[i][r * per:(r + 1) * per], (world, i, r)
        for i in range(lo, hi):  # the batches this job's surviving checkpoint covers: all ranks, in full
            covered.append([row for r in range(world) for row in rows[i][r]])
    assert covered == reference  # nothing repeated, nothing skipped
    assert {row[3] for b in covered for row in b} == {0, 1, 2, 3}  # the weight changes carried over
