"""GRAPE in a real Lightning Trainer (grape_stream's tiny GPT on CPU, real MDS shards), and its resume.

The training runs are subprocesses (tests/_lightning_run.py): one straight run, one SIGKILLed between two
checkpoints, then the same command resumed from the newest checkpoint. The resumed run must train on exactly
the straight run's batches from there on, with the same losses, write the same alpha / z trajectory and end
with the same weights. Once without gradient accumulation (24 steps), once with ``accumulate_grad_batches=2``
(12 steps, 24 batches): the GRAPE updates follow optimizer steps, and the mixer's position in the checkpoint
is the batches trained on (not the one Lightning's fetcher read ahead).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import _warm
from _grape_data import write_dataset
from _parallel import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
#: (accumulate, steps, save every, kill at, the last checkpoint before the kill, alignments); with in-step
#: alignments (2 observed steps of every 4) the checkpoint of step 6 is taken in the middle of an interval; "rnb":
#: method rnb (R&B) on the same observed steps
CASES = [(1, 24, 6, 15, 12, "probe"), (2, 12, 4, 10, 8, "probe"), (2, 12, 6, 10, 6, "steps"),
         (2, 12, 6, 10, 6, "rnb")]
BATCHES = 24


def _run(data: str, out: str, case: tuple, *extra: str) -> subprocess.CompletedProcess:
    accumulate, steps, save_every = case[:3]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return _warm.run(os.path.join(HERE, "_lightning_run.py"), data, out, "--steps", str(steps), "--save-every",
                     str(save_every), "--accumulate", str(accumulate), "--alignments", case[5], *extra, cwd=REPO,
                     env=env, timeout=400)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"training subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}"


def _samples(out: str) -> dict[int, dict]:
    """Mixer batch index -> what the model trained on and its loss; a batch recorded twice must agree."""
    seen: dict[int, dict] = {}
    for line in open(os.path.join(out, "samples.jsonl"), encoding="utf-8"):
        row = json.loads(line)
        assert seen.setdefault(row["batch"], row) == row, f"batch {row['batch']} differs on replay"
    return seen


def _trajectory(out: str) -> list:
    from grape_stream.grape.controller import load_trajectory

    _, records = load_trajectory(os.path.join(out, "grape_trajectory.jsonl"))
    return [(r["step"], r["alpha"], r.get("z"), r.get("task_loss"), r.get("alignment")) for r in records]


def _final(out: str, steps: int) -> dict:
    return torch.load(os.path.join(out, "ckpt", f"step={steps}.ckpt"), weights_only=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("lightning") / "data")
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=128, n_val=24, n_test=8)
    return root


@pytest.mark.parametrize("case", CASES, ids=["no-accumulation", "accumulate-2", "accumulate-2-instep",
                                                 "accumulate-2-rnb"])
def test_lightning_sigkill_then_resume_replays_the_straight_run(data, tmp_path, case):
    accumulate, steps, save_every, kill_at, last, alignments = case
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "killed")
    _ok(_run(data, straight, case))
    killed = _run(data, broken, case, "--kill-at", str(kill_at))
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(os.listdir(os.path.join(broken, "ckpt"))) == sorted(
        f"step={s}.ckpt" for s in range(save_every, last + 1, save_every))
    _ok(_run(data, broken, case, "--resume"))

    a, b = _samples(straight), _samples(broken)
    assert sorted(a) == list(range(BATCHES)) and a == b  # the same samples and losses, batch by batch
    updates = list(range(4, steps + 1, 4))
    traj = _trajectory(straight)
    assert traj == _trajectory(broken) and [t[0] for t in traj] == [0, *updates]
    assert traj[-1][1] != traj[0][1]  # the mixture moved
    ca, cb = _final(straight, steps), _final(broken, steps)
    assert ca["state_dict"].keys() == cb["state_dict"].keys()
    assert all(torch.equal(ca["state_dict"][k], cb["state_dict"][k]) for k in ca["state_dict"])
    state = ca["callbacks"]["GrapeLightningCallback"]
    assert state["format"] == "grape_stream.loop/1" and state["step"] == steps and state["batches"] == BATCHES
    assert ("instep" in state["controller"]) == (alignments in ("steps", "rnb"))
    assert state["mixer"]["batch"] == BATCHES  # trained on, not the one Lightning's fetcher read ahead
    # the GRAPE metrics reach the Trainer's logger at every update
    rows = list(csv.DictReader(open(os.path.join(straight, "csv", "version_0", "metrics.csv"), encoding="utf-8")))
    logged = {int(r["step"]): float(r["grape/alpha/d0"]) for r in rows if r.get("grape/alpha/d0")}
    assert sorted(logged) == updates and logged[steps] == traj[-1][1][0]


def test_lightning_ddp_two_ranks_agree_on_alpha_and_read_disjoint_samples(data, tmp_path):
    """DDP on CPU (gloo, torchrun, 2 ranks): one mixture for both ranks, different samples, one checkpoint."""
    out = str(tmp_path / "ddp")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    port = str(free_port())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           port, os.path.join(HERE, "_lightning_run.py"), data, out, "--devices", "2", "--steps", "8",
                           "--save-every", "4"], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.load(open(os.path.join(out, f"alphas-rank{r}.json"), encoding="utf-8")) for r in (0, 1))
    assert r0 == r1 and [s for s, _ in r0] == [0, 4, 8] and r0[-1][1] != r0[0][1]
    s0 = [json.loads(x) for x in open(os.path.join(out, "samples.jsonl"), encoding="utf-8")]
    s1 = [json.loads(x) for x in open(os.path.join(out, "samples-rank1.jsonl"), encoding="utf-8")]
    assert [r["batch"] for r in s0] == [r["batch"] for r in s1] == list(range(8))
    seen0 = {(d, i) for r in s0 for d, i in zip(r["domains"], r["ids"])}
    seen1 = {(d, i) for r in s1 for d, i in zip(r["domains"], r["ids"])}
    assert not seen0 & seen1  # each rank reads its own part of every domain
    state = _final(out, 8)["callbacks"]["GrapeLightningCallback"]
    assert state["step"] == 8 and state["mixer"]["batch"] == 8 and state["mixer"]["written_by"]["world_size"] == 2
    assert [t[1] for t in _trajectory(out)] == [a for _, a in r0]


def _fsdp2_run(data: str, out: str, *extra: str, devices: int = 2) -> None:
    """A float64 GPT under ModelParallelStrategy, global batch 16 on any number of ranks, probes replicated; the
    ranks started as torchrun starts them, forked warm (tests/_warm.py)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = _warm.run(os.path.join(HERE, "_lightning_run.py"), data, out, "--devices", str(devices), "--steps", "8",
                     "--save-every", "3", "--strategy", "model_parallel", "--global-batch", "16", "--double",
                     "--probe-mode", "replicated", *extra, cwd=REPO, env=env, timeout=400, ranks=devices)
    with open(out + ".stderr", "w", encoding="utf-8") as f:  # (a killed run's log, for a failure after it)
        f.write(proc.stderr)
    assert proc.returncode == 0 or "--kill-at" in extra, proc.stderr[-4000:]


