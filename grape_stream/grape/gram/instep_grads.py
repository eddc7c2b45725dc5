"""The training step's own parameter gradients, split by domain on the way, and their alignments.

In-step alignments (:mod:`grape_stream.grape.gram.instep`) need, for every parameter p and domain k, the
inner product of domain k's share of the step's gradient with fixed directions u_d (the target direction
kept from the last task probe): M[k, d] += <sum_{s in k} w_s grad_p l_s, u_d,p>. The step computes each
parameter's gradient anyway; this module computes it *per domain* and sums the parts:

* matmul layers (Linear, HF Conv1D, an unembedding): the weight gradient dY^T X is a sum over token rows,
  so taking it over each domain's rows separately (one matmul per domain present: the same flops as the
  one matmul autograd would do) gives the K parts for free; each part's inner product with u costs
  in * out flops, K of them per layer against the step's 2 * tokens * in * out. Rows must be contiguous
  per domain: they are when the batch is sorted by domain, else they are gathered once per layer.
* embeddings: the gradient lives on the rows of the ids used; per token dY_t . u[id_t] (tokens x d).
* norms / element-wise affine (and every bias): per-token products dY_t * n(x_t), summed per domain.

The gradient returned to autograd is the sum of the parts, so ``.grad``, gradient accumulation and DDP's
all-reduce see the ordinary gradient (to rounding: a sum of K partial matmuls instead of one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DomainParts", "GradUse", "PartStore", "use_grads"]


class DomainParts:
    """Which domain each sample of the current micro-batch belongs to, as contiguous runs of a sorted order.

    ``domains`` (B,) int64 in [0, K). ``order`` is None when the batch is already sorted by domain (rows are
    then taken as views), else the stable sort permutation of the samples.
    """

    def __init__(self, domains: Tensor, num_domains: int) -> None:
        d = domains.reshape(-1).long()
        if d.numel() and (int(d.min()) < 0 or int(d.max()) >= num_domains):
            raise ValueError(f"domain ids must lie in [0, {num_domains}); got {sorted(set(d.tolist()))}")
        self.num_domains = num_domains
        self.batch_size = int(d.numel())
        self.sample_domains = d
        sorted_d, order = torch.sort(d, stable=True)
        self.order: Optional[Tensor] = None if bool(torch.equal(sorted_d, d)) else order
        ks, counts = torch.unique_consecutive(sorted_d, return_counts=True)
        self.domains = ks  # (K_m,) present domains, ascending
        ends = torch.cumsum(counts, 0).tolist()
        self.segments = list(zip([0, *ends[:-1]], ends))  # per present domain: [start, end) samples in sorted order
        self._onehot: dict[torch.dtype, Tensor] = {}

    def onehot(self, dtype: torch.dtype) -> Tensor:
        """(K_m, B) indicator of each sample's domain (rows: present domains), for per-domain sums."""
        if dtype not in self._onehot:
            local = torch.searchsorted(self.domains, self.sample_domains)
            m = torch.zeros((self.domains.numel(), self.batch_size), dtype=dtype, device=self.sample_domains.device)
            m[local, torch.arange(self.batch_size, device=m.device)] = 1
            self._onehot[dtype] = m
        return self._onehot[dtype]

    def per_domain(self, x: Tensor, rows: int) -> Tensor:
        """(B * rows, f) token rows -> (K_m, f) per-domain sums."""
        per_sample = x.reshape(self.batch_size, rows, -1).sum(1)
        return self.onehot(per_sample.dtype) @ per_sample

    def sorted_rows(self, x: Tensor, rows: int) -> Tensor:
        """(B * rows, f) token rows in domain order (a view when the batch is already sorted)."""
        if self.order is None:
            return x
        return x.reshape(self.batch_size, rows, -1).index_select(0, self.order).reshape(x.shape)


@dataclass
class GradUse:
    """What one hooked call needs in the backward: its kind, input (or basis n(x)), rows per sample."""

    kind: str
    inp: Tensor
    rows: Optional[int]  # None: rows not attributable to samples (gradient only, no alignment)
    padding_idx: Optional[int] = None
    eps: Optional[float] = None
    normalized_shape: tuple[int, ...] = ()


