"""The alignment Gram of an FSDP-sharded model, for real: 2 and 4 gloo processes on CPU shard our GPT (tied
embeddings), an HF Llama and the MPT-style model with FSDP1 (use_orig_params) and FSDP2 (fully_shard), and
``group_gram`` probes the sharded model unit by unit (grape/gram/sharding.py), no replica. Each rank probes
its own samples; the reference is computed here, in the single test process without torch.distributed, on
the unsharded model: the average of the per-rank Grams (what DDP gives), then alignments, alpha and z.

One spawned process group per world size runs every check (CI has 2 cores): float64 exact (rel 1e-10),
float32 and bf16 mixed precision within stated tolerances, a probe between two accumulated micro-batches
that leaves the training step bitwise as without it, and the refusals, each one line.

With ``micro_batch_size`` the group gradients are summed over the ranks and kept sharded (grape/gram/shard_sums.py):
the Gram is that of the rank-mean group gradients, checked against explicit per-group autograd gradients of the
unsharded model on every rank's samples together (groups straddling micro-batches, several chunks per parameter).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _alignment_helpers import lm_groups
from _parallel import spawn
from grape_stream.grape.gram.group_gram import group_gram
from grape_stream.grape.reweighting import build_reweighter
from grape_stream.testing.families import FamilySize, build_family

pytestmark = pytest.mark.integration

SIZE = FamilySize(d_model=16, n_layer=2, n_head=2)  # vocab 300, 16 tokens: lm_groups' shapes
FAMILIES = ("gpt", "hf-llama", "mpt")
GROUPS = [2, 1, 2, 1, 2]  # K=3 domains, N=2 tasks per rank
K = 3
MICRO_GROUPS = [4, 3, 5, 3, 4]  # per rank; micro-batches of 3 straddle the groups
MICRO = 3
#: float32 sharded vs float64 unsharded: the Gram in float32 arithmetic (relative to its largest entry)
FP32_TOL = 1e-4
#: bf16 parameters and activations (FSDP mixed precision), float32 reductions: relative to the largest entry
BF16_TOL = 0.1


def _model(family: str, dtype: torch.dtype) -> tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor]]:
    model, loss, _ = build_family(family, SIZE, dtype=dtype, seed=0, real_mpt=False)
    return model.eval(), loss


def _blocks(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    return inner.layers if inner is not None and hasattr(inner, "layers") else model.blocks  # type: ignore


def _groups(rank: int) -> list[dict]:
    return lm_groups(GROUPS, seed=100 + rank)


def _shard(model: nn.Module, kind: str, world: int, mixed: bool = False, orig_params: bool = True) -> nn.Module:
    block = type(_blocks(model)[0])
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block}), use_orig_params=orig_params,
                                        device_id=torch.device("cpu"), mixed_precision=mp_policy)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    kw = {"mp_policy": policy} if policy is not None else {}
    for b in _blocks(model):
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _one_line(fn: Callable[[], Any]) -> str:
    from grape_stream.errors import UserFacingError

    try:
        fn()
    except UserFacingError as err:
        msg = str(err)
        assert "\n" not in msg, msg
        return msg
    raise AssertionError("expected a one-line refusal")


def _micro_groups(rank: int) -> list[dict]:
    return lm_groups(MICRO_GROUPS, seed=300 + rank)


def _accumulation(kind: str, world: int, rank: int, probe: bool, micro: int | None = None) -> list[torch.Tensor]:
    """Two accumulated micro-batches of a training step (no gradient sync on the first), optionally with a probe
    between them; the sharded gradients after the step."""
    model, loss = _model("gpt", torch.float64)
    sharded = _shard(model, kind, world)
    mbs = lm_groups([2, 2], seed=7 + rank)
    if kind == "fsdp1":
        with sharded.no_sync():  # type: ignore[operator]
            loss(sharded, mbs[0]).mean().backward()
    else:
        sharded.set_requires_gradient_sync(False)  # type: ignore[operator]
        loss(sharded, mbs[0]).mean().backward()
        sharded.set_requires_gradient_sync(True)  # type: ignore[operator]
    if probe:
        group_gram(sharded, loss, _micro_groups(rank) if micro else _groups(rank), micro_batch_size=micro)
    loss(sharded, mbs[1]).mean().backward()
    return [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()  # type: ignore[union-attr]
            for p in sharded.parameters() if p.grad is not None]


def _worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    try:
        groups = _groups(rank)
        families = FAMILIES if world == 2 else ("gpt",)
        for family in families:
            for kind in ("fsdp1", "fsdp2"):
                model, loss = _model(family, torch.float64)
                sharded = _shard(model, kind, world)
                gram, losses = group_gram(sharded, loss, groups)
                out[f"{family}/{kind}"] = (gram, losses)
                out[f"{family}/{kind}/micro"] = group_gram(sharded, loss, _micro_groups(rank), micro_batch_size=MICRO)
                if family == "gpt":  # the probe left the model able to train; with .grad held, a probe agrees
                    loss(sharded, groups[0]).mean().backward()
                    again, _ = group_gram(sharded, loss, groups)
                    out[f"gpt/{kind}/with-grad"] = again
        if world == 2:
            for kind in ("fsdp1", "fsdp2"):
                model, loss = _model("gpt", torch.float32)
                out[f"gpt/{kind}/fp32"] = group_gram(_shard(model, kind, world), loss, groups)
                model, loss = _model("gpt", torch.float32)
                out[f"gpt/{kind}/bf16"] = group_gram(_shard(model, kind, world, mixed=True), loss, groups)
                out[f"gpt/{kind}/accumulation"] = (_accumulation(kind, world, rank, probe=True),
                                                   _accumulation(kind, world, rank, probe=False))
                out[f"gpt/{kind}/micro/accumulation"] = (_accumulation(kind, world, rank, probe=True, micro=MICRO),
                                                         _accumulation(kind, world, rank, probe=False))
            model, loss = _model("gpt", torch.float64)
            sharded = _shard(model, "fsdp2", world)
            # several chunks per parameter (the tied embedding: 300 rows of 16 in chunks of 25 rows)
            out["gpt/fsdp2/micro/chunks"] = group_gram(sharded, loss, _micro_groups(rank), micro_batch_size=MICRO,
                                                      chunk_elements=2000)
            # reduce=None: this rank's probe, which must be every rank's (probe_mode: replicated)
            out["gpt/fsdp2/micro/replicated"] = group_gram(sharded, loss, _micro_groups(0), micro_batch_size=MICRO,
                                                          reduce=None)
            out["refuse/micro-own"] = _one_line(lambda: group_gram(sharded, loss, _micro_groups(rank),
                                                                   micro_batch_size=MICRO, reduce=None))
            model, loss = _model("gpt", torch.float32)
            out["gpt/fsdp2/micro/bf16"] = group_gram(_shard(model, "fsdp2", world, mixed=True), loss,
                                                     _micro_groups(rank), micro_batch_size=MICRO)
            model, loss = _model("gpt", torch.float64)
            flat = _shard(model, "fsdp1", world, orig_params=False)
            out["refuse/flat"] = _one_line(lambda: group_gram(flat, loss, groups))
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _reference(family: str, world: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded single-process computation: each rank's probe on the whole model, averaged."""
    grams, losses = [], []
    for rank in range(world):
        model, loss = _model(family, dtype)
        gram, mean_losses = group_gram(model, loss, _groups(rank), reduce=None)
        grams.append(gram)
        losses.append(mean_losses)
    return torch.stack(grams).mean(0), torch.stack(losses).mean(0)


