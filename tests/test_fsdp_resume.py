"""A SIGKILLed FSDP2 run resumes on 2 and on 4 ranks onto the uninterrupted run's alpha / z trajectory.

A plain PyTorch loop (tests/_fsdp_resume_run.py: a float64 GPT sharded with ``fully_shard``, AdamW, GRAPE updating
alpha and z every 4 steps, ``probe_mode="replicated"``) runs on 2 gloo ranks, one process per rank, saving a
checkpoint every 3 steps: the model's and optimizer's sharded state through torch.distributed.checkpoint (DCP),
the mixer's position and the controller's state beside it. One run goes straight to step 12. A second is
SIGKILLed, every rank, while it sits after step 7 (the checkpoint of step 6 written, the update of step 8 not
yet run: mid-interval); its checkpoint is then resumed on 2 ranks and, resharded by DCP, on 4 ranks (per-rank
batch 4 and 2: the same global batch of 8).

What must hold, and why these tolerances:

* the data: the mixer's global batches depend only on the seed, the global batch size and the weight schedule,
  so every resumed run trains on the straight run's samples, batch for batch (the 4 ranks' slices, in rank
  order, are the 2 ranks' batch);
* on 2 ranks the resumed run is the straight run, bit for bit: every update record (alignments, losses, alpha,
  z) is equal;
* on 4 ranks FSDP2 reduce-scatters the gradients over 4 ranks instead of 2, a different summation order, so the
  weights after the resume differ from the straight run's in the last bits (float64: ~1e-16 relative), and so do
  the Grams probed from them. The probe itself is the same: with ``probe_mode="replicated"`` every rank probes
  the same samples whatever the world size (with ``"sharded"`` each of R ranks draws its own, so a resume on
  another world size probes other samples: a different, equally valid, trajectory). So the records after the
  resume equal the straight run's within rtol 1e-10 (and the ones before it, restored from the checkpoint, are
  equal), while the mixture moves by far more than that.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _grape_data import write_dataset

HERE = Path(__file__).resolve().parent
STEPS, SAVE_EVERY, HOLD_AFTER, GLOBAL_BATCH = 12, 3, 7, 8
UPDATES = [0, 4, 8, 12]
TIMING = ("seconds",)  # wall-clock fields of a record: never compared


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("fsdp_resume") / "data")
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=128, n_val=24, n_test=8)
    return root


def _launch(data: str, out: Path, world: int, *extra: str) -> subprocess.Popen:
    """The job: one launcher process that forks the ranks (tests/_fsdp_resume_run.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, str(HERE / "_fsdp_resume_run.py"), data, str(out), "--world", str(world), "--steps",
         str(STEPS), "--save-every", str(SAVE_EVERY), "--global-batch", str(GLOBAL_BATCH), *extra],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _stop(job: subprocess.Popen) -> str:
    """Kill a job that went wrong (its whole session: the launcher and its ranks); its stderr."""
    with contextlib.suppress(ProcessLookupError):  # a job that ended on its own has no group left to kill
        os.killpg(job.pid, signal.SIGKILL)
    return job.communicate()[1].decode()[-4000:]


def _wait(job: subprocess.Popen, timeout: float = 400) -> None:
    try:
        job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job did not finish:\n{_stop(job)}") from None
    assert job.returncode == 0, f"the job failed ({job.returncode}):\n{job.stderr.read().decode()[-4000:]}"


def _kill_when_held(job: subprocess.Popen, out: Path, world: int, timeout: float = 400) -> None:
    """SIGKILL every rank process once all of them sit after step HOLD_AFTER; the launcher reports the kill."""
    deadline = time.time() + timeout
    held = [out / f"held-rank{r}" for r in range(world)]
    while not all(f.exists() for f in held):
        assert job.poll() is None, f"the job ended before the kill ({job.returncode}):\n{_stop(job)}"
        if time.time() > deadline:
            raise AssertionError(f"the job never reached the kill point:\n{_stop(job)}")
        time.sleep(0.1)
    for f in held:
        with contextlib.suppress(ProcessLookupError):  # the launcher may have taken it down already
            os.kill(int(f.read_text()), signal.SIGKILL)
    assert job.wait(timeout=60) == 128 + signal.SIGKILL, job.stderr.read().decode()[-4000:]


def _records(out: Path, rank: int) -> list[dict]:
    with open(out / f"history-rank{rank}.json", encoding="utf-8") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in json.load(f)]


