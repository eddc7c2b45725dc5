"""The soak (bench/soak.py) at a CI size: S3 through the fault proxy (500s, resets, two outages), 2 workers,
a SIGKILL of the job's process group half-way and a resume; the full size's figures are in bench/results/soak.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_a_short_soak_loses_nothing_and_leaves_nothing(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--batches", "3000", "--outage", "3",
                           "--checkpoint-every", "500", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["identical_batches"] is True
    assert (res["samples_lost"], res["samples_duplicated"]) == (0, 0)
    assert res["resumed_from"] == res["killed_after_checkpoint"] > 0
    assert res["shm_left_behind"] in (0, [], {}) and res["tmp_entries_after"] == res["tmp_entries_before"]
