"""Two real processes (gloo on CPU): Grams averaged across ranks, identical everywhere."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from _alignment_helpers import gpt, lm_groups
from _parallel import spawn
from grape_stream.grape.gram.group_gram import group_gram
from grape_stream.grape.gram.sharding import ShardedGramError
from grape_stream.models import per_sample_lm_loss


def _worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        model = gpt(torch.float64, seed=0)  # same weights on every rank, like a DDP replica
        # each rank has its own probe (different samples, even different group sizes)
        groups = lm_groups([2, 1, 3] if rank == 0 else [1, 2, 2], seed=100 + rank)
        local, local_losses = group_gram(model, per_sample_lm_loss, groups, reduce=None)
        mean, mean_losses, info = group_gram(model, per_sample_lm_loss, groups, return_info=True)
        ddp = nn.parallel.DistributedDataParallel(model)
        via_ddp, _ = group_gram(ddp, per_sample_lm_loss, groups)

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        sharded = nn.Linear(4, 1).double()
        sharded.weight = nn.Parameter(distribute_tensor(sharded.weight.detach(), mesh, [Replicate()]))
        try:
            group_gram(sharded, lambda m, b: m(b["x"]).sum(1), [{"x": torch.randn(2, 4, dtype=torch.float64)}])
            fsdp_error = ""
        except ShardedGramError as err:  # a DTensor not placed by FSDP (tensor parallel): refused in one line
            fsdp_error = str(err)
        torch.save(
            {"local": local, "local_losses": local_losses, "mean": mean, "mean_losses": mean_losses,
             "ddp": via_ddp, "world": info.world_size, "fsdp_error": fsdp_error},
            os.path.join(tmp, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_ranks_average_and_agree(tmp_path: Path) -> None:
    spawn(_worker, args=(2, str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert not torch.equal(r0["local"], r1["local"])  # the probes differ
    assert torch.equal(r0["mean"], r1["mean"]) and torch.equal(r0["mean_losses"], r1["mean_losses"])
    torch.testing.assert_close(r0["mean"], (r0["local"] + r1["local"]) / 2, rtol=1e-12, atol=0)
    torch.testing.assert_close(r0["mean_losses"], (r0["local_losses"] + r1["local_losses"]) / 2, rtol=1e-12, atol=0)
    assert r0["world"] == 2
    assert torch.equal(r0["ddp"], r0["mean"]) and torch.equal(r1["ddp"], r1["mean"])  # DDP wrapper unwrapped
    assert "sharded" in r0["fsdp_error"] and "sharded" in r1["fsdp_error"]
