"""Exact Gram arithmetic on per-group gradient *contributions* of one parameter.

A module call (a "use" of a parameter) hands us, inside the backward pass, the per-group gradient of
that parameter in one of two forms:

* `DenseContribution`: something that can *materialise* the per-group gradient of any set of rows
  of the parameter on demand (`materialize(rows) -> (G_m, k, *row_shape)`), e.g. a Linear weight
  (rows of dY^T X), a bias, a LayerNorm weight. Large ones are visited in row chunks so that at most
  `budget` elements of per-group gradient exist at once.
* `SparseRowContribution`: an embedding's gradient, which lives on the rows of the token ids used;
  kept as one vector per distinct (group, row) pair, never as a dense vocab x dim copy per group.

`RowAccumulator` holds, for one parameter, the running *sum* of the contributions seen so far,
restricted to the rows a later contribution can still touch (all rows, the exact support of a sparse
sum, or the rows of the remaining embedding uses). Each new contribution C adds
<C, C> + <C, held> + <held, C> to the Gram, then joins the held sum. Because the Gram is bilinear in the
per-group gradients this is exact for any number of uses (tied weights, a module called twice,
micro-batches) and never needs the full per-group gradient unless a later use can touch every row.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from grape_stream.config import GRAM_CHUNK_ELEMENTS
from grape_stream.grape.gram.gram_ops import add_cross, as_range, block_inner, scatter_gram

Rows = Optional[Tensor]  # sorted unique int64 row ids; None means "every row"
RowSel = Union[slice, Tensor]

DEFAULT_BUDGET = GRAM_CHUNK_ELEMENTS  # per-group gradient elements materialised at once (grape_stream.config)

class DenseContribution:
    """Per-group gradient of one parameter that can be produced row-block by row-block."""

    groups: Tensor  # (G_m,) global group ids, ascending, unique
    num_rows: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype

    def materialize(self, rows: RowSel) -> Tensor:  # (G_m, k, *row_shape)
        raise NotImplementedError

    def ghost_gram(self) -> Optional[Tensor]:
        """(G_m x G_m) self-Gram without materialising, or None when that is not cheaper."""
        return None

    @property
    def row_numel(self) -> int:
        return int(math.prod(self.row_shape))


class TensorContribution(DenseContribution):
    """Small parameters (biases, norm weights): the per-group gradient is simply computed."""

    def __init__(self, per_group: Tensor, groups: Tensor) -> None:
        self.per_group = per_group  # (G_m, *param_shape)
        self.groups = groups
        self.num_rows = per_group.shape[1]
        self.row_shape = tuple(per_group.shape[2:])
        self.dtype = per_group.dtype

    def materialize(self, rows: RowSel) -> Tensor:
        return self.per_group[:, rows]


class MatmulContribution(DenseContribution):
    """Weight gradient of a matmul layer: row r of group g's gradient is sum_{t in g} left[t, r] * right[t].

    nn.Linear (weight out x in): left = dY, right = X.  HF Conv1D (weight in x out): left = X, right = dY.
    Token rows of each group are contiguous (`segments`), so each group's block is a plain matmul of views.
    """

    def __init__(
        self, left: Tensor, right: Tensor, segments: list[tuple[int, int]], groups: Tensor, allow_ghost: bool,
        scale: Optional[Tensor] = None,
    ) -> None:
        self.left, self.right = left, right  # (n, R), (n, C)
        self.scale = scale  # (R, C) sqrt of a preconditioner weight, or None
        self.segments = segments  # per local group: [start, end) token rows
        self.groups = groups
        self.num_rows = left.shape[1]
        self.row_shape = (right.shape[1],)
        self.dtype = left.dtype
        self.allow_ghost = allow_ghost and scale is None  # token pairs cannot carry an elementwise weight

    def materialize(self, rows: RowSel) -> Tensor:
        left = self.left[:, rows]
        out = torch.empty(
            (len(self.segments), left.shape[1], self.right.shape[1]), dtype=self.dtype, device=left.device
        )
        for i, (a, b) in enumerate(self.segments):  # (a batched bmm here made results alignment-dependent)
            torch.mm(left[a:b].t(), self.right[a:b], out=out[i])
        if self.scale is not None:
            out *= self.scale[rows]
        return out

    def ghost_cost(self) -> float:
        n = self.left.shape[0]
        return float(n) * n * (self.left.shape[1] + self.right.shape[1])

    def dense_cost(self) -> float:
        n, gm = self.left.shape[0], len(self.segments)
        return float(self.left.shape[1]) * self.right.shape[1] * (n + gm * gm)

    def ghost_gram(self, budget: int = DEFAULT_BUDGET) -> Optional[Tensor]:
        """sum_{s in g, t in h} (l_s . l_t)(r_s . r_t): the 'ghost' inner product, O(n^2 (R + C))."""
        if not self.allow_ghost:
            return None
        left, right = self.left, self.right
        n, gm = left.shape[0], len(self.segments)
        onehot = torch.zeros((n, gm), dtype=self.dtype, device=left.device)
        for i, (a, b) in enumerate(self.segments):
            onehot[a:b, i] = 1
        out = torch.zeros((gm, gm), dtype=self.dtype, device=left.device)
        step = max(1, budget // max(n, 1))
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            kern = (left[c0:c1] @ left.t()) * (right[c0:c1] @ right.t())  # (c, n)
            out += onehot[c0:c1].t() @ (kern @ onehot)
        return out


class SparseRowContribution:
    """An embedding's per-group gradient as one vector per distinct (group, row) pair."""

    def __init__(self, token_groups: Tensor, ids: Tensor, vecs: Tensor, num_rows: int) -> None:
        # token_groups: (n,) global group ids; ids: (n,) rows; vecs: (n, *row_shape)
        self.num_rows = num_rows
        self.row_shape = tuple(vecs.shape[1:])
        self.dtype = vecs.dtype
        key = token_groups * num_rows + ids
        uniq, inverse = torch.unique(key, sorted=True, return_inverse=True)
        self.pair_group = torch.div(uniq, num_rows, rounding_mode="floor")
        self.pair_row = uniq - self.pair_group * num_rows
        self.pair_vec = torch.zeros((uniq.numel(), *self.row_shape), dtype=vecs.dtype, device=vecs.device)
        self.pair_vec.index_add_(0, inverse, vecs)
        self.groups, self.pair_local = torch.unique(self.pair_group, sorted=True, return_inverse=True)
        self.rows = torch.unique(self.pair_row, sorted=True)

    @property
    def row_numel(self) -> int:
        return int(math.prod(self.row_shape))

    def self_gram(self, budget: int) -> Tensor:
        """sum over rows u of E_g[u] . E_h[u], visiting the support in chunks of rows."""
        gm = self.groups.numel()
        out = torch.zeros((gm, gm), dtype=self.dtype, device=self.pair_vec.device)
        pos = torch.searchsorted(self.rows, self.pair_row)
        order = torch.argsort(pos, stable=True)
        pos_sorted = pos[order]
        step = max(1, budget // max(1, gm * self.row_numel))
        for c0 in range(0, self.rows.numel(), step):
            c1 = min(self.rows.numel(), c0 + step)
            lo, hi = torch.searchsorted(pos_sorted, torch.tensor([c0, c1], device=pos.device)).tolist()
            sel = order[lo:hi]
            dense = torch.zeros((gm, c1 - c0, *self.row_shape), dtype=self.dtype, device=out.device)
            dense[self.pair_local[sel], pos[sel] - c0] = self.pair_vec[sel]
            out += block_inner(dense, dense)
        return out


def _positions(rows: Rows, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Index of each id in `rows` and whether it is present there."""
    if rows is None:
        return ids, torch.ones_like(ids, dtype=torch.bool)
    if rows.numel() == 0:
        return torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    pos = torch.searchsorted(rows, ids).clamp_max(rows.numel() - 1)
    return pos, rows[pos] == ids


class RowAccumulator:
    """Running per-group sum of one parameter's contributions, kept only on rows still needed."""

    def __init__(
        self, num_groups: int, num_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_groups, self.num_rows, self.row_shape = num_groups, num_rows, row_shape
        self.dtype, self.device = dtype, device
        self.rows: Rows = torch.empty(0, dtype=torch.long, device=device)
        self.data: Optional[Tensor] = None  # (G, len(rows) or num_rows, *row_shape)
        self.sparse_exact = True  # every absorbed contribution was sparse: data is the exact sum
        self.peak_elements = 0
        self.strategies: set[str] = set()

    # ------------------------------------------------------------------ helpers
    def _empty(self) -> bool:
        return self.data is None

    def _alloc(self, rows: Rows) -> Tensor:
        n = self.num_rows if rows is None else rows.numel()
        data = torch.zeros((self.num_groups, n, *self.row_shape), dtype=self.dtype, device=self.device)
        self.peak_elements = max(self.peak_elements, data.numel())
        return data

    def _restrict(self, new_rows: Rows) -> Tensor:
        """The held sum re-indexed onto `new_rows` (zeros where nothing is held)."""
        out = self._alloc(new_rows)
        if self.data is None:
            return out
        if new_rows is None:
            if self.rows is None:
                out.copy_(self.data)
            else:
                out[:, self.rows] = self.data
            return out
        if self.rows is None:
            out.copy_(self.data[:, new_rows])
            return out
        pos, present = _positions(self.rows, new_rows)
        out[:, present] = self.data[:, pos[present]]
        return out

    @staticmethod
    def _same_rows(a: Rows, b: Rows) -> bool:
        if a is None or b is None:
            return a is None and b is None
        return a.numel() == b.numel() and bool(torch.equal(a, b))

    # ------------------------------------------------------------------ absorb
    def absorb(
        self, contrib: Union[DenseContribution, SparseRowContribution], keep: Rows, gram: Tensor, budget: int,
        label: Optional[str] = None,
    ) -> None:
        """Add every Gram term involving `contrib`, then hold (held + contrib) on the rows in `keep`.

        keep: rows any later contribution may touch: None (all), a sorted id tensor, or an empty tensor
        (no later contribution: nothing needs holding). label: how a dense contribution was formed, for
        GramInfo.fast_path (default "dense" or "ghost").
        """
        if isinstance(contrib, SparseRowContribution):
            self._absorb_sparse(contrib, keep, gram, budget)
        else:
            self._absorb_dense(contrib, keep, gram, budget, label)

    def _absorb_dense(self, c: DenseContribution, keep: Rows, gram: Tensor, budget: int,
                      label: Optional[str] = None) -> None:
        idx = c.groups
        gm = idx.numel()
        nothing_after = keep is not None and keep.numel() == 0
        new_rows: Rows = None if nothing_after else keep
        held, held_rows = self.data, self.rows
        if nothing_after:
            new_data = None
        elif held is not None and self._same_rows(held_rows, new_rows):
            new_data = held  # same rows: update in place, each row block after its cross term is taken
        else:
            new_data = self._restrict(new_rows)

        ghost = None
        if isinstance(c, MatmulContribution) and c.allow_ghost and c.ghost_cost() < c.dense_cost():
            ghost = c.ghost_gram(budget)
        if ghost is not None:
            scatter_gram(gram, idx, idx, ghost)
            self.strategies.add("ghost")
        else:
            self.strategies.add(label or "dense")

        needs_all = (
            ghost is None
            or (held is not None and held_rows is None)
            or (new_data is not None and new_rows is None)
        )
        step = max(1, budget // max(1, gm * c.row_numel))
        if needs_all:
            for r0 in range(0, c.num_rows, step):
                r1 = min(c.num_rows, r0 + step)
                self._dense_block(c, c.materialize(slice(r0, r1)), torch.arange(r0, r1, device=idx.device),
                                  ghost is None, held, held_rows, new_data, new_rows, gram, span=(r0, r1))
        else:
            parts = []
            # not needs_all: held rows and new rows are explicit wherever there is data
            if held is not None and held_rows is not None:
                parts.append(held_rows)
            if new_data is not None and new_rows is not None:
                parts.append(new_rows)
            visit = torch.unique(torch.cat(parts)) if parts else torch.empty(0, dtype=torch.long, device=idx.device)
            for a in range(0, visit.numel(), step):
                rows = visit[a : a + step]
                self._dense_block(c, c.materialize(rows), rows, False, held, held_rows, new_data, new_rows, gram)
        self.sparse_exact = False
        if nothing_after:
            self.data, self.rows = None, torch.empty(0, dtype=torch.long, device=self.device)
        else:
            self.data, self.rows = new_data, new_rows

    def _dense_block(
        self, c, block, rows, self_term, held, held_rows, new_data, new_rows, gram, span=None
    ) -> None:
        """One materialised row block (G_m, k, ...) of rows `rows`: self, cross and held-sum updates."""
        idx = c.groups
        if self_term:
            scatter_gram(gram, idx, idx, block_inner(block, block))
        if held is not None and held_rows is None and span is not None:
            hsub = held[:, span[0] : span[1]]
            add_cross(gram, idx, block_inner(block, hsub))
        elif held is not None:
            pos, present = _positions(held_rows, rows)
            if bool(present.all()):
                hsub, bsub = held[:, pos], block
            elif bool(present.any()):
                hsub, bsub = held[:, pos[present]], block[:, present]
            else:
                hsub = None
            if hsub is not None:
                add_cross(gram, idx, block_inner(bsub, hsub))
        if new_data is not None and new_rows is None and span is not None:
            r = as_range(idx)
            if isinstance(r, slice):
                new_data[r, span[0] : span[1]] += block
            else:
                new_data[:, span[0] : span[1]].index_add_(0, idx, block)
        elif new_data is not None:
            pos, present = _positions(new_rows, rows)
            if not bool(present.any()):
                return
            n_new = self.num_rows if new_rows is None else new_rows.numel()
            flat_idx = (idx.unsqueeze(1) * n_new + pos[present].unsqueeze(0)).reshape(-1)
            new_data.view(self.num_groups * n_new, -1).index_add_(
                0, flat_idx, block[:, present].reshape(flat_idx.numel(), -1)
            )

    def _absorb_sparse(self, c: SparseRowContribution, keep: Rows, gram: Tensor, budget: int) -> None:
        self.strategies.add("rows")
        idx = c.groups
        gm = idx.numel()
        if gm == 0:
            return
        scatter_gram(gram, idx, idx, c.self_gram(budget))
        held, held_rows = self.data, self.rows
        if held is not None:
            pos, present = _positions(held_rows, c.pair_row)
            sel = present.nonzero().squeeze(1)
            cross = torch.zeros((gm, self.num_groups), dtype=self.dtype, device=self.device)
            step = max(1, budget // max(1, self.num_groups * c.row_numel))
            for a in range(0, sel.numel(), step):
                s = sel[a : a + step]
                hv = held[:, pos[s]].reshape(self.num_groups, s.numel(), -1)  # (G, p, D)
                pv = c.pair_vec[s].reshape(s.numel(), -1)  # (p, D)
                contrib = torch.einsum("gpd,pd->pg", hv, pv)
                cross.index_add_(0, c.pair_local[s], contrib)
            add_cross(gram, idx, cross)
        if keep is not None and keep.numel() == 0:
            self.data, self.rows = None, torch.empty(0, dtype=torch.long, device=self.device)
            self.sparse_exact = False
            return
        if self.sparse_exact:
            if held is None:
                support = c.rows
            else:
                assert held_rows is not None, "sparse_exact data always has explicit rows"
                support = torch.unique(torch.cat([held_rows, c.rows]))
            if keep is not None:
                support = support[_positions(keep, support)[1]]
            new_rows: Rows = support
        else:
            new_rows = keep
        if held is not None and self._same_rows(held_rows, new_rows):
            new_data = held
        else:
            new_data = self._restrict(new_rows)
        pos, present = _positions(new_rows, c.pair_row)
        n_new = self.num_rows if new_rows is None else new_rows.numel()
        flat = new_data.view(self.num_groups * n_new, -1)
        flat.index_add_(
            0, (c.pair_group * n_new + pos)[present], c.pair_vec[present].reshape(int(present.sum()), -1)
        )
        self.data, self.rows = new_data, new_rows
