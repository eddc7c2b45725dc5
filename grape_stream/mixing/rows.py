"""The rows of a run of consecutive batches: which sample each row holds, and reading them in one pass.

A plan (:class:`~grape_stream.mixing.quotas.BatchPlan`) says how many samples of each domain a batch
takes and from which read position; this module turns plans into rows (domain, sample id, epoch) in
emission order and reads their columns. Why runs rather than batches: a batch of 32 samples from 20
domains touches ~20 shards, and each shard touched costs a few microseconds of Python however few
samples it gives; a run of 16 such batches (a DataLoader worker's message, or the main process's
look-ahead) touches each shard about once, and every index below is computed for the whole run at once.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from grape_stream.mixing.batch_read import BatchReader
from grape_stream.mixing.epoch_order import DomainOrder
from grape_stream.mixing.quotas import TAG_PERM, BatchPlan, hash64
from grape_stream.mixing.shard_reader import DomainReader

__all__ = ["RESERVED_KEYS", "emission", "read_by_domain", "run_columns"]

#: Keys the mixer adds to every sample; a dataset column with one of these names is refused.
RESERVED_KEYS = ("domain", "weights_version", "batch_index", "sample_index", "epoch")


def emission(orders: Sequence[DomainOrder], seed: int, rank: int,
             plans: Sequence[BatchPlan]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(domain, sample id, epoch) of every row of ``plans``, batch after batch.

    Emission slot ``j`` of a batch holds the ``perm[j]``-th sample of the batch grouped by domain
    (domains in index order, each in its read order), ``perm`` =
    :func:`~grape_stream.mixing.quotas.slot_permutation` (the same hash, computed here for all batches). When the
    plans continue one another (each domain's read position is where the previous batch left it, as
    for the batches one process composes in a row), each domain's ids for the whole run are one
    window of its order and every index below is computed for all batches at once.
    """
    quota = np.stack([p.quota for p in plans])  # (J, K)
    start = np.stack([p.start for p in plans])
    sizes = quota.sum(axis=1)
    if len(plans) > 1 and ((sizes != sizes[0]).any() or (start[1:] != start[:-1] + quota[:-1]).any()):
        parts = [emission(orders, seed, rank, [p]) for p in plans]
        return tuple(np.concatenate(c) for c in zip(*parts))  # type: ignore[return-value]
    runs, k_count = quota.shape
    total = quota.sum(axis=0)
    ks = np.flatnonzero(total)
    windows = [orders[k].window_ids(s, t)
               for k, s, t in zip(ks.tolist(), start[0, ks].tolist(), total[ks].tolist())]
    ids = np.concatenate([w[0] for w in windows])
    epochs = np.concatenate([w[1] for w in windows])
    # Row r of the grouped layout (batch j, domain k, t-th sample of k in j) reads the window of
    # domain k at (samples of k in batches before j) + t.
    first = np.zeros(k_count, np.int64)
    first[ks] = np.cumsum(total[ks]) - total[ks]
    lens = quota.reshape(-1)
    base = (first[None, :] + np.cumsum(quota, axis=0) - quota).reshape(-1)
    ends = np.cumsum(lens)
    grouped = np.repeat(base - (ends - lens), lens) + np.arange(int(ends[-1]), dtype=np.int64)
    dom_grouped = np.repeat(np.tile(np.arange(k_count, dtype=np.int64), runs), lens)
    n = int(sizes[0])
    slots = np.arange(n, dtype=np.int64)
    if runs == 1:  # slot_permutation's hash: leading scalar keys cost far less than an array of one
        keys = hash64(seed, plans[0].batch, rank, TAG_PERM, slots)
    else:
        batches = np.array([p.batch for p in plans], np.int64)
        keys = hash64(seed, batches[:, None], rank, TAG_PERM, slots[None, :])
    rows = (np.argsort(keys.reshape(runs, n), axis=1, kind="stable") + n * np.arange(runs)[:, None]).reshape(-1)
    src = grouped[rows]
    return dom_grouped[rows], ids[src], epochs[src]


def run_columns(orders: Sequence[DomainOrder], seed: int, rank: int, names: Sequence[str], plans: Sequence[BatchPlan],
                readers: Sequence[DomainReader], batch_reader: BatchReader | None) -> tuple[dict[str, Any], np.ndarray]:
    """Data columns and the (len(RESERVED_KEYS), rows) metadata of ``plans``' rows (see :func:`emission`).

    The samples are read in one pass over the shards they lie in (:class:`BatchReader`); when a shard
    does not allow that, domain by domain (same samples, same order).
    """
    dom, ids, epochs = emission(orders, seed, rank, plans)
    cols = batch_reader.read(dom, ids) if batch_reader is not None else None
    data: dict[str, Any] = read_by_domain(dom, ids, readers, names) if cols is None else cols
    n = len(ids) // len(plans)
    rows = {"domain": dom, "sample_index": ids, "epoch": epochs,
            "weights_version": np.repeat(np.array([p.version for p in plans], np.int64), n),
            "batch_index": np.repeat(np.array([p.batch for p in plans], np.int64), n)}
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
