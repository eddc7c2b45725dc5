"""Canonical nodes (lanes): each node reads its own share of every domain, the per-batch quotas stay exact.

Pure planning (no shards, no processes): the lanes' quotas add up to the batch's, their closed-form positions
equal the batch-by-batch sums, every lane reads only its span of each epoch (whatever the weights), the lanes
together read every sample of an epoch once, and a physical node count that neither divides the canonical
one nor is a multiple of it is refused in one line. The deal's rotation and its closed form:
tests/test_mixer_lane_drift.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from grape_stream.errors import ConfigError
from grape_stream.mixing.epoch_order import DomainOrder
from grape_stream.mixing.planner import QuotaPlanner
from grape_stream.mixing.quotas import lane_split
from grape_stream.mixing.rows import emission
from grape_stream.mixing.schedule import EffectiveSchedule
from grape_stream.mixing.topology import RankBatch, Topology

K, G, C, SEED = 4, 48, 4, 11
SIZES = [400, 250, 180, 96]  # shards of 16 samples (the last partial)


def _schedule(n: int) -> EffectiveSchedule:
    rng = np.random.default_rng(2)
    sched = EffectiveSchedule()
    for v, start in enumerate(range(0, n, 7)):  # weights change every 7 batches, one domain sometimes at 0
        alpha = rng.dirichlet(np.ones(K))
        if v % 3 == 1:
            alpha[v % K] = 0.0
            alpha /= alpha.sum()
        sched.add(v, start, alpha)
    return sched


def _orders() -> list[DomainOrder]:
    out = []
    for k, n in enumerate(SIZES):
        shards = np.full(-(-n // 16), 16, np.int64)
        shards[-1] -= int(shards.sum() - n)
        out.append(DomainOrder(shards, 100 + k, True, block_size=64, lanes=C))
    return out


def test_lane_quotas_add_up_and_the_closed_form_matches_the_batches():
    n = 200
    sched = _schedule(n)
    one = QuotaPlanner(seed=SEED, batch_size=G, composition="systematic", budgets=[None] * K)
    lanes = QuotaPlanner(seed=SEED, batch_size=G, composition="systematic", budgets=[None] * K, lanes=C)
    pos = np.zeros((C, K), np.int64)
    for i in range(n):
        a, b = one.plan(i, sched.segments), lanes.plan(i, sched.segments)
        assert np.array_equal(a.quota, b.quota)  # the batch's quotas do not depend on the lanes
        split = lane_split(b.quota, C, rotation=b.rotation)
        assert np.array_equal(split, b.split())
        assert (split.sum(axis=1) == G // C).all() and np.array_equal(split.sum(axis=0), b.quota)
        assert (np.abs(split - b.quota / C) < 1).all()  # each lane floor or ceil of its share
        assert np.array_equal(b.start.reshape(C, K), pos)
        pos += split
    jump = QuotaPlanner(seed=SEED, batch_size=G, composition="systematic", budgets=[None] * K, lanes=C)
    jump.advance_to(n, sched.segments)  # closed form over the weight pieces
    assert np.array_equal(jump.position.reshape(C, K), pos)
    mid = QuotaPlanner(seed=SEED, batch_size=G, composition="systematic", budgets=[None] * K, lanes=C,
                       start_batch=90, start_counts=lanes_at(sched, 90))
    mid.advance_to(n, sched.segments)  # from a resumed position too
    assert np.array_equal(mid.position.reshape(C, K), pos)


def test_lane_split_deals_the_grouped_samples_round_robin():
    """lane_split's closed form (one comparison per lane and domain) against dealing the batch's samples,
    grouped by domain, to the lanes one by one from lane ``rotation``: zero quotas, one lane, many lanes, a
    subset of lanes."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        k, lanes = int(rng.integers(1, 12)), int(rng.choice([1, 2, 3, 4, 8, 128]))
        alpha = rng.dirichlet(np.ones(k)) * (rng.random(k) > 0.3)
        alpha = alpha / alpha.sum() if alpha.sum() else np.full(k, 1 / k)
        quota = rng.multinomial(lanes * int(rng.integers(1, 6)), alpha)
        rotation = int(rng.integers(0, lanes))
        dealt = np.zeros((lanes, k), np.int64)
        np.add.at(dealt, ((np.arange(quota.sum()) + rotation) % lanes, np.repeat(np.arange(k), quota)), 1)
        assert np.array_equal(lane_split(quota, lanes, rotation=rotation), dealt)
        which = range(int(rng.integers(0, lanes)), lanes)
        assert np.array_equal(lane_split(quota, lanes, which, rotation), dealt[which.start:])


