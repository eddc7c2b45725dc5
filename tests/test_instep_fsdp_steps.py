"""``alignments: steps`` under FSDP, for real: 2 gloo processes shard our GPT (tied embeddings) with FSDP2's
``fully_shard`` and with FSDP1 (``use_orig_params=True``); the task probe keeps its task parts, r, S and the
target direction as shards (grape/instep_probe_shards.py, grape/gram/shard_layout.py). The reference is
computed here, in the single test process without torch.distributed, on the unsharded model from explicit
per-task autograd gradients of each rank's probe
samples (float64, rel 1e-10), under DDP's convention: each rank's probe, averaged over the ranks (the task
Gram: the mean of the ranks' Grams, not the Gram of the mean). One spawned process group runs every case (CI
has 2 cores): the task probe itself (losses, r, S, c, v; ``.grad`` and an accumulating step untouched), GRAPE
and DoGE+PCGrad through GrapeController's ``alignments: steps`` (2 micro-batches per step, SGD momentum as
the update direction d; GRAPE also with AdamW and the Adam geometry, d and v preconditioned on the shards),
HSDP (a 2-D mesh: each shard on two ranks, counted once), and ``keep_gradients=False`` refused in one line.
FSDP1 runs the task probe and GRAPE (SGD momentum, and AdamW with the Adam geometry); DoGE+PCGrad only differs
from GRAPE in its reweighting, so it runs under FSDP2 only (CI has 2 cores).
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
from _grape_data import SEQ, write_dataset
from _instep_helpers import directions, fsdp2, grad_sync, run_two_ranks, shard, truth
from grape_stream import DomainStream, GrapeController, TaskStream, WeightedStreamingMixer
from grape_stream.grape.gram.batches import concat, map_tensors
from grape_stream.grape.gram.shard_layout import shard_layouts
from grape_stream.grape.instep_probe import task_probe
from grape_stream.grape.probes import pad_groups
from grape_stream.models import per_sample_lm_loss

pytestmark = pytest.mark.integration

K, B, MICRO, LR = 3, 6, 4, 0.5
DOMAINS, TASKS = ["d0", "d1", "d2"], ["t0", "t1"]
ROWS = [[2, 0, 1, 0, 2, 2], [1, 1, 0, 2, 0, 0]]
METHODS = {"grape": {"method": "grape", "mu_alpha": 0.3, "mu_z": 0.3},
           "doge_pcgrad": {"method": "doge_pcgrad", "mu_alpha": 0.3},
           "grape_adam": {"method": "grape", "mu_alpha": 0.3, "mu_z": 0.3, "geometry": "adam"}}


def _optimizer(params: Any, method: str) -> torch.optim.Optimizer:
    """SGD with momentum (d: its buffer), or AdamW for the Adam geometry (d and v preconditioned)."""
    if METHODS[method].get("geometry") == "adam":
        return torch.optim.AdamW(params, lr=LR / 50)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _coefficients(losses: np.ndarray, r: np.ndarray, gram: Any) -> np.ndarray:
    """Depends on l, r and S, so every one of them must be right for v to be."""
    return np.exp(-r[:, 0]) / losses + 0.1 * np.asarray(gram).sum(axis=1) / np.trace(gram)


def _batch(rank: int, step: int) -> dict:
    batch = concat(lm_groups([B], seed=60 + 10 * step + rank))
    batch["domain"] = torch.tensor(ROWS[rank])
    return batch


def _micro(model: nn.Module, batch: dict, a: int) -> None:
    mb = map_tensors(batch, lambda t: t[a: a + MICRO])
    (per_sample_lm_loss(model, mb).mean() * (mb["tokens"].shape[0] / B)).backward()


def _local(g: Any) -> Any:
    return None if g is None else (g.to_local() if hasattr(g, "to_local") else g).clone()


def _whole(model: nn.Module, direction: dict) -> list[torch.Tensor]:
    """Each parameter's direction gathered whole (FSDP2: the DTensor; FSDP1: every rank's piece)."""
    pieces = shard_layouts(model)
    return [pieces[id(p)].gather(direction[p].unsqueeze(0))[0] if id(p) in pieces else direction[p]
            for p in model.parameters()]


def _held_like(model: nn.Module, direction: dict) -> bool:
    """Every direction held as its parameter is: a DTensor placed like it (FSDP2), or a plain tensor of the
    parameter's local shape, this rank's piece (FSDP1)."""
    return all((type(v).__name__ == "DTensor" and v.placements == p.placements) if type(p).__name__ == "DTensor"
               else (type(v).__name__ != "DTensor" and v.shape == p.shape) for p, v in direction.items())


def _probe(rank: int, world: int, kind: str) -> dict:
    """The task probe between two accumulated micro-batches (gradient sync off on the first)."""
    fixed = directions(gpt(torch.float64, seed=1), 1, seed=4)
    names = [n for n, _ in gpt(torch.float64, seed=1).named_parameters()]
    fixed_named = [{n: t for n, t in zip(names, fixed[0].values())}]
    out: dict[str, Any] = {}
    for probed in (False, True):
        model = shard(gpt(torch.float64, seed=1), kind, world)
        with grad_sync(model, False):
            _micro(model, _batch(rank, 0), 0)
        if probed:
            before = [_local(p.grad) for p in model.parameters()]
            probe = task_probe(model, per_sample_lm_loss, lm_groups([2, 3], seed=70 + rank), fixed=fixed_named,
                               coefficients=_coefficients)
            out["grad_kept"] = all((b is None and p.grad is None) or (b is not None and torch.equal(_local(p.grad), b))
                                   for p, b in zip(model.parameters(), before))
            out.update(losses=probe.losses, r=probe.alignments, gram=probe.task_gram, c=probe.coefficients,
                       sharded=_held_like(model, probe.direction), v=_whole(model, probe.direction))
        with grad_sync(model, True):
            _micro(model, _batch(rank, 0), MICRO)
        out["grads" if probed else "plain"] = [_local(p.grad) for p in model.parameters()]
    if kind == "fsdp1":
        return out
    model = fsdp2(gpt(torch.float64, seed=1), world, hsdp=True)  # each shard held by 2 ranks: counted once
    probe = task_probe(model, per_sample_lm_loss, lm_groups([2, 3], seed=70 + rank), fixed=fixed_named,
                       coefficients=_coefficients)
    out["hsdp"] = {"r": probe.alignments, "gram": probe.task_gram,
                   "v": [probe.direction[p].full_tensor() for p in model.parameters()]}  # type: ignore[attr-defined]
    return out


def _controller(rank: int, world: int, data: str, method: str, kind: str = "fsdp2") -> dict:
    mixer = WeightedStreamingMixer(domains=[DomainStream(d, local=f"{data}/{d}", split="train") for d in DOMAINS],
                                   batch_size=12, seed=0)
    tasks = [TaskStream(t, local=f"{data}/tasks/{t}") for t in TASKS]
    try:
        model = shard(gpt(torch.float64, seed=0, seq_len=SEQ), kind, world)
        opt = _optimizer(model.parameters(), method)
        grape = GrapeController(mixer, tasks, probe_task_batch=3, alpha_every=2, z_every=2, alignments="steps",
                                alignment_steps=1, **METHODS[method])
        grape.start()
        rec = None
        for step in (1, 2):
            batch = _batch(rank, step)
            for a in range(0, B, MICRO):
                mb = map_tensors(batch, lambda t, a=a: t[a: a + MICRO])
                with grad_sync(model, a + MICRO >= B), grape.observe(model, step, mb, optimizer=opt):
                    (per_sample_lm_loss(model, mb).mean() * (mb["tokens"].shape[0] / B)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec = grape.maybe_update(model, step, lr=LR, optimizer=opt)
        state = grape.signal.alignments.state_dict()  # type: ignore[union-attr]  # (gathered whole: every rank)
        return {"rec": rec, "alpha": grape.alpha, "z": grape.reweighter.z, "v": state["directions"]}
    finally:
        mixer.close()


def _refusals(world: int) -> dict:
    from grape_stream.errors import ConfigError

    out = {}
    try:
        task_probe(fsdp2(gpt(torch.float64, seed=0), world), per_sample_lm_loss, lm_groups([2, 2]), fixed=[],
                   coefficients=_coefficients, keep_gradients=False)
    except ConfigError as err:
        out["keep"] = str(err)
    return out


FSDP1_METHODS = ("grape", "grape_adam")


def _worker(rank: int, world: int, tmp: str, data: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        out = {"probe": {k: _probe(rank, world, k) for k in ("fsdp2", "fsdp1")}, "refused": _refusals(world),
               **{(m, "fsdp2"): _controller(rank, world, data, m) for m in METHODS},
               **{(m, "fsdp1"): _controller(rank, world, data, m, "fsdp1") for m in FSDP1_METHODS}}
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _task_grads(model: nn.Module, groups: list[dict]) -> tuple[list[torch.Tensor], list[float]]:
    """Each group's mean-loss gradient (flat) and mean loss: the definition, one autograd.grad per group."""
    params = list(model.parameters())
    flat, losses = [], []
    for g in groups:
        loss = per_sample_lm_loss(model, g).mean()
        flat.append(torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)]))
        losses.append(float(loss.detach()))
    return flat, losses


