"""Autograd-graph helpers of the fused pass: which leaves a loss reaches, and the exact fallback.

Kept apart from group_gram.py (the orchestration) so each module stays small.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from grape_stream.grape.gram.batches import MicroBatch

__all__ = ["fallback_backward", "scan_graph"]


def scan_graph(root: Tensor) -> tuple[set[int], list[Tensor], list[Any]]:
    """Node ids reachable from `root`, the leaf tensors at the end of the graph, and the node objects
    (kept alive so that ids stay unique while they are compared)."""
    seen: set[int] = set()
    keep: list[Any] = []
    leaves: list[Tensor] = []
    stack = [root.grad_fn] if root.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        var = getattr(node, "variable", None)
        if isinstance(var, Tensor):
            leaves.append(var)
            seen.add(id(var))
            keep.append(var)
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                stack.append(nxt)
    return seen, leaves, keep


def fallback_backward(
    losses: Tensor, w: Tensor, micro: MicroBatch, fb_params: list[nn.Parameter], fb_acc: list[Tensor],
    scales: dict[int, Tensor],
) -> None:
    """Exact per-group gradients of the fallback parameters: one backward per group of the micro-batch
    (each scaled by sqrt of its preconditioner weight, when it has one)."""
    for li, (sa, sb) in enumerate(micro.sample_segments):
        mask = torch.zeros_like(w)
        mask[sa:sb] = w[sa:sb]
        grads = torch.autograd.grad((losses * mask).sum(), fb_params, retain_graph=True, allow_unused=True)
        g = int(micro.groups[li])
        for acc, gr, p in zip(fb_acc, grads, fb_params):
            if gr is not None:
                s = scales.get(id(p))
                acc[g] += (gr if s is None else gr * s).reshape(-1).to(acc.dtype)
