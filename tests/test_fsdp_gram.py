"""The alignment Gram of an FSDP-sharded model, for real: 2 and 4 gloo processes on CPU shard our GPT (tied
embeddings), an HF Llama and the MPT-style model with FSDP1 (use_orig_params) and FSDP2 (fully_shard), and
``group_gram`` probes the sharded model unit by unit (grape/gram/sharding.py), no replica. Each rank probes
its own samples; the reference is computed here, in the single test process without torch.distributed, on
the unsharded model: the average of the per-rank Grams (what DDP gives), then alignments, alpha and z.

One spawned process group per world size runs every check (CI has 2 cores): float64 exact (rel 1e-10),
float32 and bf16 mixed precision within stated tolerances, a probe between two accumulated micro-batches
that leaves the training step bitwise as without it, and the refusals, each one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _alignment_helpers import lm_groups
from grape_stream.grape.gram.group_gram import group_gram
from grape_stream.grape.reweighting import build_reweighter
from grape_stream.testing.families import FamilySize, build_family

pytestmark = pytest.mark.integration

SIZE = FamilySize(d_model=16, n_layer=2, n_head=2)  # vocab 300, 16 tokens: lm_groups' shapes
FAMILIES = ("gpt", "hf-llama", "mpt")
GROUPS = [2, 1, 2, 1, 2]  # K=3 domains, N=2 tasks per rank
K = 3
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


def _accumulation(kind: str, world: int, rank: int, probe: bool) -> list[torch.Tensor]:
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
        group_gram(sharded, loss, _groups(rank))
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
            model, loss = _model("gpt", torch.float64)
            sharded = _shard(model, "fsdp2", world)
            out["refuse/micro"] = _one_line(lambda: group_gram(sharded, loss, groups, micro_batch_size=2))
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
    return r0


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_gram_equals_the_unsharded_computation(tmp_path: Path, world: int) -> None:
    mp.spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
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
    assert "micro_batch_size is not available under FSDP" in r0["refuse/micro"]
    assert "use_orig_params=True" in r0["refuse/flat"]
