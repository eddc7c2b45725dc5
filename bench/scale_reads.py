"""What one node downloads over a whole simulated run: its rows from the real planner, through an exact LRU cache.

``node_pass`` walks the global stream batch by batch with the mixer's ``QuotaPlanner`` and asks
``rows.emission`` for the rows of node 0 (slots ``[0, G / nodes)`` of every global batch: its 8 ranks'
slices in rank order, which ``bench/scale.py`` checks against the ranks' own slices) a chunk of batches at
a time. Each row's shard goes through a per-domain LRU cache of ``cache_limit / K`` shards (the mixer splits
``cache_limit`` evenly across the domains), in row order; a miss downloads the whole shard. That gives the
read amplification (bytes downloaded / bytes of the rows), the GETs per domain prefix, and the distinct
shards per 1,000 batches of node 0 and of two of its ranks. It runs for any canonical node count, so the
stream before canonical nodes (``C = 1``: byte for byte the code before them) and after (``C`` = nodes)
are measured the same way.

``lane_walk`` is the cheaper, independent figure for a node that reads all of one lane: every position of
lane 0's stream in order, accesses inside one shuffle block collapsed to each shard's first one; its
``cache_needed_shards`` is the widest block's shards + 1 per domain (what ``cache_limit`` must hold to
download each shard once per pass).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
from scale_plan import SEED, G, K, Stream

from grape_stream.mixing.rows import emission
from grape_stream.mixing.topology import RankBatch

__all__ = ["ShardTable", "node_pass", "lane_walk"]


class ShardTable:
    """Every shard's first sample id, all domains in one sorted table (domain k's ids offset by k << 40)."""

    def __init__(self, stream: Stream) -> None:
        self.first_ids = np.concatenate([k * (1 << 40) + np.concatenate([[0], np.cumsum(s)[:-1]])
                                         for k, s in enumerate(stream.shards)])
        self.base = np.concatenate([[0], np.cumsum([len(s) for s in stream.shards])[:-1]])
        self.samples = list(stream.shards)

    def shard(self, dom: np.ndarray, ids: np.ndarray) -> np.ndarray:
        key = dom.astype(np.int64) * (1 << 40) + ids
        return np.searchsorted(self.first_ids, key, side="right") - 1 - self.base[dom]


class WindowLog:
    """Distinct (window of 1,000 batches, domain, shard) keys, deduplicated as they come."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def add(self, batch: np.ndarray, dom: np.ndarray, shard: np.ndarray) -> None:
        self.parts.append(np.unique(((batch // 1000) << 40) | (dom.astype(np.int64) << 32) | shard))

    def per_window(self) -> float:
        keys = np.unique(np.concatenate(self.parts))
        return float(np.unique(keys >> 40, return_counts=True)[1].mean())

    def per_domain(self, windows: float) -> np.ndarray:
        keys = np.unique(np.concatenate(self.parts))
        return np.bincount((keys >> 32) & 0xFF, minlength=K) / windows


class LRU:
    """One domain's shard cache of ``cap`` shards: downloads counted exactly, access by access."""

    def __init__(self, cap: int) -> None:
        self.cap, self.cache, self.downloads = cap, OrderedDict[int, None](), 0

    def access(self, shards: np.ndarray) -> np.ndarray:
        """Read ``shards`` in order; returns the shards downloaded (misses), in order."""
        if len(shards) == 0:
            return shards
        keep = np.ones(len(shards), bool)
        keep[1:] = shards[1:] != shards[:-1]  # a repeat of the last shard read is always a hit
        cache, cap, missed = self.cache, self.cap, []
        for s in shards[keep].tolist():
            if s in cache:
                cache.move_to_end(s)
            else:
                missed.append(s)
                cache[s] = None
                if len(cache) > cap:
                    cache.popitem(last=False)
        self.downloads += len(missed)
        return np.array(missed, np.int64)


def node_pass(stream: Stream, nodes: int, lanes: int, cache_shards: int, rank_sizes: tuple[int, ...], *,
              chunk: int = 250, keep_rows: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Node 0 of ``nodes`` nodes over all ``stream.batches`` global batches of the stream of ``lanes``
    canonical nodes: downloads through its cache, distinct shards per 1,000 batches of the node and of its
    first and last rank for each rank batch size in ``rank_sizes`` (``{size: mean of the two}``), and its
    rows at the batches ``keep_rows`` (for the check against the ranks' slices)."""
    rows_per = G // nodes
    table = ShardTable(stream)
    orders, planner = stream.orders(lanes), stream.planner(lanes)
    caches = [LRU(max(1, cache_shards // K)) for _ in range(K)]
    downloaded = consumed = 0
    node_log = WindowLog()
    rank_logs = {(b, r): WindowLog() for b in rank_sizes for r in sorted({0, rows_per // b - 1})}
    kept: dict[int, np.ndarray] = {}
    for c0 in range(0, stream.batches, chunk):
        run = [RankBatch(i, planner.plan(i, stream.schedule.segments), 0, True)
               for i in range(c0, min(stream.batches, c0 + chunk))]
        dom, ids, _ = emission(orders, SEED, rows_per, G, run)
        batch = np.repeat(np.arange(c0, c0 + len(run), dtype=np.int64), rows_per)
        shard = table.shard(dom, ids)
        node_log.add(batch, dom, shard)
        slot = np.tile(np.arange(rows_per), len(run))
        for (b, r), log in rank_logs.items():
            sel = (slot >= r * b) & (slot < (r + 1) * b)
            log.add(batch[sel], dom[sel], shard[sel])
        order = np.argsort(dom, kind="stable")  # each domain's rows, in row order
        cuts = np.searchsorted(dom[order], np.arange(1, K))
        for k, rows in enumerate(np.split(order, cuts)):
            missed = caches[k].access(shard[rows])
            downloaded += int(table.samples[k][missed].sum())
        consumed += len(ids)
        for i in keep_rows & set(range(c0, c0 + len(run))):
            j = (i - c0) * rows_per
            kept[i] = np.stack([dom[j:j + rows_per], ids[j:j + rows_per]])
    windows = stream.batches / 1000
    return {"amplification": downloaded / consumed, "downloaded_samples": downloaded, "consumed_samples": consumed,
            "downloads_per_domain": [c.downloads for c in caches], "cache_shards_per_domain": caches[0].cap,
            "shards_per_node_per_1k": float(node_log.per_domain(windows).sum()),
            "shards_per_rank_per_1k": {b: float(np.mean([log.per_window() for (bb, _), log in rank_logs.items()
                                                         if bb == b])) for b in rank_sizes},
            "node_rows": kept}


def lane_walk(stream: Stream, lanes: int, cache_shards: int) -> dict[str, Any]:
    """Node 0 of ``lanes`` nodes (one lane each) reads every position of lane 0 of every domain, in order:
    its downloads through an LRU cache of ``cache_shards // K`` shards per domain, accesses inside one
    shuffle block of the lane's span collapsed to each shard's first one (the block's shards stay cached
    while it is read when the cache holds them all, which ``cache_needed_shards`` checks against the cache)."""
    orders, planner = stream.orders(lanes), stream.planner(lanes)
    planner.advance_to(stream.batches, stream.schedule.segments)
    end = planner.position.reshape(lanes, K)[0]
    cap = max(1, cache_shards // K)
    downloaded = consumed = need = 0
    for k in range(K):
        o, spc = orders[k], stream.shards[k]
        n_lane, bs = int(o.lane_lens[0]) if lanes > 1 else o.num_samples, o.block_size
        cache = LRU(cap)
        widest = 0
        for lo in range(0, int(end[k]), 1 << 22):
            p = np.arange(lo, min(int(end[k]), lo + (1 << 22)), dtype=np.int64)
            shard = o.shard_of(o.ids_at(p, 0)[0] if lanes > 1 else o.ids_at(p)[0])
            group = (p // n_lane) * (n_lane // bs + 1) + (p % n_lane) // bs  # (lane epoch, block)
            key = group * (1 << 24) + shard
            uniq, first = np.unique(key, return_index=True)
            seq = uniq[np.argsort(first)]
            widest = max(widest, int(np.bincount(np.unique(seq >> 24, return_inverse=True)[1]).max()))
            downloaded += int(spc[cache.access(seq & ((1 << 24) - 1))].sum())
        consumed += int(end[k])
        need += widest + 1
    return {"amplification": downloaded / consumed, "cache_needed_shards": need, "cache_shards_per_domain": cap}
