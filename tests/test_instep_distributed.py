"""In-step alignments under DDP: two real gloo processes, gradient accumulation with no_sync, per-domain
sums and weights all-reduced, against one autograd.grad per domain over both ranks' samples (float64)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from _alignment_helpers import gpt, lm_groups
from _instep_helpers import directions, rel, truth
from _parallel import spawn
from grape_stream.grape.gram.batches import concat, map_tensors
from grape_stream.grape.gram.instep import StepAlignments
from grape_stream.models import per_sample_lm_loss

K, B, MICRO = 3, 6, 4


def _batch(rank: int) -> dict:
    batch = concat(lm_groups([B], seed=50 + rank))
    batch["domain"] = torch.tensor([[2, 0, 1, 0, 2, 2], [1, 1, 0, 2, 0, 0]][rank])
    return batch


def _worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        model = gpt(torch.float64, seed=0)
        ddp = nn.parallel.DistributedDataParallel(model)
        sa = StepAlignments(ddp, per_sample_lm_loss, K)
        sa.set_directions(directions(model))
        batch = _batch(rank)
        for a in range(0, B, MICRO):  # Composer's pattern: no_sync until the last micro-batch
            mb = map_tensors(batch, lambda t, a=a: t[a : a + MICRO])
            n = int(mb["domain"].shape[0])
            sync = contextlib.nullcontext() if a + MICRO >= B else ddp.no_sync()
            with sync, sa.observe(mb):
                (per_sample_lm_loss(ddp, mb).mean() * (n / B)).backward()
        local = (sa.sums.clone(), sa.weights.clone())
        sa.reduce()
        torch.save({"local": local, "sums": sa.sums, "weights": sa.weights, "samples": sa.samples,
                    "grads": [p.grad for p in model.parameters()]}, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_sum_to_the_alignments_of_all_samples(tmp_path: Path) -> None:
    spawn(_worker, args=(2, str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert not torch.equal(r0["local"][0], r1["local"][0])  # each rank saw its own samples
    for key in ("sums", "weights", "samples"):
        assert torch.equal(r0[key], r1[key])  # identical on every rank after the all-reduce
    model = gpt(torch.float64, seed=0)
    both = concat([_batch(0), _batch(1)])
    want = truth(model, per_sample_lm_loss, both, both["domain"], directions(model), K)
    assert rel(r0["sums"] / r0["weights"].unsqueeze(1), want) <= 1e-10
    assert torch.equal(r0["samples"], torch.bincount(both["domain"], minlength=K).double())
    model.zero_grad()
    (per_sample_lm_loss(model, both).mean()).backward()  # DDP's average of two equal-size ranks
    for got, p in zip(r0["grads"], model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-15)


def _probe_worker(rank: int, world: int, tmp: str) -> None:
    import numpy as np

    from grape_stream.grape.instep_probe import task_probe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        model = gpt(torch.float64, seed=1)
        fixed = directions(model, 1, seed=4)
        out = {}
        for keep in (True, False):
            probe = task_probe(model, per_sample_lm_loss, lm_groups([2, 3], seed=70 + rank), fixed=fixed,
                               coefficients=lambda losses, r, gram: np.exp(-r[:, 0]) / losses, keep_gradients=keep)
            out[keep] = {"losses": probe.losses, "r": probe.alignments, "c": probe.coefficients,
                         "v": [probe.direction[p] for p in model.parameters()]}
        torch.save(out, os.path.join(tmp, f"probe{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_task_probe_over_two_ranks_is_the_probe_of_all_samples(tmp_path: Path) -> None:
    import numpy as np

    spawn(_probe_worker, args=(2, str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"probe{r}.pt", weights_only=False) for r in (0, 1))
    model = gpt(torch.float64, seed=1)
    fixed = directions(model, 1, seed=4)
    params = list(model.parameters())
    groups = [concat([lm_groups([2, 3], seed=70 + r)[n] for r in (0, 1)]) for n in range(2)]  # task n, both ranks
    grads, losses = [], []
    for g in groups:
        loss = per_sample_lm_loss(model, g).mean()
        grads.append(torch.autograd.grad(loss, params))
        losses.append(float(loss.detach()))
    r = np.array([sum(float((a * fixed[0][p]).sum()) for a, p in zip(gr, params)) for gr in grads])
    c = np.exp(-r) / np.array(losses)
    for keep in (True, False):
        got = r0[keep]
        assert all(np.array_equal(got[k], r1[keep][k]) for k in ("losses", "r", "c"))  # every rank agrees
        np.testing.assert_allclose(got["losses"], losses, rtol=1e-13)
        np.testing.assert_allclose(got["r"][:, 0], r, rtol=1e-10)
        np.testing.assert_allclose(got["c"], c, rtol=1e-10)
        for i in range(len(params)):
            want = sum(float(c[n]) * grads[n][i] for n in range(2))
            assert float((got["v"][i] - want).abs().max()) <= 1e-10 * float(want.abs().max())