@pytest.mark.parametrize("alignments", ["probe", "steps"])
def test_lightning_fsdp2_grape_probes_the_sharded_module_and_resumes_after_sigkill(data, tmp_path, alignments):
    """ModelParallelStrategy (FSDP2 in configure_model, 2 gloo ranks under torchrun): GRAPE's probe runs on the
    sharded module (the layer-by-layer Gram, grape/gram/sharding.py) through the callback; both ranks hold the same
    records and alpha moves at the update of step 4 (the run script asserts the module was sharded). SIGKILLed at
    step 7 (checkpoints at 3 and 6: mid-interval), Lightning's distributed checkpoint (DCP) resumes on 2 ranks onto
    the straight run's update records (alignments, alpha, z) bit for bit. ``probe`` also resumes, resharded, on 4
    ranks (per-rank batch 4 instead of 8) within rtol 1e-10: the model is float64 and the probes replicated, so only
    the order in which FSDP sums the gradients over the ranks differs (tests/test_fsdp_resume.py,
    docs/alignment.md). ``steps``: the same with in-step alignments (2 observed steps of every 4; the sharded
    directions and the task probe's shards, grape/instep_probe_shards.py), the checkpoint of step 6 holding a
    half-observed interval (resumed on 2 ranks: the 4-rank resume is the probe's, once, for the suite's time)."""
    from test_fsdp_resume import assert_close_records

    straight, killed, on4 = str(tmp_path / "straight"), str(tmp_path / "killed"), str(tmp_path / "on4")
    on_four = alignments == "probe"
    _fsdp2_run(data, straight, "--alignments", alignments)
    _fsdp2_run(data, killed, "--kill-at", "7", "--alignments", alignments)
    assert not os.path.exists(os.path.join(killed, "history-rank0.json"))  # the kill happened
    if on_four:
        os.makedirs(on4)
        shutil.copytree(os.path.join(killed, "ckpt"), os.path.join(on4, "ckpt"))
    _fsdp2_run(data, killed, "--resume", "--alignments", alignments)
    if on_four:
        _fsdp2_run(data, on4, "--resume", "--alignments", alignments, devices=4)

    def records(out: str, rank: int) -> list:
        with open(os.path.join(out, f"history-rank{rank}.json"), encoding="utf-8") as f:
            return [{k: v for k, v in r.items() if k != "seconds"} for r in json.load(f)]

    h0 = records(straight, 0)
    assert records(straight, 1) == h0 and [r["step"] for r in h0] == [0, 4, 8]
    assert h0[1]["alpha"] != h0[0]["alpha"] and len(h0[1]["domain_alignment"]) == 3
    assert records(killed, 0) == h0 and records(killed, 1) == h0
    for rank in range(4 if on_four else 0):
        r4 = records(on4, rank)
        assert r4[:2] == h0[:2]  # restored from the checkpoint
        assert_close_records(h0, r4)
