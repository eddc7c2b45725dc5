"""Shared pieces of the in-step alignment tests: random directions, the slow truth, one observed step."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from grape_stream.grape.gram.batches import map_tensors
from grape_stream.grape.gram.instep import StepAlignments

PerSampleLoss = Callable[[nn.Module, Any], torch.Tensor]


def directions(model: nn.Module, count: int = 2, seed: int = 7) -> list[dict[nn.Parameter, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    return [{p: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params}
            for _ in range(count)]


def truth(model: nn.Module, loss_fn: PerSampleLoss, batch: Any, domains: torch.Tensor, dirs: Sequence[dict],
          num_domains: int) -> torch.Tensor:
    """The definition: one autograd.grad per domain of the mean loss of its samples, dotted with each direction
    (NaN rows for domains without a sample). The forward runs on the whole batch (the other samples weighted
    0), so a model that computes parts in float32 (HF Llama's RMSNorm) sees the same batch shapes."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = torch.full((num_domains, len(dirs)), float("nan"), dtype=torch.float64)
    for k in range(num_domains):
        mask = (domains == k).to(torch.float64)
        if mask.sum() == 0:
            continue
        losses = loss_fn(model, batch)
        grads = torch.autograd.grad((losses * mask.to(losses.dtype)).sum() / mask.sum(), params, allow_unused=True)
        for d, u in enumerate(dirs):
            out[k, d] = sum(float((g.double() * u[p].double()).sum()) for g, p in zip(grads, params)
                            if g is not None and p in u)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    ok = ~torch.isnan(b)
    assert torch.equal(torch.isnan(a), ~ok), (a, b)
    return float((a[ok] - b[ok]).abs().max() / b[ok].abs().max())


def observed_step(sa: StepAlignments, model: nn.Module, loss_fn: PerSampleLoss, batch: Any,
                  micro: Optional[int] = None, watch: bool = False) -> None:
    """One training step's backward (loss = mean of per-sample losses over the batch), in micro-batches
    of ``micro`` samples scaled as Composer does (micro-batch mean x its share of the batch)."""
    size = int(batch["domain"].shape[0])
    step = micro or size
    for a in range(0, size, step):
        mb = map_tensors(batch, lambda t, a=a: t[a : a + step])
        n = int(mb["domain"].shape[0])
        with sa.observe(mb):
            losses = loss_fn(model, mb)
            if watch:
                sa.watch(losses)
            (losses.mean() * (n / size)).backward()


def fsdp2(model: nn.Module, world: int, hsdp: bool = False) -> nn.Module:
    """Our GPT under FSDP2 over all ranks (each block a unit); ``hsdp``: HSDP's 2-D mesh, every rank a replica
    holding the whole parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")) if hsdp else \
        init_device_mesh("cpu", (world,))
    for b in model.blocks:  # type: ignore[union-attr]
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp1(model: nn.Module, hybrid: bool = False) -> nn.Module:
    """Our GPT under FSDP1 (``use_orig_params=True``, each block a unit) over all ranks; ``hybrid``:
    HYBRID_SHARD (refused by the in-step engine)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    block = type(model.blocks[0])  # type: ignore[index]
    strategy = ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.FULL_SHARD
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block}), use_orig_params=True,
                                    device_id=torch.device("cpu"), sharding_strategy=strategy)


def shard(model: nn.Module, kind: str, world: int) -> nn.Module:
    """``model`` sharded by "fsdp1" or "fsdp2" over all ranks."""
    return fsdp1(model) if kind == "fsdp1" else fsdp2(model, world)


def local_grads(model: nn.Module) -> list[torch.Tensor]:
    """Each parameter's gradient as this rank holds it (FSDP2: the DTensor's local shard; FSDP1: the piece)."""
    return [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()  # type: ignore[union-attr]
            for p in model.parameters() if p.grad is not None]


@contextlib.contextmanager
def grad_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Inside a gradient-accumulation micro-batch (``sync`` False) FSDP neither reduces nor finalises."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        yield
    elif sync:
        yield
    else:
        with model.no_sync():  # type: ignore[operator]
            yield


def run_two_ranks(worker: Callable[..., None], tmp_path: Any, data: str) -> tuple[dict, dict]:
    """``worker(rank, 2, tmp, data)`` on 2 ranks (each saves ``rank{r}.pt`` in ``tmp``); both ranks' results."""
    from _parallel import spawn

    spawn(worker, args=(2, str(tmp_path), data), nprocs=2)
    r0, r1 = (torch.load(f"{tmp_path}/rank{r}.pt", weights_only=False) for r in (0, 1))
    return r0, r1
