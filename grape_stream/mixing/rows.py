"""The rows of a run of a rank's loader batches: which sample each row holds, and reading them in one pass.

A global batch's plan (:class:`~grape_stream.mixing.quotas.BatchPlan`) says how many samples of each
domain it takes and from which positions of each domain's global stream. Laid out grouped by domain
(domains in index order, each in stream order) that is ``G`` samples; slot ``s`` of the batch holds
grouped sample ``perm[s]``, ``perm`` a keyed permutation of ``[0, G)`` (a hash of ``(seed, global
batch)``: :func:`~grape_stream.mixing.counter_rng.slot_permutation`; with canonical nodes, one per
lane: :func:`emission`), so each slot's domain is
distributed as ``alpha`` and a slice of slots is a mixture too. A rank holds slots ``first_slot ...
first_slot + B - 1`` (:mod:`grape_stream.mixing.topology`) and evaluates the permutation at those slots
only: its work per batch is O(B), not O(G). Why runs rather than batches: each shard touched costs a
few microseconds of Python however few samples it gives, and every index below is computed for the
whole run (a DataLoader worker's message, or the main process's look-ahead) at once.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from grape_stream.mixing.batch_read import BatchReader
from grape_stream.mixing.counter_rng import TAG_PERM, hash64, keyed_permutation
from grape_stream.mixing.epoch_order import DomainOrder
from grape_stream.mixing.shard_reader import DomainReader
from grape_stream.mixing.topology import RankBatch

__all__ = ["RESERVED_KEYS", "emission", "read_by_domain", "run_columns"]

#: Keys the mixer adds to every sample; a dataset column with one of these names is refused.
RESERVED_KEYS = ("domain", "weights_version", "batch_index", "sample_index", "epoch")


def emission(orders: Sequence[DomainOrder], seed: int, batch_size: int, global_batch_size: int,
             batches: Sequence[RankBatch]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(domain, sample id, epoch) of every row of ``batches``, batch after batch (``batch_size`` rows each).

    Row ``t`` of a loader batch is slot ``s = first_slot + t`` of its global batch, slot ``l = s mod L`` of
    lane (canonical node) ``c = s // L`` (``L = G / C`` slots a lane): the lane's grouped sample ``g =
    perm_c(l)``, i.e. the ``g - c_{k-1}``-th of the lane's samples of domain ``k`` (``c`` the lane's
    cumulative quotas -- its share of the batch's deal, :meth:`BatchPlan.split` -- ``c_{k-1} <= g < c_k``),
    at position ``start_{c,k} + g - c_{k-1}`` of the lane's stream of domain ``k``. One lane: the permutation
    is keyed by ``(seed, batch)`` alone.
    """
    n_rows, g_size = int(batch_size), int(global_batch_size)
    runs = len(batches)
    lanes = batches[0].plan.lanes
    lane_len = g_size // lanes
    gb = np.fromiter((b.plan.batch for b in batches), np.int64, runs)
    first = np.fromiter((b.first_slot for b in batches), np.int64, runs)
    k_count = len(orders)
    slots = first[:, None] + np.arange(n_rows, dtype=np.int64)[None, :]
    lane = slots // lane_len
    c0, c1 = int(lane.min()), int(lane.max()) + 1  # the lanes these rows touch
    span = c1 - c0
    # (J, span, K) the lanes' quotas and read positions
    quota = np.stack([b.plan.quota if lanes == 1 else b.plan.split(range(c0, c1))
                      for b in batches]).reshape(runs, span, k_count)
    start = np.stack([b.plan.start.reshape(lanes, k_count)[c0:c1] for b in batches])
    if lanes == 1:
        keys: Any = hash64(seed, int(gb[0]), TAG_PERM) if runs == 1 else hash64(seed, gb[:, None], TAG_PERM)
    else:
        keys = hash64(seed, gb[:, None], TAG_PERM, lanes, lane)
    g = keyed_permutation(keys, lane_len, slots - lane * lane_len)
    cum = np.cumsum(quota, axis=2).reshape(runs * span, k_count)
    row = np.arange(runs, dtype=np.int64)[:, None] * span + (lane - c0)  # (J, B): which (batch, lane) row
    # One searchsorted for all rows: (batch, lane) row r's edges shifted by r * L stay sorted across rows.
    dom = np.searchsorted((cum + np.arange(runs * span)[:, None] * lane_len).reshape(-1),
                          (g + row * lane_len).reshape(-1), side="right").reshape(runs, n_rows) - row * k_count
    pos = (start.reshape(runs * span, k_count) - (cum - quota.reshape(runs * span, k_count)))[row, dom] + g
    dom, pos, lane = dom.reshape(-1), pos.reshape(-1), lane.reshape(-1)
    ids = np.empty_like(pos)
    epochs = np.empty_like(pos)
    key = dom * lanes + lane  # group by (domain, lane)
    by_key = np.argsort(key, kind="stable")
    sorted_key = key[by_key]
    cuts = np.flatnonzero(np.diff(sorted_key)) + 1
    for rows in np.split(by_key, cuts):
        k, c = divmod(int(key[rows[0]]), lanes)
        p = pos[rows]
        lo, hi = int(p.min()), int(p.max())
        if hi - lo < 4 * len(p) + 64:  # the rank reads most of this stretch: one forward window, sliced
            w_ids, w_epochs = orders[k].window_ids(lo, hi - lo + 1, c)
            ids[rows], epochs[rows] = w_ids[p - lo], w_epochs[p - lo]
        else:  # a few scattered positions (one slot in many): just those
            ids[rows], epochs[rows] = orders[k].ids_at(p, c)
    return dom, ids, epochs


