"""G x G arithmetic shared by the accumulators: inner products of per-group row blocks and scatters of
(sub-)Gram blocks into the full Gram matrix."""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

__all__ = ["add_cross", "as_range", "block_inner", "scatter_gram"]


def as_range(idx: Tensor) -> Union[slice, Tensor]:
    """Group ids of a micro-batch are consecutive (groups are concatenated in order): use a slice, so
    updates are plain strided adds instead of scatters."""
    n = idx.numel()
    if n and int(idx[-1]) - int(idx[0]) == n - 1:
        return slice(int(idx[0]), int(idx[0]) + n)
    return idx


def block_inner(a: Tensor, b: Tensor) -> Tensor:
    """(ga, gb) inner products of per-group row blocks a (ga, k, ...) and b (gb, k, ...).

    One flat product. A batched form over the k rows ((k, ga, r) @ (k, r, gb), then a sum over k) ran ~4x
    faster for the LM head's blocks, but its last bits then depended on memory alignment (small-matrix
    BLAS kernels), which broke bitwise-identical resumes (tests/test_plain_loop.py): determinism first.
    """
    return a.reshape(a.shape[0], -1) @ b.reshape(b.shape[0], -1).t()


def scatter_gram(gram: Tensor, rows_idx: Tensor, cols_idx: Tensor, block: Tensor) -> None:
    """gram[rows_idx[i], cols_idx[j]] += block[i, j] (indices unique within each list)."""
    r, c = as_range(rows_idx), as_range(cols_idx)
    if isinstance(r, slice) and isinstance(c, slice):
        gram[r, c] += block.to(gram.dtype)
    else:
        gram[rows_idx.unsqueeze(1), cols_idx.unsqueeze(0)] += block.to(gram.dtype)


def add_cross(gram: Tensor, idx: Tensor, cross: Tensor) -> None:
    """Add a (G_m x G) cross block and its transpose: the two mixed terms <C, H> + <H, C>."""
    r = as_range(idx)
    cross = cross.to(gram.dtype)
    if isinstance(r, slice):
        gram[r, :] += cross
        gram[:, r] += cross.t()
    else:
        g = gram.shape[0]
        all_idx = torch.arange(g, device=gram.device)
        scatter_gram(gram, idx, all_idx, cross)
        scatter_gram(gram, all_idx, idx, cross.t())