def _explicit(family: str, ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, independently: per group, the mean loss over every listed rank's samples of that group on
    the unsharded model, its gradient by autograd, and the Gram of the flattened gradients."""
    model, loss = _model(family, torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    per_rank = [_micro_groups(r) for r in ranks]
    grads, losses = [], []
    for i in range(len(MICRO_GROUPS)):
        batch = {k: torch.cat([groups[i][k] for groups in per_rank]) for k in per_rank[0][i]}
        mean = loss(model, batch).mean()
        got = torch.autograd.grad(mean, params, allow_unused=True)
        grads.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(got, params)]))
        losses.append(mean.detach())
    flat = torch.stack(grads)
    return flat @ flat.t(), torch.stack(losses)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _alpha_z(gram: torch.Tensor, losses: torch.Tensor) -> tuple[Any, Any]:
    return build_reweighter("grape", num_domains=K, num_tasks=len(GROUPS) - K).update(
        gram.numpy(), losses[K:].numpy(), 1e-3)


def _check(tmp: Path, world: int) -> dict[str, Any]:
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for got in results[1:]:  # every rank returns the same Gram (one all-reduce)
        for key, value in results[0].items():
            if key.endswith(("/fp32", "/bf16")) or key.split("/")[0] in FAMILIES and "/" in key and \
                    not key.endswith("accumulation"):
                first = value[0] if isinstance(value, tuple) else value
                other = got[key][0] if isinstance(got[key], tuple) else got[key]
                assert torch.equal(first, other), key
    r0 = results[0]
    for family in FAMILIES if world == 2 else ("gpt",):
        want_gram, want_losses = _reference(family, world)
        want_alpha, want_z = _alpha_z(want_gram, want_losses)
        for kind in ("fsdp1", "fsdp2"):
            gram, losses = r0[f"{family}/{kind}"]
            assert _rel(gram, want_gram) <= 1e-10, (family, kind, _rel(gram, want_gram))
            torch.testing.assert_close(losses, want_losses, rtol=1e-10, atol=0)
            torch.testing.assert_close(gram[:K, K:], want_gram[:K, K:], rtol=1e-10,
                                       atol=1e-12 * float(want_gram.abs().max()))  # the alignments
            alpha, z = _alpha_z(gram, losses)
            torch.testing.assert_close(torch.as_tensor(alpha), torch.as_tensor(want_alpha), rtol=1e-10, atol=0)
            torch.testing.assert_close(torch.as_tensor(z), torch.as_tensor(want_z), rtol=1e-10, atol=0)
            if family == "gpt":
                assert _rel(r0[f"gpt/{kind}/with-grad"], want_gram) <= 1e-10
        want_gram, want_losses = _explicit(family, list(range(world)))  # micro-batched: the rank-mean gradients
        for kind in ("fsdp1", "fsdp2"):
            gram, losses = r0[f"{family}/{kind}/micro"]
            assert _rel(gram, want_gram) <= 1e-10, (family, kind, _rel(gram, want_gram))
            assert _rel(losses, want_losses) <= 1e-10, (family, kind, _rel(losses, want_losses))
    return r0


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_gram_equals_the_unsharded_computation(tmp_path: Path, world: int) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world)
    r0 = _check(tmp_path, world)
    if world != 2:
        return
    want_gram, want_losses = _reference("gpt", world)
    for kind in ("fsdp1", "fsdp2"):
        gram, losses = r0[f"gpt/{kind}/fp32"]
        assert _rel(gram, want_gram) <= FP32_TOL and _rel(losses, want_losses) <= FP32_TOL
        gram, losses = r0[f"gpt/{kind}/bf16"]
        assert _rel(gram, want_gram) <= BF16_TOL and _rel(losses, want_losses) <= BF16_TOL, _rel(gram, want_gram)
        with_probe, without = r0[f"gpt/{kind}/accumulation"]
        assert len(with_probe) == len(without) > 0
        assert all(torch.equal(a, b) for a, b in zip(with_probe, without))  # the probe left training alone
        with_probe, without = r0[f"gpt/{kind}/micro/accumulation"]
        assert all(torch.equal(a, b) for a, b in zip(with_probe, without))
    want_gram, want_losses = _explicit("gpt", list(range(world)))
    for key, tol in (("gpt/fsdp2/micro/chunks", 1e-10), ("gpt/fsdp2/micro/bf16", BF16_TOL)):
        gram, losses = r0[key]
        assert _rel(gram, want_gram) <= tol and _rel(losses, want_losses) <= tol, (key, _rel(gram, want_gram))
    one_gram, one_losses = _explicit("gpt", [0])  # every rank probed rank 0's samples
    gram, losses = r0["gpt/fsdp2/micro/replicated"]
    assert _rel(gram, one_gram) <= 1e-10 and _rel(losses, one_losses) <= 1e-10
    assert "needs the same probe samples on every rank" in r0["refuse/micro-own"]
    assert "use_orig_params=True" in r0["refuse/flat"]
