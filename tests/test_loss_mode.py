"""The training-loss mode (grape/loss_mode.py) in a plain PyTorch loop on real MDS data through the mixer, with
gradient accumulation over unequal micro-batches: the per-domain loss and excess sums equal losses computed
separately per sample (explicit per-token loops for DoReMi's excess), DoReMi's update equals a slow
Algorithm 1, a checkpoint in the middle of an interval resumes onto the same trajectory, and what cannot
work is refused with one line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from _grape_data import SEQ, VOCAB, write_dataset
from grape_stream import DomainStream, GrapeController, WeightedStreamingMixer
from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.gram.batches import map_tensors
from grape_stream.grape.reweighting import REWEIGHTERS
from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss

DOMAINS = ["d0", "d1", "d2"]
LOSS_METHODS = [m for m, c in REWEIGHTERS.items() if c.signal is Signal.training_losses]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("loss_mode_data"))
    write_dataset(root, domains=3, tasks=(0,), n_domain=160, n_val=16, n_test=8)
    return root


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=16, d_ff=32))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> str:
    """A plain state_dict of a model trained a few steps on the uniform mixture."""
    path = str(tmp_path_factory.mktemp("ref") / "reference.pt")
    mixer = _mixer(data)
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        loader = iter(mixer.dataloader(num_workers=0))
        for _ in range(6):
            per_sample_lm_loss(model, next(loader)).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        mixer.close()
    torch.save(model.state_dict(), path)
    return path


def _mixer(data: str) -> WeightedStreamingMixer:
    return WeightedStreamingMixer(domains=[DomainStream(d, local=f"{data}/{d}", split="train") for d in DOMAINS],
                                  batch_size=8, seed=0)


def _options(method: str, reference: str) -> dict:
    return {"reference": reference} if REWEIGHTERS[method].needs_reference else {}


def _slow_truth(model: GPT, ref: GPT | None, micro: dict) -> list[tuple[int, float, float, float]]:
    """(domain, loss, excess sum, tokens) of each sample, one sample and one token at a time."""
    out = []
    with torch.no_grad():
        for i in range(micro["tokens"].shape[0]):
            tokens = micro["tokens"][i: i + 1].long()
            lp = torch.log_softmax(model(tokens[:, :-1]).double(), -1)[0]
            lr = torch.log_softmax(ref(tokens[:, :-1]).double(), -1)[0] if ref is not None else None
            per_tok, excess = [], 0.0
            for t in range(tokens.shape[1] - 1):
                y = int(tokens[0, t + 1])
                per_tok.append(-float(lp[t, y]))
                if lr is not None:
                    excess += max(-float(lp[t, y]) + float(lr[t, y]), 0.0)
            out.append((int(micro["domain"][i]), sum(per_tok) / len(per_tok), excess, float(len(per_tok))))
    return out


def _run(data: str, steps: int, method: str, options: dict, resume: dict | None = None, truth: list | None = None,
         alpha_every: int = 4) -> dict:
    mixer = _mixer(data)
    model = _model(0)
    ref = None
    if "reference" in options:
        ref = _model(99)
        ref.load_state_dict(torch.load(options["reference"]))
        ref.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctl = GrapeController(mixer, [], method=method, alpha_every=alpha_every, options=options)
    first = 1
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        mixer.load_state_dict(resume["mixer"])
        ctl.load_state_dict(resume["grape"])
        first = resume["step"] + 1
    ctl.start()
    loader = iter(mixer.dataloader(num_workers=0))
    try:
        for step in range(first, steps + 1):
            batch = next(loader)
            for half in (slice(0, 3), slice(3, 8)):  # gradient accumulation over two unequal micro-batches
                micro = map_tensors(batch, lambda t, h=half: t[h])
                if truth is not None:
                    truth.append((step, _slow_truth(model, ref, micro)))
                with ctl.observe(model, step, micro, optimizer=opt):
                    (per_sample_lm_loss(model, micro).mean() * (micro["tokens"].shape[0] / 8)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ctl.maybe_update(model, step, lr=3e-3, optimizer=opt)
        return {"step": steps, "model": model.state_dict(), "opt": opt.state_dict(), "mixer": mixer.state_dict(),
                "grape": ctl.state_dict(), "history": ctl.history}
    finally:
        mixer.close()


def _slow_doremi(alpha: list[float], excess: list[float], eta: float, c: float) -> list[float]:
    """Algorithm 1's update written out one domain at a time."""
    k = len(alpha)
    raw = [alpha[i] * math.exp(eta * excess[i]) for i in range(k)]
    total = sum(raw)
    return [(1 - c) * raw[i] / total + c / k for i in range(k)]


def test_sums_are_exact_per_sample_and_doremi_is_algorithm_1(data, reference) -> None:
    truth: list = []
    out = _run(data, 8, "doremi", {"reference": reference, "eta": 3.0, "smoothing": 0.01}, truth=truth)
    updates = [r for r in out["history"] if not r.get("initial")]
    assert [r["step"] for r in updates] == [4, 8]
    alpha, running = [1 / 3] * 3, []
    for rec in updates:
        rows = [row for step, micro in truth if rec["step"] - 4 < step <= rec["step"] for row in micro]
        for k in range(3):
            mine = [r for r in rows if r[0] == k]
            assert rec["domain_samples"][k] == len(mine)
            assert rec["domain_loss"][k] == pytest.approx(sum(r[1] for r in mine) / len(mine), rel=1e-5)
            assert rec["domain_excess"][k] == pytest.approx(sum(r[2] for r in mine) / sum(r[3] for r in mine),
                                                            rel=1e-4, abs=1e-6)
        excess = [sum(r[2] for r in rows if r[0] == k) / sum(r[3] for r in rows if r[0] == k) for k in range(3)]
        alpha = _slow_doremi(alpha, excess, 3.0, 0.01)
        running.append(alpha)
        np.testing.assert_allclose(rec["alpha"], alpha, rtol=1e-4)
        np.testing.assert_allclose(rec["average_alpha"], np.mean(running, axis=0), rtol=1e-4)
    assert max(updates[-1]["domain_excess"]) > 0 and updates[-1]["alpha"] != [1 / 3] * 3


