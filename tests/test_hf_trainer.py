"""GRAPE in a real Hugging Face Trainer (tiny random LlamaForCausalLM on CPU, real MDS shards), and its resume.

The training runs are subprocesses (tests/_hf_run.py): one straight run, one SIGKILLed between two
checkpoints, then the same command resumed with ``resume_from_checkpoint=True``. The resumed run must train
on exactly the straight run's batches from the checkpoint on, log the same losses, grad norms and GRAPE
metrics at every step, write the same alpha / z trajectory and end with the same weights. Once without
gradient accumulation (24 steps), once with 2 micro-batches per step (12 steps, 24 batches): GRAPE follows
optimizer steps, the mixer's position the batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import _warm
from _grape_data import write_dataset
from _parallel import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
#: (accumulate, steps, save every, kill at, the last checkpoint before the kill, more arguments): GRAPE with
#: probes; GRAPE with alignments from the training steps and R&B, both killed and resumed in the middle of a round
#: whose observed steps are partly in the checkpoint
CASES = [(1, 24, 6, 15, 12, ()), (2, 12, 4, 10, 8, ()), (2, 12, 2, 11, 10, ("--alignments", "steps")),
         (2, 12, 2, 11, 10, ("--method", "rnb")), (2, 12, 2, 11, 10, ("--method", "odm"))]
BATCHES = 24


def _run(data: str, out: str, case: tuple, *extra: str) -> subprocess.CompletedProcess:
    accumulate, steps, save_every = case[:3]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return _warm.run(os.path.join(HERE, "_hf_run.py"), data, out, "--steps", str(steps), "--save-every",
                     str(save_every), "--accumulate", str(accumulate), *extra, cwd=REPO, env=env, timeout=400)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"training subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}"


def _samples(out: str) -> dict[int, dict]:
    """Mixer batch index -> what the model trained on; a batch recorded twice (killed, then resumed) must agree."""
    seen: dict[int, dict] = {}
    for line in open(os.path.join(out, "samples.jsonl"), encoding="utf-8"):
        row = json.loads(line)
        assert seen.setdefault(row["batch"], row) == row, f"batch {row['batch']} differs on replay"
    return seen


def _log(out: str, steps: int) -> dict[int, dict]:
    """Step -> every number the Trainer logged at that step (losses, grad norms, lr, grape/*), timings left out."""
    state = json.load(open(os.path.join(out, f"checkpoint-{steps}", "trainer_state.json"), encoding="utf-8"))
    by_step: dict[int, dict] = {}
    for row in state["log_history"]:
        if "train_runtime" in row:
            continue
        # "epoch" is HF's count of steps since the loop (re)started, over max_steps: after a resume it restarts
        kept = {k: v for k, v in row.items() if "seconds" not in k and k != "epoch"}
        by_step.setdefault(row["step"], {}).update(kept)
    return by_step


def _trajectory(out: str) -> list:
    from grape_stream.grape.controller import load_trajectory

    _, records = load_trajectory(os.path.join(out, "grape_trajectory.jsonl"))
    return [(r["step"], r["alpha"], r.get("z"), r.get("task_loss"), r.get("alignment")) for r in records]


def _weights(out: str, steps: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, f"checkpoint-{steps}", "model.safetensors"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("hf") / "data")
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=128, n_val=24, n_test=8)
    return root


@pytest.mark.parametrize("case", CASES, ids=["no-accumulation", "accumulate-2", "alignments-steps", "rnb", "odm"])
def test_hf_trainer_sigkill_then_resume_replays_the_straight_run(data, tmp_path, case):
    accumulate, steps, save_every, kill_at, last, extra = case
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "killed")
    _ok(_run(data, straight, case, *extra))
    killed = _run(data, broken, case, "--kill-at", str(kill_at), *extra)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert max(int(d.split("-")[1]) for d in os.listdir(broken) if d.startswith("checkpoint-")) == last
    state = torch.load(os.path.join(broken, f"checkpoint-{last}", "grape_stream.pt"), weights_only=True)
    # the mixer's position counts global batches (one per optimizer step: accumulate micro-batches each)
    assert state["step"] == last and state["mixer"]["batch"] == last
    assert state["mixer"]["written_by"]["micro_batches"] == accumulate
    _ok(_run(data, broken, case, "--resume", *extra))
    if "odm" in extra:  # the checkpoint holds the losses of the interval so far (2 of its 4 steps)
        assert state["controller"]["training_losses"]["steps"] == last % 4
    elif extra:  # the checkpoint holds the observed steps of the round so far
        assert state["controller"]["instep"]["observed_steps"] == last % 4

    a, b = _samples(straight), _samples(broken)
    assert sorted(a) == list(range(BATCHES)) and a == b  # the same samples, batch by batch
    log_a, log_b = _log(straight, steps), _log(broken, steps)
    assert sorted(log_a) == list(range(1, steps + 1))
    assert log_a == log_b  # losses, grad norms, learning rates and GRAPE metrics at every step
    updates = list(range(4, steps + 1, 4))
    assert [s for s in log_a if "grape/alpha/d0" in log_a[s]] == updates
    assert all("loss" in log_a[s] and "grad_norm" in log_a[s] for s in log_a)  # an update keeps its step's loss log
    traj = _trajectory(straight)
    assert traj == _trajectory(broken) and [t[0] for t in traj] == [0, *updates]
    assert traj[-1][1] != traj[0][1]  # the mixture moved
    wa, wb = _weights(straight, steps), _weights(broken, steps)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resuming_from_a_checkpoint_without_grape_state_is_one_clear_error(data, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from grape_stream import DomainStream, TaskStream, WeightedStreamingMixer
    from grape_stream.errors import DataError
    from grape_stream.integrations.hf import GrapeTrainer, GrapeTrainerCallback

    def trainer(callbacks: list) -> GrapeTrainer:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
        mixer = WeightedStreamingMixer([DomainStream(d, local=f"{data}/{d}", split="train") for d in ("d0", "d1")],
                                       batch_size=4, seed=0)
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, save_steps=2,
                                 report_to=[], use_cpu=True, disable_tqdm=True)
        return GrapeTrainer(model=model, args=args, mixer=mixer, callbacks=callbacks)

    trainer([]).train()  # a run without GRAPE: its checkpoint has no grape_stream.pt
    folder = tmp_path / "checkpoint-2"
    assert folder.is_dir() and not (folder / "grape_stream.pt").exists()
    grape = GrapeTrainerCallback(tasks=[TaskStream("t0", local=f"{data}/tasks/t0")], alpha_every=1, z_every=1)
    with pytest.raises(DataError, match="checkpoint-2 has no grape_stream.pt"):
        trainer([grape]).train(resume_from_checkpoint=True)


@pytest.mark.parametrize("extra", [(), ("--method", "rnb")], ids=["grape", "rnb"])
def test_hf_trainer_ddp_two_ranks_agree_on_alpha_and_read_disjoint_samples(data, tmp_path, extra):
    """DDP on CPU (gloo, torchrun, 2 ranks): one mixture for both ranks, different samples, one checkpoint; R&B's
    Gram is summed over the ranks' training steps (both ranks hold the same)."""
    out = str(tmp_path / "ddp")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    port = str(free_port())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           port, os.path.join(HERE, "_hf_run.py"), data, out, "--steps", "8", "--save-every", "4",
                           *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.load(open(os.path.join(out, f"alphas-rank{r}.json"), encoding="utf-8")) for r in (0, 1))
    assert r0 == r1 and [s for s, _ in r0] == [0, 4, 8] and r0[-1][1] != r0[0][1]
    s0 = [json.loads(x) for x in open(os.path.join(out, "samples.jsonl"), encoding="utf-8")]
    s1 = [json.loads(x) for x in open(os.path.join(out, "samples-rank1.jsonl"), encoding="utf-8")]
    assert [r["batch"] for r in s0] == [r["batch"] for r in s1] == list(range(8))
    seen0 = {(d, i) for r in s0 for d, i in zip(r["domains"], r["ids"])}
    seen1 = {(d, i) for r in s1 for d, i in zip(r["domains"], r["ids"])}
    assert not seen0 & seen1  # each rank reads its own part of every domain
    state = torch.load(os.path.join(out, "checkpoint-8", "grape_stream.pt"), weights_only=True)
    assert state["step"] == 8 and state["mixer"]["batch"] == 8 and state["mixer"]["written_by"]["world_size"] == 2
    assert [t[1] for t in _trajectory(out)] == [a for _, a in r0]
    if extra:
        h0, h1 = (json.load(open(os.path.join(out, f"history-rank{r}.json"), encoding="utf-8")) for r in (0, 1))
        grams = [[r["domain_gram"] for r in h if not r.get("initial")] for h in (h0, h1)]
        assert grams[0] == grams[1] and len(grams[0]) == 2
        assert all(sum(r["instep"]["samples"]) == 4 * 16 for r in h0 if not r.get("initial"))
