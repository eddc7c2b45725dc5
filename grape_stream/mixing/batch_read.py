"""Reading one whole batch at once: every sample of every domain, grouped by shard, in emission order.

Why: a batch of ``B`` samples from ``K`` domains touches many shards. Reading domain by domain, then
concatenating and permuting, costs a fixed amount of numpy calls per domain plus two extra copies.
:class:`BatchReader` numbers the shards of all domains in one table, finds the shard of every sample of
the batch with one ``searchsorted``, sorts the samples by shard and copies each shard's samples with
one fancy index straight to their final rows (see :mod:`grape_stream.mixing.shard_view`). The Python
work per batch is one loop step per shard touched; nothing runs per sample.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from grape_stream.mixing.shard_reader import DomainReader

__all__ = ["BatchReader"]


class BatchReader:
    """Reads samples given as ``(domain, sample id)`` pairs from the K domains' readers."""

    def __init__(self, readers: Sequence[DomainReader]) -> None:
        self.readers = list(readers)
        sizes = [int(np.sum(r.dataset.samples_per_shard)) for r in readers]
        offsets = [np.asarray(r.dataset.sample_offset_per_shard, np.int64) for r in readers]  # first id per shard
        self.domain_base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.shard_first = np.concatenate([o + b for o, b in zip(offsets, self.domain_base)])
        # Per global shard: (its domain's reader, its index there), as Python objects for the loop below.
        self.shard_owner = [(self.readers[k], i) for k, o in enumerate(offsets) for i in range(len(o))]
        self.enabled = True  # set False once a shard needs the per-sample path: the caller reads per domain

    def read(self, domains: np.ndarray, sample_ids: np.ndarray) -> dict[str, np.ndarray] | None:
        """Columns ``(n, ...)`` of the samples, row ``j`` = sample ``sample_ids[j]`` of domain ``domains[j]``.

        None when some shard is not uniform (see :func:`grape_stream.mixing.shard_view.uniform_layout`)
        or the domains' columns differ; the caller then reads domain by domain.
        """
        if not self.enabled:
            return None
        n = len(sample_ids)
        gid = self.domain_base[domains] + sample_ids
        gshard = np.searchsorted(self.shard_first, gid, side="right") - 1
        local = gid - self.shard_first[gshard]
        order = np.argsort(gshard, kind="stable")
        sorted_shards = gshard[order]
        cuts = (np.flatnonzero(sorted_shards[1:] != sorted_shards[:-1]) + 1).tolist()
        bounds = [0, *cuts, n]
        starts = sorted_shards[bounds[:-1]].tolist()
        single = len(bounds) == 2  # one shard: rows in requested order already
        local_sorted = local if single else local[order]
        buf: dict[str, np.ndarray] | None = None
        signature = None
        owner = self.shard_owner
        for a, b, gs in zip(bounds[:-1], bounds[1:], starts):
            reader, shard = owner[gs]
            m = reader.uniform(shard)
            if m is None:
                self.enabled = False
                return None
            if buf is None:
                buf, signature = m.empty_batch(n), m.signature
            elif m.signature != signature:
                return None  # the domains' columns differ: the per-domain path names them
            # straight to the requested rows (one copy, no reordering pass afterwards)
            m.take_into(local_sorted[a:b], buf, slice(0, n) if single else order[a:b])
        assert buf is not None and m is not None
        return m.as_values(buf)
