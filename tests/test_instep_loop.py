"""alignments: steps in a plain PyTorch loop (the controller API): real MDS data through the mixer, gradient
accumulation over two micro-batches, a checkpoint in the middle of an interval, and a resume that reproduces
the uninterrupted run exactly (weights, alpha, z and the in-step scores)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _grape_data import SEQ, VOCAB, write_dataset
from grape_stream import DomainStream, GrapeController, TaskStream, WeightedStreamingMixer
from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.gram.batches import map_tensors
from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss

DOMAINS, TASKS = ["d0", "d1", "d2"], ["t0", "t1"]


def _run(data: str, steps: int, resume: dict | None, **options) -> dict:
    mixer = WeightedStreamingMixer(domains=[DomainStream(d, local=f"{data}/{d}", split="train") for d in DOMAINS],
                                   batch_size=8, seed=0)
    tasks = [TaskStream(t, local=f"{data}/tasks/{t}") for t in TASKS]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=16, d_ff=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        mus = {"mu_alpha": 1e-3} if str(options.get("method", "")).startswith("doge") else {"mu_alpha": 1e-3,
                                                                                          "mu_z": 1e-3}
        grape = GrapeController(mixer, tasks, probe_domain_batch=4, probe_task_batch=4,
                                **{"method": "grape", "alpha_every": 4, "z_every": 4, **mus, "alignments": "steps",
                                   **options})
    except Exception:
        mixer.close()
        raise
    first = 1
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        mixer.load_state_dict(resume["mixer"])
        grape.load_state_dict(resume["grape"])
        first = resume["step"] + 1
    grape.start()
    loader = iter(mixer.dataloader(num_workers=0))
    try:
        for step in range(first, steps + 1):
            batch = next(loader)
            for half in (slice(0, 3), slice(3, 8)):  # gradient accumulation over two unequal micro-batches
                micro = map_tensors(batch, lambda t, h=half: t[h])
                with grape.observe(model, step, micro, optimizer=opt):
                    (per_sample_lm_loss(model, micro).mean() * (micro["tokens"].shape[0] / 8)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            grape.maybe_update(model, step, lr=3e-3, optimizer=opt)
        return {"step": steps, "model": model.state_dict(), "opt": opt.state_dict(), "mixer": mixer.state_dict(),
                "grape": grape.state_dict()}
    finally:
        mixer.close()


def test_steps_mode_trains_checkpoints_mid_interval_and_resumes_exactly(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=128, n_val=24, n_test=8)
    straight = _run(data, 12, None, alignment_steps=2)  # steps 2, 4, 6, 8, ... observed
    half = _run(data, 6, None, alignment_steps=2)  # step 6: observed, in the middle of the second interval
    half = torch.load(_save(tmp_path / "half.pt", half), weights_only=True)  # the checkpoint as a file
    assert half["grape"]["instep"]["observed_steps"] == 1
    resumed = _run(data, 12, half, alignment_steps=2)
    for k, v in straight["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
    keys = ("step", "alpha", "z", "task_loss", "domain_alignment", "task_alignment")
    strip = lambda h: [tuple(str(r.get(k)) for k in keys) for r in h]  # noqa: E731 (no timings)
    assert strip(straight["grape"]["history"]) == strip(resumed["grape"]["history"])
    updates = [r for r in straight["grape"]["history"] if not r.get("initial")]
    assert [r["step"] for r in updates] == [4, 8, 12]
    assert all(r["instep"]["observed_steps"] == 2 and sum(r["instep"]["samples"]) == 16 for r in updates)
    assert updates[-1]["alpha"] != straight["grape"]["history"][0]["alpha"]  # the mixture moved


def _save(path: Path, state: dict) -> str:
    torch.save(state, path)
    return str(path)


def test_steps_mode_refuses_what_it_cannot_measure(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=32, n_val=8, n_test=4)
    for options, needle in (({"clip_norm": 1.0}, "clip_norm"), ({"z_every": 8}, "alpha_every != z_every"),
                            ({"alignment_steps": 0}, "alignment_steps"), ({"alignments": "both"}, "alignments")):
        with pytest.raises(ConfigError, match=needle):
            _run(data, 0, None, **options)


@pytest.mark.parametrize("method, options", [("grape_ema", {}), ("doge_pcgrad", {}), ("grape", {"geometry": "adam"})],
                         ids=["grape_ema", "doge_pcgrad", "grape-adam"])
def test_steps_mode_serves_every_method_and_the_adam_geometry(tmp_path: Path, method: str, options: dict) -> None:
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=64, n_val=16, n_test=4)
    end = _run(data, 4, None, method=method, alpha_every=2, z_every=2, alignment_steps=1, **options)
    history = end["grape"]["history"]
    updates = [r for r in history if not r.get("initial")]
    assert [r["step"] for r in updates] == [2, 4] and all(r.get("skipped") is None for r in updates)
    assert updates[-1]["alpha"] != history[0]["alpha"]
    assert (updates[-1]["z"] != history[0]["z"]) == (not method.startswith("doge"))
    if options.get("geometry") == "adam":
        assert updates[-1]["geometry"].startswith("adam")


def test_an_error_inside_an_observed_step_reaches_the_caller_and_the_next_step_runs(tmp_path: Path) -> None:
    """A trainer's own exception in the observed forward is raised as it is (the engine's "the backward must run
    inside observe()" check would otherwise replace it), and the hooks are gone: the next observed step runs."""
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=32, n_val=8, n_test=4)
    mixer = WeightedStreamingMixer(domains=[DomainStream(d, local=f"{data}/{d}", split="train") for d in DOMAINS],
                                   batch_size=8, seed=0)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=16, d_ff=32))
        grape = GrapeController(mixer, [TaskStream(t, local=f"{data}/tasks/{t}") for t in TASKS], probe_task_batch=4,
                                alpha_every=4, z_every=4, alignments="steps", alignment_steps=4)
        grape.start()
        batch = next(iter(mixer.dataloader(num_workers=0)))
        with pytest.raises(KeyError, match="the trainer's own"):
            with grape.observe(model, 1, batch):
                per_sample_lm_loss(model, batch)
                raise KeyError("the trainer's own")
        with grape.observe(model, 1, batch):  # the same step again, for real
            per_sample_lm_loss(model, batch).mean().backward()
        assert grape.signal.kind is Signal.step_alignments and float(grape.signal.alignments.weights.sum()) > 0  # type: ignore[union-attr]
    finally:
        mixer.close()
