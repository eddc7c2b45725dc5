"""In-step alignments and R&B's step Gram on an FSDP-sharded model, for real: 2 gloo processes shard our GPT
(tied embeddings) with FSDP2's ``fully_shard`` and with FSDP1 (``use_orig_params=True``) and observe the training
step's own backward (grape/gram/shard_layout.py: directions and kept parts sharded like the parameters).
The reference is computed here, in the single test
process without torch.distributed, on the unsharded model: one autograd.grad per domain over both ranks'
samples (float64, rel 1e-10). One spawned process group runs every case (CI has 2 cores): the alignments
with gradient accumulation and the step's gradients against the same FSDP2 step unobserved; R&B's Gram and
alpha over two steps through GrapeController, with a checkpoint (state gathered whole, loaded into a fresh
controller) between them; FSDP1's hybrid sharding refused in one line. ``alignments: steps`` (its task probe)
under FSDP: tests/test_instep_fsdp_steps.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _alignment_helpers import gpt, lm_groups
from _grape_data import write_dataset
from _instep_helpers import directions, fsdp1, fsdp2, grad_sync, local_grads, rel, run_two_ranks, shard, truth
from grape_stream import DomainStream, GrapeController, WeightedStreamingMixer
from grape_stream.grape.gram.batches import concat, map_tensors
from grape_stream.grape.gram.instep import StepAlignments
from grape_stream.grape.reweighting import build_reweighter
from grape_stream.models import per_sample_lm_loss

pytestmark = pytest.mark.integration

K, B, MICRO = 3, 6, 4
DOMAINS = ["d0", "d1", "d2"]
ROWS = [[2, 0, 1, 0, 2, 2], [1, 1, 0, 2, 0, 0]]  # rank 0 and rank 1: every rank lacks no domain, sizes differ


def _batch(rank: int, step: int = 0) -> dict:
    batch = concat(lm_groups([B], seed=60 + 10 * step + rank))
    batch["domain"] = torch.tensor(ROWS[rank])
    return batch


def _step(model: nn.Module, batch: dict, observe: Any) -> None:
    """One training step's backward in two micro-batches (4 + 2 samples), no gradient sync on the first."""
    for a in range(0, B, MICRO):
        mb = map_tensors(batch, lambda t, a=a: t[a: a + MICRO])
        last = a + MICRO >= B
        with grad_sync(model, last), observe(mb):
            (per_sample_lm_loss(model, mb).mean() * (mb["domain"].shape[0] / B)).backward()


def _named(dirs: list[dict], model: nn.Module) -> list[dict[str, torch.Tensor]]:
    return [{n: u[p] for n, p in model.named_parameters()} for u in dirs]


def _alignments(rank: int, world: int, kind: str) -> dict:
    plain = shard(gpt(torch.float64, seed=0), kind, world)
    _step(plain, _batch(rank), lambda mb: _nothing())
    model = gpt(torch.float64, seed=0)
    dirs = _named(directions(model), model)
    model = shard(model, kind, world)
    sa = StepAlignments(model, per_sample_lm_loss, K)
    sa.set_directions(dirs)
    _step(model, _batch(rank), sa.observe)
    sa.reduce()
    state = sa.state_dict()
    return {"sums": sa.sums, "weights": sa.weights, "samples": sa.samples,
            "dirs_back": all(torch.equal(state["directions"][n][d], dirs[d][n]) for n in dirs[0] for d in range(2)),
            "memory": sa.memory_elements(),
            "grads": local_grads(model), "plain": local_grads(plain)}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _rnb(rank: int, world: int, data: str, kind: str = "fsdp2", hsdp: bool = False) -> dict:
    mixer = WeightedStreamingMixer(domains=[DomainStream(d, local=f"{data}/{d}", split="train") for d in DOMAINS],
                                   batch_size=12, seed=0)
    try:
        model = fsdp2(gpt(torch.float64, seed=0), world, hsdp=hsdp) if kind == "fsdp2" else \
            fsdp1(gpt(torch.float64, seed=0))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        grape = GrapeController(mixer, [], method="rnb", alpha_every=2, alignment_steps=2)
        grape.start()
        rec = None
        for step in (1, 2):
            _step(model, _batch(rank, step), lambda mb, g=grape, step=step: g.observe(model, step, mb))
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec = grape.maybe_update(model, step, lr=0.5)
            if step == 1:  # a checkpoint mid-round: the sums gathered whole, loaded into a fresh controller
                state = grape.state_dict()
                grape = GrapeController(mixer, [], method="rnb", alpha_every=2, alignment_steps=2)
                grape.load_state_dict(state)
        return {"rec": rec, "alpha": grape.alpha}
    finally:
        mixer.close()