def lanes_at(sched: EffectiveSchedule, batch: int) -> np.ndarray:
    p = QuotaPlanner(seed=SEED, batch_size=G, composition="systematic", budgets=[None] * K, lanes=C)
    p.advance_to(batch, sched.segments)
    return p.position


def test_each_node_reads_only_its_spans_and_the_lanes_cover_each_epoch_once():
    n = 60  # 60 x 48 samples: every domain passes at least one whole epoch
    sched, orders = _schedule(n), _orders()
    planner = QuotaPlanner(seed=SEED, batch_size=G, composition="systematic", budgets=[None] * K, lanes=C)
    plans = [planner.plan(i, sched.segments) for i in range(n)]
    nodes = 2  # 2 physical nodes of the 4 canonical ones: node p holds lanes 2p, 2p + 1
    seen: dict[tuple[int, int, int], int] = {}
    for p in range(nodes):
        topo = Topology.of(p, nodes, G // nodes, G, lanes=C, nodes=nodes)
        dom, ids, epochs = emission(orders, SEED, G // nodes, G, [RankBatch(i, plans[i], topo.first_slot(i), True)
                                                                  for i in range(n)])
        for k in range(K):
            allowed = set(np.concatenate([_span_ids(orders[k], c) for c in topo.my_lanes()]).tolist())
            assert set(ids[dom == k].tolist()) <= allowed, (p, k)  # every epoch: its lanes' spans, the same
        for d, i, e in zip(dom.tolist(), ids.tolist(), epochs.tolist()):
            seen[(d, e, i)] = seen.get((d, e, i), 0) + 1
    assert max(seen.values()) == 1  # no sample read twice in one epoch, across nodes
    for k in range(K):  # epoch 0 of every domain is read completely
        assert sum(1 for (d, e, _) in seen if d == k and e == 0) == SIZES[k]


def _span_ids(o: DomainOrder, lane: int) -> np.ndarray:
    """The sample ids of a lane's span: ``span_starts[lane] ... span_starts[lane + 1]`` of the run's shard layout
    (the shards, or parts of shards, that the lane reads every epoch)."""
    first, lengths = o._span_pieces()[lane]
    ids = np.concatenate([np.arange(f, f + n) for f, n in zip(first.tolist(), lengths.tolist())])
    assert len(ids) == o.span_starts[lane + 1] - o.span_starts[lane]
    return ids


def test_the_spans_are_disjoint_cover_the_domain_and_stay_put_across_epochs():
    """A lane reads the same samples in every epoch (its span of the run's shard layout, at most one shard
    shared with each neighbour), each once an epoch, in a new order; so two lanes never read the same sample,
    whatever epochs they are in."""
    o = _orders()[1]  # 250 samples, 16 shards of 16 (the last of 10), 4 lanes
    spans = [_span_ids(o, c) for c in range(C)]
    assert sorted(np.concatenate(spans).tolist()) == list(range(SIZES[1]))
    shards = [set(o.shard_of(s).tolist()) for s in spans]
    for c in range(C):
        for other in range(c + 1, C):
            assert len(shards[c] & shards[other]) <= (1 if other == c + 1 else 0)
    for c in range(C):
        n = int(o.lane_lens[c])
        orders_seen = set()
        for e in range(4):
            ids, epochs = o.sample_ids(e * n, n, c)
            assert sorted(ids.tolist()) == sorted(spans[c].tolist()) and (epochs == e).all()
            orders_seen.add(tuple(ids.tolist()))
        assert len(orders_seen) == 4  # a new order every epoch


def test_an_incompatible_node_count_is_refused_in_one_line():
    Topology.of(0, 16, 4, 64, lanes=4, nodes=2)  # 2 nodes divide 4
    Topology.of(0, 16, 4, 64, lanes=4, nodes=8)  # 8 nodes are a multiple of 4
    with pytest.raises(ConfigError, match="3 physical nodes cannot read the stream of canonical_nodes=4") as err:
        Topology.of(0, 12, 4, 48, lanes=4, nodes=3)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="must be a positive integer that divides"):
        Topology.of(0, 1, 8, 8, lanes=3, nodes=1)