@pytest.mark.parametrize("method", LOSS_METHODS)
def test_checkpoint_mid_interval_resumes_onto_the_same_trajectory(data, reference, method) -> None:
    options = _options(method, reference)
    straight = _run(data, 10, method, options)
    half = _run(data, 6, method, options)  # step 6: two steps into the second interval
    assert half["grape"]["training_losses"]["steps"] == 2
    resumed = _run(data, 10, method, options, resume=half)
    a = [(r["step"], r["alpha"], r.get("domain_loss")) for r in straight["history"]]
    b = [(r["step"], r["alpha"], r.get("domain_loss")) for r in resumed["history"]]
    assert a == b and len(a) == 3
    for name, t in straight["model"].items():
        assert torch.equal(t, resumed["model"][name]), name


def test_refusals_are_one_line(data, reference, tmp_path: Path) -> None:
    mixer = _mixer(data)
    try:
        with pytest.raises(ConfigError, match="needs algorithm.options.reference"):
            GrapeController(mixer, [], method="doremi")
        with pytest.raises(ConfigError, match="no reference model file"):
            GrapeController(mixer, [], method="doremi", options={"reference": str(tmp_path / "nope.pt")})
        with pytest.raises(ConfigError, match="alignments: steps does not apply"):
            GrapeController(mixer, [], method="doremi", alignments="steps", options={"reference": reference})
        from grape_stream.recipe import load_recipe

        with pytest.raises(ConfigError, match="alignments: steps does not apply"):  # at recipe load already
            load_recipe({"data": {"local": data, "domains": DOMAINS},
                         "algorithm": {"method": "doremi", "alignments": "steps"}})
        ctl = GrapeController(mixer, [], method="doremi", options={"reference": reference})
        model = _model(0)
        with pytest.raises(ConfigError, match="'domain' column"):
            with ctl.observe(model, 1, {"tokens": torch.zeros(2, SEQ, dtype=torch.long)}):
                pass
        batch = {"tokens": torch.zeros(2, SEQ, dtype=torch.long), "domain": torch.tensor([0, 1])}
        with pytest.raises(ConfigError, match="saw no per-sample training loss"):
            with ctl.observe(model, 1, batch):
                model(batch["tokens"][:, :-1]).mean().backward()
        bad = tmp_path / "other.pt"
        torch.save({"w": torch.zeros(3)}, bad)
        ctl = GrapeController(mixer, [], method="doremi", options={"reference": str(bad)})
        with pytest.raises(ConfigError, match="does not fit the training model"):
            with ctl.observe(model, 1, batch):
                per_sample_lm_loss(model, batch)
        ctl = GrapeController(mixer, [], method="doremi", options={"reference": reference}, alpha_every=1)
        with pytest.raises(ConfigError, match="saw no training losses"):
            ctl.maybe_update(model, 1, 1e-3)
    finally:
        mixer.close()


def test_doremi_options_state_and_the_final_weights(tmp_path: Path) -> None:
    import json

    from grape_stream.grape.reweighting import DomainLosses, average_alpha_from_trajectory, build_reweighter

    with pytest.raises(ConfigError, match="eta must be a positive number"):
        build_reweighter("doremi", 3, 1, eta=0.0)
    with pytest.raises(ConfigError, match="smoothing must lie in"):
        build_reweighter("doremi", 3, 1, smoothing=1.5)
    r = build_reweighter("doremi", 3, 1, reference="ref.pt", eta=1.0, smoothing=0.0)
    steps = [np.array([1.0, 0.0, np.nan]), np.array([0.0, 2.0, 0.5]), np.array([0.0, 0.0, np.nan])]
    for excess in steps:
        r.update_from_losses(DomainLosses(np.ones(3), np.array([2, 2, 0 if np.isnan(excess[2]) else 2]),
                                          excess=excess), None)
    first = np.exp([1.0, 0.0, 0.0]) / np.exp([1.0, 0.0, 0.0]).sum()  # no token of domain 2: lambda 0
    second = first * np.exp([0.0, 2.0, 0.5]) / (first * np.exp([0.0, 2.0, 0.5])).sum()
    third = second * np.exp([0.0, 0.0, 0.5]) / (second * np.exp([0.0, 0.0, 0.5])).sum()  # domain 2: its last lambda
    np.testing.assert_allclose(r.alpha, third, rtol=1e-12)
    np.testing.assert_allclose(r.history[-1]["average_alpha"], (first + second + third) / 3, rtol=1e-12)
    other = build_reweighter("doremi", 3, 1, reference="ref.pt", eta=1.0, smoothing=0.0)
    other.load_state_dict(json.loads(json.dumps(r.state_dict())))
    assert other.average_alpha.tolist() == r.average_alpha.tolist()
    path = tmp_path / "traj.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [{"type": "meta"}, {"type": "update", "step": 0},
                                                       {"type": "update", "average_alpha": [0.2, 0.8]}]))
    assert average_alpha_from_trajectory(path) == [0.2, 0.8]