def _global_batches(out: Path, world: int) -> dict[int, list]:
    """{step: the global batch's (domain, sample) pairs, rank slices in rank order}; a replayed step must agree."""
    per_rank = []
    for r in range(world):
        steps: dict[int, list] = {}
        for line in open(out / f"samples-rank{r}.jsonl", encoding="utf-8"):
            row = json.loads(line)
            pairs = [list(x) for x in zip(row["domains"], row["ids"])]
            assert steps.setdefault(row["step"], pairs) == pairs, f"step {row['step']} differs on replay"
        per_rank.append(steps)
    assert all(set(s) == set(per_rank[0]) for s in per_rank)
    return {step: [pair for s in per_rank for pair in s[step]] for step in per_rank[0]}


def assert_close_records(a, b, path: str = "") -> None:
    """Equal structure and exact non-floats; floats within rtol 1e-10 (atol 1e-13 for entries near zero)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_close_records(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_records(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-13, err_msg=path)
    else:
        assert a == b, path


def test_fsdp2_sigkill_mid_interval_resumes_on_2_and_4_ranks_onto_the_straight_trajectory(data, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    jobs = [_launch(data, straight, 2), _launch(data, killed, 2, "--hold-after", str(HOLD_AFTER))]  # side by side
    _kill_when_held(jobs[1], killed, 2)
    _wait(jobs[0])
    assert sorted(os.listdir(killed / "ckpt")) == ["step-3", "step-6"]
    assert not (killed / "history-rank0.json").exists()
    resumed = {world: tmp_path / f"resumed{world}" for world in (2, 4)}
    for out in resumed.values():
        out.mkdir()
        shutil.copytree(killed / "ckpt", out / "ckpt")
    for job in [_launch(data, out, world, "--resume") for world, out in resumed.items()]:
        _wait(job)

    truth = _records(straight, 0)
    assert _records(straight, 1) == truth and [r["step"] for r in truth] == UPDATES
    for key in ("alpha", "z"):  # each update moves the mixture by far more than the tolerance below
        assert all(max(abs(x - y) for x, y in zip(a[key], b[key])) > 1e-5 for a, b in zip(truth, truth[1:])), key

    batches = _global_batches(straight, 2)
    assert sorted(batches) == list(range(1, STEPS + 1))
    before = _global_batches(killed, 2)
    assert sorted(before) == list(range(1, HOLD_AFTER + 1)) and all(before[s] == batches[s] for s in before)
    for world, out in resumed.items():
        got = _global_batches(out, world)
        assert sorted(got) == list(range(2 * SAVE_EVERY + 1, STEPS + 1))  # on from the checkpoint of step 6
        assert all(got[s] == batches[s] for s in got), world  # the same samples, topology-independent
        for r in range(world):
            records = _records(out, r)
            assert [x["step"] for x in records] == UPDATES
            if world == 2:
                assert records == truth  # the same world size: bit for bit
            else:
                assert records[:2] == truth[:2]  # restored from the checkpoint
                assert_close_records(truth, records)  # trained on 4 ranks: the last bits of the weights differ


def test_only_replicated_probes_draw_the_same_samples_on_every_world_size(data):
    """Why the test above uses ``probe_mode="replicated"``: the probe samples GRAPE differentiates at a step are the
    same on 2 and on 4 ranks only then. With ``"sharded"`` rank r takes slice r of one permutation, so 4 ranks probe
    samples 2 ranks never do (and the Gram is averaged over other per-rank halves): a resume on another world size
    continues from the checkpoint's alpha and z onto a different trajectory."""
    import torch

    from grape_stream import DomainStream, TaskStream, WeightedStreamingMixer
    from grape_stream.grape.probes import draw_probe_groups

    with WeightedStreamingMixer([DomainStream(d, local=f"{data}/{d}", split="train") for d in ("d0", "d1", "d2")],
                                batch_size=GLOBAL_BATCH, seed=0) as mixer:
        tasks = [TaskStream(t, local=f"{data}/tasks/{t}") for t in ("t0", "t1")]

        def probes(world: int, sharded: bool) -> list[list[list]]:
            """[rank][group]: the rows (token lists) that rank probes at step 8."""
            return [[g["tokens"].tolist() for g in draw_probe_groups(
                mixer, 3, tasks, 8, seed=0, domain_batch=4, task_batch=4, rank=r, world=world, sharded=sharded,
                device=torch.device("cpu"))] for r in range(world)]

        replicated = probes(1, False)[0]
        assert all(p == replicated for world in (2, 4) for p in probes(world, False))
        on2, on4 = probes(2, True), probes(4, True)
        for g in range(5):  # every domain and task group: 4 ranks probe rows that 2 ranks do not
            two, four = ({tuple(row) for p in on for row in p[g]} for on in (on2, on4))
            assert len(four) > len(two) and not four <= two, g