def _rank_probe(model: nn.Module, per_rank: list[list[dict]]) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(H: (N, P) the ranks' mean task gradients, losses over all samples, S: the mean of the ranks' Grams)."""
    hs, losses = zip(*(_task_grads(model, groups) for groups in per_rank))
    stacks = [torch.stack(h) for h in hs]
    gram = sum(s @ s.t() for s in stacks) / len(stacks)
    return sum(stacks) / len(stacks), np.mean(np.array(losses), axis=0), gram.numpy()


def _rel(got: Any, want: Any) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


def _check_probe(r0: dict, r1: dict, kind: str) -> None:
    model = gpt(torch.float64, seed=1)
    fixed = directions(model, 1, seed=4)[0]
    u = torch.cat([t.reshape(-1) for t in fixed.values()])
    h, losses, gram = _rank_probe(model, [lm_groups([2, 3], seed=70 + r) for r in (0, 1)])
    r = (h @ u).numpy()[:, None]
    c = _coefficients(losses, r, gram)
    for key in ("losses", "r", "gram", "c"):
        assert np.array_equal(r0[key], r1[key])  # every rank agrees
    assert _rel(r0["losses"], losses) <= 1e-12
    assert _rel(r0["r"], r) <= 1e-10 and _rel(r0["gram"], gram) <= 1e-10 and _rel(r0["c"], c) <= 1e-10
    v = torch.cat([t.reshape(-1) for t in r0["v"]])
    assert _rel(v, torch.tensordot(torch.as_tensor(c), h, dims=1)) <= 1e-10
    if kind == "fsdp2":
        hsdp = r0["hsdp"]
        assert _rel(hsdp["r"], r) <= 1e-10 and _rel(hsdp["gram"], gram) <= 1e-10
        assert _rel(torch.cat([t.reshape(-1) for t in hsdp["v"]]),
                    torch.tensordot(torch.as_tensor(c), h, dims=1)) <= 1e-10
    assert r0["sharded"] and r1["sharded"] and r0["grad_kept"] and r1["grad_kept"]
    for r_ in (r0, r1):  # the step's gradients: bitwise those of the same step without the probe
        assert all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                   for a, b in zip(r_["grads"], r_["plain"]))  # (FSDP1: None where this rank holds no piece)
        assert sum(a is not None for a in r_["grads"]) > 0


def _reference(data: str, method: str) -> dict:
    """The update at step 2 from the definition: model after steps 1 and 2 (SGD momentum on the mean loss of
    both ranks' samples), the first direction from the step-2 task probe at the model after step 1, b from
    one autograd.grad per domain of step 2's batch, then the method's own score -> weight -> c rules."""
    mixer = WeightedStreamingMixer(domains=[DomainStream(d, local=f"{data}/{d}", split="train") for d in DOMAINS],
                                   batch_size=12, seed=0)
    try:
        ctl = GrapeController(mixer, [TaskStream(t, local=f"{data}/tasks/{t}") for t in TASKS], probe_task_batch=3,
                              alpha_every=2, z_every=2, alignments="steps", alignment_steps=1, **METHODS[method])
        groups = [ctl.probe.groups(2, r, 2, torch.device("cpu"), tasks_only=True) for r in (0, 1)]
    finally:
        mixer.close()
    length = max(g["tokens"].shape[1] for gs in groups for g in gs)
    groups = [pad_groups(gs, length) for gs in groups]
    rw = ctl.reweighter
    model = gpt(torch.float64, seed=0, seq_len=SEQ)
    params = list(model.parameters())
    opt = _optimizer(params, method)

    def train(step: int) -> None:
        per_sample_lm_loss(model, concat([_batch(0, step), _batch(1, step)])).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def unflat(v: torch.Tensor) -> dict:
        out, at = {}, 0
        for p in params:
            out[p] = v[at: at + p.numel()].reshape(p.shape)
            at += p.numel()
        return out

    def pre() -> torch.Tensor:  # Adam's 1 / (sqrt(v_hat) + eps), flat (ones in the paper's geometry)
        if METHODS[method].get("geometry") != "adam":
            return torch.ones(sum(p.numel() for p in params), dtype=torch.float64)
        state = [opt.state[p] for p in params]
        beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
        return torch.cat([1 / ((st["exp_avg_sq"] / (1 - beta2 ** float(st["step"]))).sqrt() + eps).reshape(-1)
                          for st in state])

    def first_moment() -> torch.Tensor:
        if isinstance(opt, torch.optim.SGD):
            return torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in params])
        beta1 = opt.param_groups[0]["betas"][0]
        return torch.cat([(opt.state[p]["exp_avg"] / (1 - beta1 ** float(opt.state[p]["step"]))).reshape(-1)
                          for p in params])

    train(1)
    h, losses, gram = _rank_probe(model, groups)
    v1 = torch.tensordot(torch.as_tensor(rw.target_coefficients(losses, gram)), h, dims=1) * pre()
    both = concat([_batch(0, 2), _batch(1, 2)])
    b = truth(model, per_sample_lm_loss, both, both["domain"], [unflat(v1)], K)[:, 0].numpy()
    train(2)
    h, losses, gram = _rank_probe(model, groups)
    r = (h @ (first_moment() * pre())).numpy() if rw.moves_z else np.zeros(len(TASKS))
    a, ema = rw.task_scores(r, losses)
    rw.update_from_scores(a, b, losses, LR, step=2, loss_ema=ema)
    c = rw.target_coefficients(losses, gram)
    return {"losses": losses, "b": b, "a": a, "alpha": rw.alpha, "z": rw.z,
            "v": torch.tensordot(torch.as_tensor(c), h, dims=1) * pre()}


def test_fsdp_alignments_steps_equal_the_unsharded_computation(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=32, n_val=16, n_test=4)
    r0, r1 = run_two_ranks(_worker, tmp_path, data)

    for kind in ("fsdp2", "fsdp1"):
        _check_probe(r0["probe"][kind], r1["probe"][kind], kind)

    names = [n for n, _ in gpt(torch.float64, seed=0, seq_len=SEQ).named_parameters()]
    runs = [(m, "fsdp2") for m in METHODS] + [(m, "fsdp1") for m in FSDP1_METHODS]
    wants = {m: _reference(data, m) for m in METHODS}
    for method, kind in runs:
        g0, g1 = r0[(method, kind)], r1[(method, kind)]
        assert g0["rec"]["task_loss"] == g1["rec"]["task_loss"] and np.array_equal(g0["alpha"], g1["alpha"])
        want = wants[method]
        assert _rel(g0["rec"]["task_loss"], want["losses"]) <= 1e-10, (method, kind)
        assert _rel(g0["rec"]["domain_alignment"], want["b"]) <= 1e-10, (method, kind)
        if method != "doge_pcgrad":  # (DoGE reads no task alignment)
            assert _rel(g0["rec"]["task_alignment"], want["a"]) <= 1e-10, (method, kind)
        assert _rel(g0["alpha"], want["alpha"]) <= 1e-10 and _rel(g0["z"], want["z"]) <= 1e-10, (method, kind)
        assert not np.allclose(g0["alpha"], 1.0 / K)  # the weights moved
        v = torch.cat([g0["v"][n][0].reshape(-1) for n in names])  # (checkpointed under the unwrapped names)
        assert _rel(v, want["v"]) <= 1e-10, (method, kind)

    for r in (r0, r1):
        assert "keep_gradients=False" in r["refused"]["keep"] and "\n" not in r["refused"]["keep"]