def run_columns(orders: Sequence[DomainOrder], seed: int, batch_size: int, global_batch_size: int, names: Sequence[str],
                batches: Sequence[RankBatch], readers: Sequence[DomainReader],
                batch_reader: BatchReader | None) -> tuple[dict[str, Any], np.ndarray]:
    """Data columns and the (len(RESERVED_KEYS), rows) metadata of ``batches``' rows (see :func:`emission`).

    The samples are read in one pass over the shards they lie in (:class:`BatchReader`); when a shard
    does not allow that, domain by domain (same samples, same order).
    """
    dom, ids, epochs = emission(orders, seed, batch_size, global_batch_size, batches)
    cols = batch_reader.read(dom, ids) if batch_reader is not None else None
    data: dict[str, Any] = read_by_domain(dom, ids, readers, names) if cols is None else cols
    n = len(ids) // len(batches)
    rows = {"domain": dom, "sample_index": ids, "epoch": epochs,
            "weights_version": np.repeat(np.array([b.version for b in batches], np.int64), n),
            "batch_index": np.repeat(np.array([b.batch for b in batches], np.int64), n)}
    meta = np.empty((len(RESERVED_KEYS), len(ids)), np.int64)
    for i, key in enumerate(RESERVED_KEYS):
        meta[i] = rows[key]
    return data, meta


def read_by_domain(dom: np.ndarray, ids: np.ndarray, readers: Sequence[DomainReader],
                   names: Sequence[str]) -> dict[str, Any]:
    """The data columns of rows ``(dom, ids)`` read domain by domain (any shard format), in row order."""
    ks = np.unique(dom)
    where = [np.flatnonzero(dom == k) for k in ks.tolist()]
    parts: list[dict[str, Any]] = []
    for k, rows in zip(ks.tolist(), where):
        cols: dict[str, Any] | None = readers[k].read_batch(ids[rows])
        if cols is None:
            samples = readers[k].read(ids[rows])
            cols = {key: [r[key] for r in samples] for key in samples[0]}
        parts.append(cols)
    keys = list(parts[0])
    for p, k in zip(parts[1:], ks[1:]):
        if list(p) != keys:
            raise ValueError(
                f"domain {names[int(k)]!r} has columns {list(p)} but "
                f"{names[int(ks[0])]!r} has {keys}: all domains must have the same columns"
            )
    out: dict[str, Any] = {}
    n = len(ids)
    for key in keys:
        vals = [p[key] for p in parts]
        if all(isinstance(v, np.ndarray) for v in vals) and len({(v.dtype, v.shape[1:]) for v in vals}) == 1:
            col = np.empty((n, *vals[0].shape[1:]), vals[0].dtype)
            for rows, v in zip(where, vals):
                col[rows] = v
            out[key] = col
        else:
            flat: list[Any] = [None] * n
            for rows, v in zip(where, vals):
                for r, x in zip(rows.tolist(), v):
                    flat[r] = x
            out[key] = flat
    return out
