"""R&B (method rnb): the per-domain Gram of the training steps against explicit per-domain autograd gradients
(float64, micro-batches, parameters moving between steps), the Balance update against a slow plain-Python
reading of the paper's equation, and a plain loop (real MDS data through the mixer) that checkpoints in the
middle of a round and resumes onto the uninterrupted trajectory."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from _alignment_helpers import gpt, lm_groups, one_thread  # noqa: F401  (autouse: one torch thread)
from _grape_data import SEQ, VOCAB, write_dataset
from grape_stream import DomainStream, GrapeController, WeightedStreamingMixer
from grape_stream.errors import ConfigError
from grape_stream.grape.gram.batches import concat, map_tensors
from grape_stream.grape.gram.instep import StepAlignments
from grape_stream.grape.gram.instep_grads import PartStore
from grape_stream.grape.instep_gram import gram_of_sums
from grape_stream.grape.reweighting import build_reweighter, rnb_step
from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss

K = 3
DOMAINS = ["d0", "d1", "d2"]


# ------------------------------------------------------------------------------------------ the Balance step
def _slow_rnb(gram: list[list[float]], p: list[float], lam: float) -> list[float]:
    """The paper's p' = softmax(lambda G p / ||G p||_2), one loop at a time."""
    k = len(p)
    s = [sum(gram[i][j] * p[j] for j in range(k)) for i in range(k)]
    norm = math.sqrt(sum(v * v for v in s))
    e = [math.exp(lam * v / norm) for v in s]
    return [v / sum(e) for v in e]


@pytest.mark.parametrize("lam, p", [(3.0, None), (0.5, [0.5, 0.2, 0.2, 0.1]), (10.0, [0.1, 0.1, 0.1, 0.7])])
def test_update_is_the_papers_softmax(lam: float, p: list[float] | None) -> None:
    rng = np.random.default_rng(1)
    vecs = rng.normal(size=(4, 6))
    gram = vecs @ vecs.T
    rw = build_reweighter("rnb", 4, 1, rnb_lambda=lam, eval_weights=p)
    for round_ in range(2):  # each round overwrites the mixture: the second depends on its own Gram only
        g = gram * (round_ + 1) ** 2
        alpha, _ = rw.update_from_step_gram(g, [5, 5, 5, 5], lr=1e-3, step=round_ + 1)
        want = _slow_rnb(g.tolist(), p or [0.25] * 4, lam)
        np.testing.assert_allclose(alpha, want, rtol=1e-13, atol=0)
    assert rw.history[-1]["b"] is not None and rw.num_updates == 2


def test_unseen_domain_counts_as_a_zero_gradient_and_a_zero_gp_skips() -> None:
    gram = np.array([[2.0, 1.0, np.nan], [1.0, 3.0, np.nan], [np.nan, np.nan, np.nan]])
    rw = build_reweighter("rnb", 3, 1)
    alpha, _ = rw.update_from_step_gram(gram, [4, 4, 0])
    want = _slow_rnb([[2.0, 1.0, 0.0], [1.0, 3.0, 0.0], [0.0, 0.0, 0.0]], [1 / 3] * 3, 3.0)
    np.testing.assert_allclose(alpha, want, rtol=1e-13)
    before = rw.alpha
    after, _ = rw.update_from_step_gram(np.zeros((3, 3)), [1, 1, 1])
    assert np.array_equal(before, after) and "zero" in rw.history[-1]["skipped"]
    with pytest.raises(ConfigError, match="rnb_lambda"):
        build_reweighter("rnb", 3, 1, rnb_lambda=-1)
    with pytest.raises(ConfigError, match="eval_weights"):
        build_reweighter("rnb", 3, 1, eval_weights=[0.5, 0.5])


def test_pure_step_and_state_round_trip() -> None:
    g = np.array([[4.0, -1.0], [-1.0, 1.0]])
    log_alpha, exponent, why = rnb_step(g, np.array([0.5, 0.5]), 2.0)
    assert why is None and np.allclose(np.exp(log_alpha), _slow_rnb(g.tolist(), [0.5, 0.5], 2.0))
    rw = build_reweighter("rnb", 2, 1)
    rw.update_from_step_gram(g, [3, 3])
    again = build_reweighter("rnb", 2, 1)
    again.load_state_dict(rw.state_dict())
    assert np.array_equal(again.alpha, rw.alpha) and again.num_updates == 1


# ------------------------------------------------------------------------------------------ the Gram engine
def _explicit(model, batch: dict, sums: list, counts: list, patterns: list[str] | None = None) -> None:
    """Add each domain's summed per-sample gradient (one autograd.grad per domain; only the parameters whose
    names match ``patterns``, when given) and its sample count."""
    import fnmatch

    params = [p for n, p in model.named_parameters() if p.requires_grad
              and (patterns is None or any(fnmatch.fnmatchcase(n, pat) for pat in patterns))]
    if not params:
        return
    for k in range(K):
        mask = (batch["domain"] == k).to(torch.float64)
        if mask.sum() == 0:
            continue
        grads = torch.autograd.grad((per_sample_lm_loss(model, batch) * mask).sum(), params, allow_unused=True)
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])
        sums[k] = flat if sums[k] is None else sums[k] + flat
        counts[k] += int(mask.sum())


@pytest.mark.parametrize("micro", [None, 3], ids=["one-batch", "micro-batches"])
def test_gram_of_two_steps_equals_explicit_per_domain_gradients(micro: int | None) -> None:
    model = gpt(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sa = StepAlignments(model, per_sample_lm_loss, K)
    sa.set_directions([])
    store = PartStore(K)
    sums: list = [None] * K
    counts = [0] * K
    weights = torch.zeros(K, dtype=torch.float64)
    for step, doms in enumerate(([2, 0, 1, 0, 2, 2, 1, 0], [1, 1, 0, 0, 1, 0, 1, 1])):  # step 2: no domain 2
        batch = concat(lm_groups([8], seed=step))
        batch["domain"] = torch.tensor(doms)
        _explicit(model, batch, sums, counts)
        width = micro or 8
        for a in range(0, 8, width):
            mb = map_tensors(batch, lambda t, a=a, w=width: t[a: a + w])
            with sa.observe(mb, store=store):
                (per_sample_lm_loss(model, mb).mean() * (mb["domain"].shape[0] / 8)).backward()
        weights += sa.weights.cpu()
        sa.reset()
        opt.step()  # the second step's gradients are taken at other parameters
        opt.zero_grad(set_to_none=True)
    got = gram_of_sums(store.grads, weights)
    want = np.full((K, K), np.nan)
    for i in range(K):
        for j in range(K):
            want[i, j] = float(sums[i] @ sums[j]) / (counts[i] * counts[j])
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=0)
    np.testing.assert_allclose(weights.numpy(), np.array(counts) / 8.0, rtol=1e-14)


# ------------------------------------------------------------------------------------------ the plain loop
def _run(data: str, steps: int, resume: dict | None, **options) -> dict:
    mixer = WeightedStreamingMixer(domains=[DomainStream(d, local=f"{data}/{d}", split="train") for d in DOMAINS],
                                   batch_size=8, seed=0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=16, d_ff=32)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    grape = GrapeController(mixer, [], **{"method": "rnb", "alpha_every": 4, "alignment_steps": 4, **options})
    first, explicit = 1, {"sums": [None] * K, "counts": [0] * K}
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        mixer.load_state_dict(resume["mixer"])
        grape.load_state_dict(resume["grape"])
        first = resume["step"] + 1
    grape.start()
    loader = iter(mixer.dataloader(num_workers=0))
    checks = []
    try:
        for step in range(first, steps + 1):
            batch = next(loader)
            if resume is None and grape.signal.observed(step):
                _explicit(model, batch, explicit["sums"], explicit["counts"], options.get("rnb_params"))
            for half in (slice(0, 3), slice(3, 8)):  # gradient accumulation over two unequal micro-batches
                micro = map_tensors(batch, lambda t, h=half: t[h])
                with grape.observe(model, step, micro, optimizer=opt):
                    (per_sample_lm_loss(model, micro).mean() * (micro["tokens"].shape[0] / 8)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec = grape.maybe_update(model, step, lr=3e-3, optimizer=opt)
            if rec is not None and resume is None:
                s, n = explicit["sums"], explicit["counts"]
                want = [[float(s[i] @ s[j]) / (n[i] * n[j]) if n[i] and n[j] else None for j in range(K)]
                        for i in range(K)]
                checks.append((rec["domain_gram"], want))
                explicit = {"sums": [None] * K, "counts": [0] * K}
        return {"step": steps, "model": model.state_dict(), "opt": opt.state_dict(), "mixer": mixer.state_dict(),
                "grape": grape.state_dict(), "checks": checks}
    finally:
        mixer.close()


def test_loop_gram_is_exact_and_a_mid_round_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=128, n_val=16, n_test=4)
    straight = _run(data, 12, None)
    for got, want in straight["checks"]:
        for gi, wi in zip(got, want):
            for g, w in zip(gi, wi):
                assert (w is None and math.isnan(g)) or abs(g - w) <= 1e-9 * abs(w) + 1e-15, (g, w)
    half = _run(data, 6, None)  # two of the second round's four steps are in the checkpoint's sums
    path = tmp_path / "half.pt"
    torch.save({k: v for k, v in half.items() if k != "checks"}, path)
    half = torch.load(path, weights_only=True)
    assert half["grape"]["instep"]["observed_steps"] == 2
    resumed = _run(data, 12, half)
    for k, v in straight["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
    keys = ("step", "alpha", "domain_gram", "domain_score")
    strip = lambda h: [tuple(str(r.get(k)) for k in keys) for r in h]  # noqa: E731 (no timings)
    assert strip(straight["grape"]["history"]) == strip(resumed["grape"]["history"])
    updates = [r for r in straight["grape"]["history"] if not r.get("initial")]
    assert [r["step"] for r in updates] == [4, 8, 12] and all(r.get("skipped") is None for r in updates)
    assert all(r["instep"]["observed_steps"] == 4 and sum(r["instep"]["samples"]) == 32 for r in updates)
    assert updates[-1]["alpha"] != straight["grape"]["history"][0]["alpha"]  # the mixture moved


def test_rnb_params_restrict_the_gram_to_matching_parameters(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=64, n_val=8, n_test=4)
    end = _run(data, 4, None, rnb_params=["blocks.0.fc.*", "ln_f.weight"])
    (got, want), = end["checks"]
    for gi, wi in zip(got, want):
        for g, w in zip(gi, wi):
            assert (w is None and math.isnan(g)) or abs(g - w) <= 1e-9 * abs(w) + 1e-15, (g, w)
    full = _run(data, 4, None)
    assert full["checks"][0][0] != got  # the whole gradient gives another Gram
    with pytest.raises(ConfigError, match="match no trainable parameter"):
        _run(data, 1, None, rnb_params=["lm_head.*"])


def test_rnb_needs_no_tasks_and_checks_its_options(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=32, n_val=8, n_test=4)
    end = _run(data, 2, None, alpha_every=2, alignment_steps=1)  # one observed step per round
    updates = [r for r in end["grape"]["history"] if not r.get("initial")]
    assert updates[0]["instep"]["observed_steps"] == 1
    with pytest.raises(ConfigError, match="rnb_lambda"):
        _run(data, 0, None, rnb_lambda=float("nan"))


# ------------------------------------------------------------------------------------------ two ranks
def _rank_batch(rank: int, step: int) -> dict:
    batch = concat(lm_groups([6], seed=60 + 10 * step + rank))
    batch["domain"] = torch.tensor([[2, 0, 1, 0, 2, 2], [1, 1, 0, 2, 0, 0]][rank])
    return batch


def _rank_worker(rank: int, world: int, tmp: str, data: str) -> None:
    import contextlib

    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    mixer = WeightedStreamingMixer(domains=[DomainStream(d, local=f"{data}/{d}", split="train") for d in DOMAINS],
                                   batch_size=12, seed=0)
    try:
        model = gpt(torch.float64, seed=0)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        grape = GrapeController(mixer, [], method="rnb", alpha_every=2, alignment_steps=2)
        grape.start()
        rec = None
        for step in (1, 2):
            batch = _rank_batch(rank, step)
            for a in range(0, 6, 4):  # no_sync until the last micro-batch, as Composer does
                mb = map_tensors(batch, lambda t, a=a: t[a: a + 4])
                sync = contextlib.nullcontext() if a + 4 >= 6 else ddp.no_sync()
                with sync, grape.observe(ddp, step, mb):
                    (per_sample_lm_loss(ddp, mb).mean() * (mb["domain"].shape[0] / 6)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec = grape.maybe_update(ddp, step, lr=0.5)
        torch.save({"rec": rec, "alpha": grape.alpha}, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        mixer.close()
        dist.destroy_process_group()


def test_two_ranks_give_the_gram_of_all_samples(tmp_path: Path) -> None:
    from _parallel import spawn

    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=32, n_val=8, n_test=4)
    spawn(_rank_worker, args=(2, str(tmp_path), data), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["rec"]["domain_gram"] == r1["rec"]["domain_gram"] and np.array_equal(r0["alpha"], r1["alpha"])
    model = gpt(torch.float64, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sums: list = [None] * K
    counts = [0] * K
    for step in (1, 2):  # DDP averages two equal-size ranks: the step on the 12 samples' mean loss
        both = concat([_rank_batch(0, step), _rank_batch(1, step)])
        _explicit(model, both, sums, counts)
        per_sample_lm_loss(model, both).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    want = np.array([[float(sums[i] @ sums[j]) / (counts[i] * counts[j]) for j in range(K)] for i in range(K)])
    np.testing.assert_allclose(np.array(r0["rec"]["domain_gram"]), want, rtol=1e-10)


def test_a_probe_gram_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="training steps"):
        build_reweighter("rnb", 2, 1).update(np.eye(3), [1.0], 1e-3)
