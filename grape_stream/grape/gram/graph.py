"""Autograd-graph helpers of the fused pass: which leaves a loss reaches, and the exact fallback.

Kept apart from group_gram.py (the orchestration) so each module stays small.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor, nn

from grape_stream.grape.gram.batches import MicroBatch

__all__ = ["fallback_backward", "graph_nodes", "scan_graph"]


def graph_nodes(root: Tensor) -> Iterator[Any]:
    """Every autograd node behind ``root`` once, depth first (the caller keeps the nodes it compares by id)."""
    seen: set[int] = set()
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None and id(nxt) not in seen)


def scan_graph(root: Tensor) -> tuple[set[int], list[Tensor], list[Any]]:
    """Node ids reachable from `root`, the leaf tensors at the end of the graph, and the node objects
    (kept alive so that ids stay unique while they are compared)."""
    seen: set[int] = set()
    keep: list[Any] = []
    leaves: list[Tensor] = []
    for node in graph_nodes(root):
        seen.add(id(node))
        keep.append(node)
        var = getattr(node, "variable", None)
        if isinstance(var, Tensor):
            leaves.append(var)
            seen.add(id(var))
            keep.append(var)
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