class PartStore:
    """Keeps each domain's part of every parameter's gradient: store[id(p)] (K, *shape), summed over calls.

    The task probe of in-step alignments uses it (domains = tasks) to get every task's gradient from one
    backward; it costs K gradient copies while it lives."""

    def __init__(self, num_domains: int, keep: Optional[set[int]] = None) -> None:
        self.num_domains = num_domains
        self.grads: dict[int, Tensor] = {}
        self.keep = keep  # the ids of the parameters whose parts are kept (None: every parameter)

    def _buf(self, p: Tensor, dtype: torch.dtype) -> Tensor:
        buf = self.grads.get(id(p))
        if buf is None:
            buf = self.grads[id(p)] = torch.zeros((self.num_domains, *p.shape), dtype=dtype, device=p.device)
        return buf

    def add(self, p: Tensor, domain: int, part: Tensor) -> None:
        if self.keep is None or id(p) in self.keep:
            self._buf(p, part.dtype)[domain] += part.reshape(p.shape)

    def add_rows(self, p: Tensor, domain: int, ids: Tensor, vecs: Tensor) -> None:
        if self.keep is None or id(p) in self.keep:
            self._buf(p, vecs.dtype)[domain].index_add_(0, ids, vecs)


def _dots(part: Tensor, u: Optional[Tensor]) -> Optional[Tensor]:
    """(K_m, *shape) per-domain parts . (D, *shape) directions -> (K_m, D), or None without a direction."""
    if u is None:
        return None
    return part.reshape(part.shape[0], -1) @ u.reshape(u.shape[0], -1).to(part.dtype).t()


def _keep(store: Optional[PartStore], p: Tensor, parts: DomainParts, per: Tensor) -> None:
    if store is not None:
        for j, k in enumerate(parts.domains.tolist()):
            store.add(p, k, per[j])


