"""Probe groups as one batch: concatenation, per-leaf mapping and the checks that make it valid.

A group is any nesting of dicts / lists / tuples of tensors with a leading batch dimension (what a
per-sample loss takes). The fused pass concatenates the groups along that dimension, so the groups
must agree on everything else; the errors name the group and the leaf that disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["MicroBatch", "batch_signature", "batch_size", "concat", "map_tensors", "tensor_leaves"]


def tensor_leaves(obj: Any, path: str = "") -> Iterable[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        yield path or "<batch>", obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensor_leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensor_leaves(v, f"{path}[{i}]")


def batch_size(batch: Any, where: str) -> int:
    sizes = {(p, t.shape[0] if t.dim() else None) for p, t in tensor_leaves(batch)}
    if not sizes:
        raise ValueError(f"{where} holds no tensor: a group must be a batch (e.g. a dict of tensors)")
    for p, s in sizes:
        if s is None:
            raise ValueError(f"{where}{p} is a 0-d tensor: every tensor of a batch needs a leading batch dimension")
    distinct = {s for _, s in sizes if s is not None}  # none is None: checked just above
    if len(distinct) != 1:
        raise ValueError(f"{where} mixes batch sizes {sorted(distinct)} across its tensors: {sorted(sizes)}")
    b = distinct.pop()
    if b == 0:
        raise ValueError(f"{where} is empty: the mean loss of a group with no sample is undefined")
    return b


def concat(batches: Sequence[Any], path: str = "") -> Any:
    first = batches[0]
    if isinstance(first, Tensor):
        for i, t in enumerate(batches):
            if not isinstance(t, Tensor) or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"groups[{i}]{path} has shape {got} ({getattr(t, 'dtype', '?')}) but groups[0]{path} has "
                    f"{tuple(first.shape)} ({first.dtype}): every group must share all non-batch dimensions and "
                    "dtypes; pad sequences to one length (and mask the padding with loss_mask)"
                )
        return torch.cat(list(batches), dim=0)
    if isinstance(first, dict):
        for i, b in enumerate(batches):
            if not isinstance(b, dict) or set(b) != set(first):
                raise ValueError(f"groups[{i}]{path} has keys {sorted(map(str, b))} but groups[0]{path} has "
                                 f"{sorted(map(str, first))}")
        return type(first)((k, concat([b[k] for b in batches], f"{path}[{k!r}]")) for k in first)
    if isinstance(first, (list, tuple)):
        for i, b in enumerate(batches):
            if type(b) is not type(first) or len(b) != len(first):
                raise ValueError(f"groups[{i}]{path} does not have the structure of groups[0]{path}")
        items = [concat([b[j] for b in batches], f"{path}[{j}]") for j in range(len(first))]
        return type(first)(items) if not hasattr(first, "_fields") else type(first)(*items)
    for i, b in enumerate(batches):
        if b != first:
            raise ValueError(f"groups[{i}]{path} = {b!r} differs from groups[0]{path} = {first!r}; non-tensor "
                             "entries must be equal across groups")
    return first


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(v, fn) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def batch_signature(batch: Any) -> tuple:
    return tuple((p, tuple(t.shape[1:]), t.dtype) for p, t in tensor_leaves(batch))


@dataclass
class MicroBatch:
    """Which global group each sample of the current forward belongs to (groups contiguous, ascending)."""

    sample_groups: Tensor  # (B,) int64
    is_last: bool
    batch_size: int = 0
    groups: Tensor = field(init=False)  # (G_m,) unique global ids, set by __post_init__
    sample_segments: list[tuple[int, int]] = field(default_factory=list)  # per local group

    def __post_init__(self) -> None:
        self.batch_size = int(self.sample_groups.numel())
        self.groups, counts = torch.unique_consecutive(self.sample_groups, return_counts=True)
        starts = [0]
        for c in counts.tolist():
            starts.append(starts[-1] + c)
        self.sample_segments = list(zip(starts[:-1], starts[1:]))
        self.local = torch.repeat_interleave(torch.arange(len(self.sample_segments)), counts.cpu()).to(
            self.sample_groups.device
        )
        self._onehot: dict[torch.dtype, Tensor] = {}

    def onehot(self, dtype: torch.dtype) -> Tensor:
        """(G_m, B) sample-to-local-group indicator, for per-group sums as one small matmul."""
        if dtype not in self._onehot:
            m = torch.zeros((len(self.sample_segments), self.batch_size), dtype=dtype, device=self.local.device)
            m[self.local, torch.arange(self.batch_size, device=self.local.device)] = 1
            self._onehot[dtype] = m
        return self._onehot[dtype]
