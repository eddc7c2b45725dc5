"""Two real processes (`composer -n 2`, gloo on CPU): GRAPE keeps identical weights on both ranks while
each rank reads and probes its own data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from _grape_data import write_dataset
from _parallel import free_port
from test_composer import tiny_recipe

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)



def test_two_ranks_share_identical_weights(tmp_path):
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=160, n_val=24, n_test=16)
    recipe = tiny_recipe(data, str(tmp_path), run_name="ddp", trainer={"max_duration": "12ba", "eval_interval": "12ba"})
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps(recipe))
    dump = tmp_path / "dump"
    launcher = shutil.which("composer", path=os.path.dirname(sys.executable)) or "composer"
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [launcher, "-n", "2", "--master_port", str(free_port()), "--stderr", str(tmp_path / "rank{rank}.err"),
         "--stdout", str(tmp_path / "rank{rank}.out"), os.path.join(HERE, "_grape_run.py"), str(path),
         "--dump", str(dump)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=500,
    )
    errs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("rank*.err"))
    assert proc.returncode == 0, proc.stderr[-3000:] + errs
    r0 = json.loads((dump / "rank0.json").read_text())
    r1 = json.loads((dump / "rank1.json").read_text())
    assert (r0["world_size"], r1["world_size"]) == (2, 2)

    # Identical weights on both ranks, at every update, and they moved.
    assert r0["history"] == r1["history"]
    assert [h["step"] for h in r0["history"]] == [0, 4, 8, 12]
    assert np.max(np.abs(np.array(r0["history"][-1]["alpha"]) - 1 / 3)) > 1e-3
    assert r0["schedule"] == r1["schedule"]
    # ... while each rank trains on its own samples (per-rank batch 4 of the global 8).
    b0, b1 = r0["batches"][0], r1["batches"][0]
    assert len(b0["domain"]) == 4
    pairs0 = set(zip(b0["domain"], b0["sample_index"]))
    pairs1 = set(zip(b1["domain"], b1["sample_index"]))
    assert not pairs0 & pairs1
    # Every batch on both ranks was composed with the same schedule version.
    assert [b["weights_version"] for b in r0["batches"]] == [b["weights_version"] for b in r1["batches"]]
