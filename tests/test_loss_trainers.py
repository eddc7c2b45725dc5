"""Loss-driven methods in the Hugging Face Trainer (GrapeTrainer, a tiny Llama) and in Lightning, on real MDS
shards, each with gradient accumulation: DoReMi trains with the checkpoint of a short uniform run of the same
trainer as its reference (an HF checkpoint folder, a Lightning .ckpt), every registered loss-driven method
trains, and each update's per-domain samples are the samples trained on since the last update."""

from __future__ import annotations

import json
import os

import pytest

import _warm
from _grape_data import SHORT_RUN, write_dataset
from grape_stream.config.choices import Signal
from grape_stream.grape.reweighting import REWEIGHTERS

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LOSS_METHODS = [m for m, c in REWEIGHTERS.items() if c.signal is Signal.training_losses]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("loss_trainers_data"))
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=160, n_val=24, n_test=16)
    return root


def _run(script: str, data: str, out: str, *extra: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = _warm.run(os.path.join(HERE, script), data, out, *extra, cwd=REPO, env=env, timeout=400)
    assert proc.returncode == 0, f"training subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}"


def _check(out: str, steps: int, samples_per_step: int, method: str) -> None:
    with open(os.path.join(out, "history-rank0.json"), encoding="utf-8") as f:
        history = json.load(f)
    every = SHORT_RUN.get(method, {}).get("alpha_every", 4)
    updates = [r for r in history if not r.get("initial")]
    assert [r["step"] for r in updates] == list(range(every, steps + 1, every))
    assert not any(r.get("skipped") for r in updates)
    assert all(sum(r["domain_samples"]) == every * samples_per_step and r["loss_steps"] == every for r in updates)
    assert all(v is None or v > 0 for r in updates for v in r["domain_loss"])
    assert updates[-1]["alpha"] != history[0]["alpha"]
    if REWEIGHTERS[method].needs_reference:  # the reference (trained 4 steps) is ahead of the proxy early on
        assert all(len(r["domain_excess"]) == 3 and max(r["domain_excess"]) > 0 for r in updates)
        assert "average_alpha" in updates[-1]


@pytest.fixture(scope="module")
def hf_reference(data, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("hf_ref"))
    _run("_hf_run.py", data, out, "--steps", "4", "--save-every", "4", "--method", "uniform")
    return os.path.join(out, "checkpoint-4")


@pytest.fixture(scope="module")
def lightning_reference(data, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("lightning_ref"))
    _run("_lightning_run.py", data, out, "--steps", "4", "--save-every", "4", "--method", "uniform")
    return os.path.join(out, "ckpt", "step=4.ckpt")


@pytest.mark.parametrize("method", LOSS_METHODS)
def test_hf_trainer_trains_a_loss_driven_method(data, hf_reference, tmp_path, method) -> None:
    ref = ["--reference", hf_reference] if REWEIGHTERS[method].needs_reference else []
    _run("_hf_run.py", data, str(tmp_path), "--steps", "8", "--save-every", "100", "--accumulate", "2",
         "--method", method, *ref)
    _check(str(tmp_path), 8, 16, method)


@pytest.mark.parametrize("method", LOSS_METHODS)
def test_lightning_trains_a_loss_driven_method(data, lightning_reference, tmp_path, method) -> None:
    ref = ["--reference", lightning_reference] if REWEIGHTERS[method].needs_reference else []
    _run("_lightning_run.py", data, str(tmp_path), "--steps", "8", "--save-every", "100", "--accumulate", "2",
         "--method", method, *ref)
    _check(str(tmp_path), 8, 16, method)


@pytest.mark.parametrize("method", LOSS_METHODS)
def test_hf_model_without_logits_is_refused_in_one_line(data, tmp_path, method) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from _grape_data import SEQ, VOCAB
    from grape_stream import DomainStream, WeightedStreamingMixer
    from grape_stream.errors import ConfigError
    from grape_stream.integrations.hf import GrapeTrainer, GrapeTrainerCallback

    class LossOnly(torch.nn.Module):  # returns its loss and nothing else
        def __init__(self) -> None:
            super().__init__()
            self.lm = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                   max_position_embeddings=SEQ))

        def forward(self, input_ids, labels=None, **kwargs):
            return {"loss": self.lm(input_ids=input_ids, labels=labels).loss}

    model = LossOnly()
    reference = str(tmp_path / "ref.pt")
    torch.save(model.state_dict(), reference)
    mixer = WeightedStreamingMixer([DomainStream(d, local=f"{data}/{d}", split="train") for d in ("d0", "d1", "d2")],
                                   batch_size=8, seed=0)
    try:
        grape = GrapeTrainerCallback(method=method, alpha_every=2, trajectory=False, **(
            {"options": {"reference": reference}} if REWEIGHTERS[method].needs_reference else {}))
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, report_to=[], use_cpu=True)
        trainer = GrapeTrainer(model=model, args=args, mixer=mixer, callbacks=[grape])
        with pytest.raises(ConfigError, match="logits") as err:
            trainer.train()
        assert "\n" not in str(err.value)
    finally:
        mixer.close()


def _torchrun(script: str, data: str, out: str, *extra: str) -> None:
    """2 ranks as torchrun starts them (gloo on CPU; forked warm, tests/_warm.py); a SIGKILLed run (``--kill-at``)
    may exit non-zero."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = _warm.run(os.path.join(HERE, script), data, out, "--devices", "2", *extra, cwd=REPO, env=env,
                     timeout=400, ranks=2)
    assert proc.returncode == 0 or "--kill-at" in extra, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}"


def test_lightning_fsdp2_doremi_resumes_after_sigkill_onto_the_same_trajectory(data, lightning_reference,
                                                                                tmp_path) -> None:
    """Lightning's ModelParallelStrategy (FSDP2, 2 gloo ranks): DoReMi, its reference sharded like the training
    model, trains; SIGKILLed at step 7 (checkpoints at 3 and 6: mid-interval) and resumed, both ranks hold the
    straight run's alpha trajectory and update records."""
    common = ("--steps", "8", "--save-every", "3", "--method", "doremi", "--reference", lightning_reference,
              "--strategy", "model_parallel")
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    _torchrun("_lightning_run.py", data, straight, *common)
    _torchrun("_lightning_run.py", data, killed, *common, "--kill-at", "7")
    assert not os.path.exists(os.path.join(killed, "alphas-rank0.json"))  # the kill happened
    _torchrun("_lightning_run.py", data, killed, *common, "--resume")

    def records(out: str, rank: int) -> list:
        with open(os.path.join(out, f"history-rank{rank}.json"), encoding="utf-8") as f:
            return [{k: v for k, v in r.items() if k != "seconds"} for r in json.load(f)]

    want = records(straight, 0)
    assert [r["step"] for r in want] == [0, 4, 8] and max(want[-1]["domain_excess"]) > 0
    assert all(sum(r["domain_samples"]) == 4 * 16 for r in want[1:])  # 4 steps x 8 samples x 2 ranks
    assert records(straight, 1) == want
    assert records(killed, 0) == want and records(killed, 1) == want