def _matmul_weight(use: GradUse, x: Tensor, dy: Tensor, parts: Optional[DomainParts], u: Optional[Tensor],
                   store: Optional[PartStore], p: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """Weight gradient of a matmul layer (Linear: dY^T X; Conv1D: X^T dY), and its per-domain dots."""
    left, right = (dy, x) if use.kind == "linear" else (x, dy)
    if parts is None or use.rows is None:
        return left.t() @ right, None
    left, right = parts.sorted_rows(left, use.rows), parts.sorted_rows(right, use.rows)
    flat_u = None if u is None else u.reshape(u.shape[0], -1).to(left.dtype)
    grad: Optional[Tensor] = None
    dots = []
    for j, (a, b) in enumerate(parts.segments):
        part = left[a * use.rows : b * use.rows].t() @ right[a * use.rows : b * use.rows]
        if flat_u is not None:
            dots.append(flat_u @ part.reshape(-1))
        if store is not None:
            store.add(p, int(parts.domains[j]), part)
        grad = part if grad is None else grad.add_(part)
    assert grad is not None, "a micro-batch has at least one sample"
    return grad, (torch.stack(dots) if dots else None)


def _embedding(use: GradUse, ids: Tensor, dy: Tensor, p: Tensor, parts: Optional[DomainParts],
               u: Optional[Tensor], store: Optional[PartStore]) -> tuple[Tensor, Optional[Tensor]]:
    num_rows = p.shape[0]
    ids = ids.reshape(-1).long()
    vecs = dy.reshape(ids.numel(), -1)
    keep = None if use.padding_idx is None else ids != (use.padding_idx % num_rows)
    grad = torch.zeros((num_rows, vecs.shape[1]), dtype=vecs.dtype, device=vecs.device)
    grad.index_add_(0, ids if keep is None else ids[keep], vecs if keep is None else vecs[keep])
    if parts is None or use.rows is None:
        return grad, None
    if store is not None:
        sids = parts.sorted_rows(ids.unsqueeze(1), use.rows).squeeze(1)
        svecs = parts.sorted_rows(vecs if keep is None else vecs * keep.unsqueeze(1).to(vecs.dtype), use.rows)
        for j, (a, b) in enumerate(parts.segments):
            r0, r1 = a * use.rows, b * use.rows
            store.add_rows(p, int(parts.domains[j]), sids[r0:r1], svecs[r0:r1])
    if u is None:
        return grad, None
    tok = torch.einsum("nf,dnf->nd", vecs, u.to(vecs.dtype)[:, ids])  # (n, D): dY_t . u[id_t]
    if keep is not None:
        tok = tok * keep.unsqueeze(1).to(tok.dtype)
    return grad, parts.per_domain(tok, use.rows)


def _basis(use: GradUse, x: Tensor) -> Tensor:
    """n(x) of an element-wise affine call (the stored unit output, or the norm recomputed from x)."""
    if use.kind == "affine":
        return x
    if use.kind == "layernorm":
        return F.layer_norm(x, use.normalized_shape, None, None, 1e-5 if use.eps is None else use.eps)
    eps = use.eps if use.eps is not None else torch.finfo(x.dtype).eps
    return F.rms_norm(x, use.normalized_shape, None, eps)


def use_grads(use: GradUse, grad: Tensor, params: dict[str, Tensor], parts: Optional[DomainParts],
              directions: dict[str, Optional[Tensor]], dtype: torch.dtype, store: Optional[PartStore] = None,
              ) -> tuple[dict[str, Tensor], Optional[Tensor]]:
    """({name: gradient of this call for each parameter}, (K_m, D) per-domain alignments or None).

    ``grad`` is dY of the call; ``params`` its (in-scope) parameters; ``directions[name]`` the (D, *shape)
    directions of each parameter (None: none); ``dtype`` the dtype the maths runs in; ``store``: also keep
    each domain's part of every gradient there.
    """
    out: dict[str, Tensor] = {}
    total: Optional[Tensor] = None

    def add(d: Optional[Tensor]) -> None:
        nonlocal total
        if d is not None:
            total = d if total is None else total + d

    inp = use.inp
    if use.kind in ("linear", "conv1d"):
        x = inp.reshape(-1, inp.shape[-1]).to(dtype)
        dy = grad.reshape(-1, grad.shape[-1]).to(dtype)
        if "weight" in params:
            out["weight"], d = _matmul_weight(use, x, dy, parts, directions.get("weight"), store, params["weight"])
            add(d)
        if "bias" in params:
            out["bias"], d = _bias(dy, use, parts, directions.get("bias"), store, params["bias"])
            add(d)
    elif use.kind == "embedding":
        out["weight"], d = _embedding(use, inp, grad.to(dtype), params["weight"], parts, directions.get("weight"),
                                      store)
        add(d)
    else:  # layernorm / rmsnorm / affine: y = w * n(x) + b over the trailing dims
        shape = use.normalized_shape
        feat = math.prod(shape)
        dy = grad.to(dtype).reshape(-1, feat)
        if "weight" in params:
            q = dy * _basis(use, inp.to(dtype)).reshape(-1, feat)
            if parts is None or use.rows is None:
                out["weight"] = q.sum(0).reshape(shape)
            else:
                per = parts.per_domain(q, use.rows)
                out["weight"] = per.sum(0).reshape(shape)
                add(_dots(per, directions.get("weight")))
                _keep(store, params["weight"], parts, per)
        if "bias" in params:
            out["bias"], d = _bias(dy, use, parts, directions.get("bias"), store, params["bias"])
            out["bias"] = out["bias"].reshape(shape)
            add(d)
    grads = {k: g.to(params[k].dtype).reshape(params[k].shape) for k, g in out.items()}
    return grads, total


def _bias(dy: Tensor, use: GradUse, parts: Optional[DomainParts], u: Optional[Tensor], store: Optional[PartStore],
          p: Tensor) -> tuple[Tensor, Any]:
    if parts is None or use.rows is None:
        return dy.sum(0), None
    per = parts.per_domain(dy, use.rows)
    _keep(store, p, parts, per)
    return per.sum(0), _dots(per, u)
