"""The probe: which samples the controller differentiates, in what shape, through which module.

Probe batches are pure functions of ``(seed, step, rank)``, so a resumed run probes the same samples.
Every group is padded to one sequence length because the fused Gram (``grape.gram``) concatenates them.
:func:`unwrap_for_probe` is the one place that decides which module the probe differentiates (the
controller and ``group_gram`` both call it), so this module stays free of the Gram machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from grape_stream.grape.mixer_port import MixerPort
    from grape_stream.grape.tasks import TaskStream

try:
    from torch.distributed.fsdp import FullyShardedDataParallel

    _FSDP_TYPES: tuple[type, ...] = (FullyShardedDataParallel,)
except Exception:  # pragma: no cover - torch built without distributed
    _FSDP_TYPES = ()
try:
    from torch.distributed.tensor import DTensor

    _DTENSOR_TYPES: tuple[type, ...] = (DTensor,)
except Exception:  # pragma: no cover
    _DTENSOR_TYPES = ()

__all__ = ["collate_domain_samples", "draw_probe_groups", "module_device", "pad_groups", "sharded_parameter",
           "unwrap_for_probe"]


def sharded_parameter(model: nn.Module) -> str | None:
    """Why `model` holds sharded parameters (FSDP1 module, FlatParameter, FSDP2 DTensor), or None."""
    if _FSDP_TYPES:
        for name, m in model.named_modules():
            if isinstance(m, _FSDP_TYPES):
                return f"module {name or '<root>'!r} is FullyShardedDataParallel"
    for name, p in model.named_parameters():
        if type(p).__name__ == "FlatParameter" or getattr(p, "_is_flat_param", False):
            return f"parameter {name!r} is an FSDP FlatParameter"
        if _DTENSOR_TYPES and isinstance(p, _DTENSOR_TYPES):
            return f"parameter {name!r} is a DTensor (FSDP2)"
    return None


def unwrap_for_probe(model: nn.Module, *, sharded_ok: bool = False) -> nn.Module:
    """The module whose parameters the probe differentiates; sharded parameters are refused unless
    ``sharded_ok`` (the fused Gram probes FSDP models unit by unit: grape/gram/sharding.py).

    DDP and DataParallel are unwrapped by type (``.module`` exists on many non-DDP wrappers, e.g.
    Composer's classifier): differentiating the inner module with ``torch.autograd.grad`` runs no DDP
    hook, so no collective is issued and every rank's ``.grad`` stays bit-identical; the Gram matrices
    are averaged explicitly instead. A torch.compile wrapper is unwrapped to its eager module, which the
    Gram's module hooks need. Sharded parameters (FSDP FlatParameter, FSDP2 DTensor, of any placement)
    are refused: a per-rank gradient of a shard is not the full gradient the Gram matrix needs, and a
    silent wrong answer is worse than an error.
    """
    while True:
        if isinstance(model, (DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
            model = inner
        else:
            break
    why = None if sharded_ok else sharded_parameter(model)
    if why is not None:
        raise NotImplementedError(
            f"GRAPE probes do not support sharded parameters yet ({why}): under FSDP each rank holds only a "
            "shard, so a per-rank gradient is not the full gradient the alignment Gram matrix needs. Use DDP "
            "(Composer: no parallelism_config / fsdp_config), a single-device loop, or probe an unsharded replica."
        )
    return model


def module_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def collate_domain_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Domain probe samples (dicts with ``tokens``) -> ``{"tokens": int64 (B, T), "loss_mask": ones}``
    (the mask makes the domain groups' keys match the task groups' for the fused probe)."""
    if not samples:
        raise ValueError("the mixer returned an empty probe")
    toks = []
    for s in samples:
        t = s["tokens"]
        toks.append(t.to(torch.int64) if isinstance(t, torch.Tensor)
                    else torch.from_numpy(np.asarray(t).astype(np.int64)))
    tokens = torch.stack(toks)
    return {"tokens": tokens, "loss_mask": torch.ones_like(tokens, dtype=torch.uint8)}


def pad_groups(groups: list[dict[str, torch.Tensor]], length: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Give every probe group the same sequence length (the fused probe concatenates them): the longest
    group's, or ``length`` when longer (under FSDP every rank pads to the longest probe of all ranks).

    Shorter groups are right-padded with token 0 and loss_mask 0: in a causal model, tokens after a
    position never change its prediction, so the padded loss equals the unpadded one exactly.
    """
    T = max([g["tokens"].shape[1] for g in groups] + ([length] if length is not None else []))
    out = []
    for g in groups:
        t = g["tokens"].shape[1]
        if t == T:
            out.append(g)
            continue
        pad = T - t
        out.append({
            "tokens": torch.nn.functional.pad(g["tokens"], (0, pad), value=0),
            "loss_mask": torch.nn.functional.pad(g["loss_mask"].to(torch.uint8), (0, pad), value=0),
        })
    return out


def draw_probe_groups(
    mixer: MixerPort,
    num_domains: int,
    tasks: Sequence[TaskStream],
    step: int,
    *,
    seed: int,
    domain_batch: int,
    task_batch: int,
    rank: int,
    world: int,
    sharded: bool,
    device: torch.device,
) -> list[dict[str, torch.Tensor]]:
    """The K domain then N task probe batches of this rank at `step`, padded and on `device`.

    ``sharded`` (and world > 1): each rank draws rank-disjoint samples, so R ranks probe R times the
    samples for the cost of one; otherwise every rank draws the same ones.
    """
    sharded = sharded and world > 1
    groups: list[dict[str, torch.Tensor]] = []
    for k in range(num_domains):
        if sharded:
            samples = mixer.probe(k, domain_batch, (seed, step), rank=rank, world_size=world)
        else:
            samples = mixer.probe(k, domain_batch, (seed, step))
        groups.append(collate_domain_samples(samples))
    for n, task in enumerate(tasks):
        groups.append(
            task.probe(task_batch, key=(step, n), seed=seed, rank=rank if sharded else 0,
                       world_size=world if sharded else 1, disjoint=sharded)
        )
    groups = pad_groups(groups)
    return [{k: v.to(device, non_blocking=True) for k, v in g.items()} for g in groups]