def _refusals(world: int) -> dict:
    from grape_stream.errors import ConfigError

    out = {}
    try:
        StepAlignments(fsdp1(gpt(torch.float64, seed=0), hybrid=True), per_sample_lm_loss, K)
    except ConfigError as err:
        out["fsdp1_hybrid"] = str(err)
    return out


def _worker(rank: int, world: int, tmp: str, data: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        out = {kind: {"alignments": _alignments(rank, world, kind), "rnb": _rnb(rank, world, data, kind)}
               for kind in ("fsdp2", "fsdp1")}
        out.update(rnb_hsdp=_rnb(rank, world, data, hsdp=True), refused=_refusals(world))
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _explicit(model: nn.Module, batch: dict, sums: list, counts: list) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    for k in range(K):
        mask = (batch["domain"] == k).to(torch.float64)
        if mask.sum() == 0:
            continue
        grads = torch.autograd.grad((per_sample_lm_loss(model, batch) * mask).sum(), params)
        flat = torch.cat([g.reshape(-1) for g in grads])
        sums[k] = flat if sums[k] is None else sums[k] + flat
        counts[k] += int(mask.sum())


def _check(r0: dict, r1: dict, kind: str, gram: np.ndarray, alpha: np.ndarray) -> None:
    # in-step alignments: each rank its own samples, sharded directions, one all-reduce
    a0, a1 = r0[kind]["alignments"], r1[kind]["alignments"]
    for key in ("sums", "weights", "samples"):
        assert torch.equal(a0[key], a1[key])
    model = gpt(torch.float64, seed=0)
    both = concat([_batch(0), _batch(1)])
    want = truth(model, per_sample_lm_loss, both, both["domain"], directions(model), K)
    assert rel(a0["sums"] / a0["weights"].unsqueeze(1), want) <= 1e-10, kind
    assert torch.equal(a0["samples"], torch.bincount(both["domain"], minlength=K).double())
    assert a0["dirs_back"] and a1["dirs_back"]  # state_dict gathers the sharded directions whole
    full = sum(p.numel() for p in model.parameters())
    assert a0["memory"] + a1["memory"] == 2 * full  # D=2 directions, each rank holds its shard only
    for r in (a0, a1):  # the step's own (sharded) gradients: as the unobserved FSDP step's, to rounding
        assert len(r["grads"]) == len(r["plain"])
        for got, plain in zip(r["grads"], r["plain"]):
            torch.testing.assert_close(got, plain, rtol=1e-12, atol=1e-15)

    # R&B: the Gram of the domains' mean gradients over both ranks' samples, two steps, alpha
    g0, g1 = r0[kind]["rnb"], r1[kind]["rnb"]
    assert g0["rec"]["domain_gram"] == g1["rec"]["domain_gram"] and np.array_equal(g0["alpha"], g1["alpha"])
    np.testing.assert_allclose(np.array(g0["rec"]["domain_gram"]), gram, rtol=1e-10)
    np.testing.assert_allclose(g0["alpha"], alpha, rtol=1e-10)


def _rnb_truth() -> tuple[np.ndarray, np.ndarray]:
    model = gpt(torch.float64, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sums: list = [None] * K
    counts = [0] * K
    for step in (1, 2):  # FSDP averages two equal-size ranks: the step on the 12 samples' mean loss
        both = concat([_batch(0, step), _batch(1, step)])
        _explicit(model, both, sums, counts)
        per_sample_lm_loss(model, both).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    gram = np.array([[float(sums[i] @ sums[j]) / (counts[i] * counts[j]) for j in range(K)] for i in range(K)])
    rw = build_reweighter("rnb", K, 1)  # (R&B reads no task: 1 is a placeholder)
    alpha, _ = rw.update_from_step_gram(gram, np.array(counts, dtype=np.float64), 0.5, step=2)
    return gram, alpha


def test_fsdp_instep_alignments_and_rnb_equal_the_unsharded_computation(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=32, n_val=8, n_test=4)
    r0, r1 = run_two_ranks(_worker, tmp_path, data)
    gram, alpha = _rnb_truth()
    for kind in ("fsdp2", "fsdp1"):
        _check(r0, r1, kind, gram, alpha)

    # HSDP (each shard held by both ranks): the same Gram and alpha, each shard counted once
    for r in (r0, r1):
        np.testing.assert_allclose(np.array(r["rnb_hsdp"]["rec"]["domain_gram"]), gram, rtol=1e-10)
        np.testing.assert_allclose(r["rnb_hsdp"]["alpha"], alpha, rtol=1e-10)

    # refusals, one line each
    for r in (r0, r1):
        msg = r["refused"]["fsdp1_hybrid"]
        assert "HYBRID_SHARD" in msg and "\n" not in msg
