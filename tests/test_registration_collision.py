"""A job that does not take our registration lock (plain streaming, another user's job) can create the
``_locals`` segment of the prefix a multi-rank job's leader is about to create, after every rank scanned for it.
Streaming 0.13's leader then raises between its two barriers; before the collective retry the other ranks waited
at the second barrier until the leader's process died ("Connection reset by peer"). Now every rank retries on
the next free prefix.

Deterministic: on rank 0 the rank script (tests/_registration_race.py) wraps streaming's segment constructor so
that, the first time the leader creates a ``_locals`` segment, another owner creates that very name first."""

from __future__ import annotations

import json
import os
from pathlib import Path

import _warm
from grape_stream.testing.mds import write_domain

HERE = Path(__file__).resolve().parent


def test_every_rank_retries_when_another_job_takes_the_leaders_prefix(tmp_path: Path) -> None:
    write_domain(tmp_path / "mine", 0, 8)
    proc = _warm.run(str(HERE / "_registration_race.py"), str(tmp_path), cwd=str(tmp_path),
                     env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180, ranks=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert proc.returncode == 0 and all("error" not in r for r in ranks), (ranks, proc.stderr[-2000:])
    taken = json.loads((tmp_path / "taken.json").read_text())  # e.g. "/000004_locals": the other job's
    assert len({r["prefix"] for r in ranks}) == 1  # both ranks on one prefix ...
    assert f"{ranks[0]['prefix']:06d}_locals" not in taken  # ... not the one the other job took
    assert all(r["samples"] == 8 for r in ranks) and ranks[0]["first"] == ranks[1]["first"]
