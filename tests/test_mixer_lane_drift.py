"""The canonical nodes keep pace with each other in every domain: the deal's rotation and its closed form.

Each global batch's samples, grouped by domain, are dealt to the ``C`` canonical nodes (lanes) round-robin from
a lane that changes batch by batch (the sum of the batch offset's digits mod ``C``). Dealt from lane 0 every
batch (the stream before ``grape_stream.mixer/4``), a domain whose share of a batch is below ``C`` went to the
low-numbered lanes only: they ran epochs ahead of the others in it, and two lanes in different epochs put
the same sample twice into one global batch. Pure planning: no shards, no processes.
"""

from __future__ import annotations

import numpy as np
import pytest

from grape_stream.mixing.epoch_order import DomainOrder
from grape_stream.mixing.lane_counts import EXPLICIT_BATCHES, LaneCounts
from grape_stream.mixing.planner import QuotaPlanner
from grape_stream.mixing.quotas import PieceQuotas, deal_rotation, lane_split
from grape_stream.mixing.rows import emission
from grape_stream.mixing.schedule import EffectiveSchedule
from grape_stream.mixing.topology import RankBatch


def _piece(rng: np.random.Generator, k: int, slots: int) -> PieceQuotas:
    alpha = rng.dirichlet(np.ones(k)) * (rng.random(k) > 0.25)
    alpha = alpha / alpha.sum() if alpha.sum() else np.full(k, 1 / k)
    return PieceQuotas(int(rng.integers(1 << 40)), int(rng.integers(0, 5000)), alpha, slots)


@pytest.mark.parametrize("lanes", [2, 3, 6, 8, 12, 128, 1024])
def test_the_closed_form_equals_the_batches_dealt_one_by_one(lanes):
    """Every lane's count of every domain over any stretch of a piece, from :class:`LaneCounts`, against
    dealing each batch's quotas from its rotation: stretches inside one block of 1024 batches, across
    blocks, longer than the batch-by-batch cut-off; lane counts that do not divide 1024 too."""
    rng = np.random.default_rng(lanes)
    for _ in range(3 if lanes < 128 else 1):
        k = int(rng.integers(1, 7))
        slots = lanes * int(rng.integers(1, 5)) if lanes < 1024 else 1024
        piece, n = _piece(rng, k, slots), 3 * EXPLICIT_BATCHES // 2 + 77
        closed = LaneCounts(piece, lanes)
        at = np.zeros((n + 1, lanes, k), np.int64)
        for d in range(n):
            at[d + 1] = at[d] + lane_split(piece.quota(d), lanes, rotation=piece.rotation(d, lanes))
        assert (at[1:] - at[:-1]).sum(axis=1).tolist() == [piece.quota(d).tolist() for d in range(n)]
        for d0, d1 in [(0, n), (0, 1), (5, 1023), (1000, 1030), (17, n - 3), (1024, 2048), (300, 2900), (n, n)]:
            assert np.array_equal(closed.counts(d0, d1), at[d1] - at[d0]), (d0, d1)
            # the whole-block form (what a long jump uses) against the stretch's offsets
            assert np.array_equal(closed.prefix(d1) - closed.prefix(d0), closed.residues(0, piece.offsets(d0, d1)))


def test_the_closed_form_over_a_million_batches_equals_their_offsets():
    """Past 1024**2 batches (whole blocks of the second digit): the residue counts from whole blocks equal
    those of the batches' offsets, one by one (vectorised)."""
    rng = np.random.default_rng(7)
    for lanes, k in [(8, 5), (6, 3), (128, 20)]:
        piece = _piece(rng, k, lanes * 8)
        closed = LaneCounts(piece, lanes)
        d = (1 << 20) + 3 * 1024 + 517
        assert np.array_equal(closed.prefix(d), closed.residues(0, piece.offsets(0, d)))
        assert np.array_equal(piece.prefix_hits(d), (piece.offsets(0, d)[:, None] < piece.threshold).sum(axis=0))


def test_the_rotation_is_even_over_every_block_of_1024_batches():
    rng = np.random.default_rng(3)
    piece = _piece(rng, 4, 64)
    for lanes in (2, 8, 64, 1024):
        for block in (0, 1, 977):
            rot = deal_rotation(piece.offsets(block * 1024, (block + 1) * 1024), lanes)
            assert np.bincount(rot, minlength=lanes).tolist() == [1024 // lanes] * lanes


def _schedule(n: int, every: int, k: int, seed: int, small: float | None = None) -> EffectiveSchedule:
    rng = np.random.default_rng(seed)
    sched = EffectiveSchedule()
    for v, start in enumerate(range(0, n, every)):
        alpha = rng.dirichlet(np.ones(k))
        if small is not None:  # domain 0 at about `small` of the batch: fewer samples a batch than lanes
            alpha = np.concatenate([[small * rng.uniform(0.5, 1.5)], alpha[1:] / alpha[1:].sum()])
            alpha[1:] *= 1 - alpha[0]
        sched.add(v, start, alpha)
    return sched


@pytest.mark.parametrize("composition", ["systematic", "multinomial"])
def test_jumps_equal_the_walk_with_budgets_and_lanes(composition):
    """A planner that jumps (closed form, bisection for the budgets) stands where one that plans every
    batch does, lane by lane: budgets that run out inside pieces, their batches clipped and re-drawn."""
    k, g, lanes, n = 4, 48, 8, 1500
    sched = _schedule(n, 130, k, 5)
    budgets = [3000, None, 9000, None]

    def planner() -> QuotaPlanner:
        return QuotaPlanner(seed=9, batch_size=g, composition=composition, budgets=budgets, lanes=lanes)

    walk = planner()
    ends = {}
    for i in range(n):
        plan = walk.plan(i, sched.segments)
        assert plan is not None and np.array_equal(plan.split().sum(axis=0), plan.quota)
        ends[i + 1] = plan.end()
    assert walk.counts[0] == 3000 and walk.counts[2] == 9000  # both budgets ran out on the way
    for stop in (1, 333, 1024, 1100, n):
        jump = planner()
        jump.advance_to(stop, sched.segments)
        assert np.array_equal(jump.position, ends[stop]), stop


def test_every_lane_keeps_pace_in_a_domain_smaller_than_the_lane_count():
    """Domain 0 gets about 3 samples of a 64-sample batch dealt to 8 lanes. Dealt from lane 0 every batch,
    lanes 3-7 would never read it (spread = lane 0's whole count: 10,800 after 30,000 batches); with the
    rotation every lane is within a few tens of samples of the others, after 3,000 batches as after 30,000
    (fixed weights), and within a few percent of a lane's count when the weights change every 50 batches."""
    k, g, lanes = 3, 64, 8
    fixed = EffectiveSchedule()
    fixed.add(0, 0, np.array([0.045, 0.4, 0.555]))
    p = QuotaPlanner(seed=1, batch_size=g, composition="systematic", budgets=[None] * k, lanes=lanes)
    for stop in (3000, 10_000, 30_000):
        p.advance_to(stop, fixed.segments)
        pos = p.position.reshape(lanes, k)
        assert np.ptp(pos, axis=0).max() <= 40, (stop, pos[:, 0])
    assert pos[:, 0].min() > 0.99 * 30_000 * g * 0.045 / lanes
    old = np.zeros(lanes, np.int64)  # the deal from lane 0, for contrast: lanes 3..7 never get domain 0
    walk = QuotaPlanner(seed=1, batch_size=g, composition="systematic", budgets=[None] * k, lanes=lanes)
    for i in range(300):
        old += lane_split(walk.plan(i, fixed.segments).quota, lanes)[:, 0]
    assert old[3:].sum() == 0 and old[0] == 300

    changing = _schedule(30_000, 50, k, 2, small=0.045)
    p = QuotaPlanner(seed=2, batch_size=g, composition="systematic", budgets=[None] * k, lanes=lanes)
    p.advance_to(30_000, changing.segments)
    pos = p.position.reshape(lanes, k)
    # 600 weight pieces: each piece's last partial block of offsets leaves a few samples of imbalance, a
    # random walk over the pieces (2.6% of domain 0 here); dealt from lane 0, lanes 5-7 would have none of it
    assert (np.ptp(pos, axis=0) <= 0.05 * pos.mean(axis=0)).all(), pos


def test_no_global_batch_holds_a_sample_twice_with_a_small_first_domain():
    """Every slot of 1,500 global batches of 64 (8 lanes; domain 0: 512 samples, 5-13% of each batch, weights
    changing every 50 batches, 17 epochs of it): no sample twice in one batch. In the stream before
    ``grape_stream.mixer/4`` (dealt from lane 0 every batch, each epoch's spans cut anew) this run put a
    sample of domain 0 twice into 33 of its batches: lanes epochs apart read overlapping spans. Now the lanes
    stay close, and their spans are disjoint for the whole run anyway."""
    k, g, lanes, n, seed = 3, 64, 8, 1500, 3
    sizes = [512, 50_000, 80_000]  # the big ones pass no epoch boundary twice: no sample repeats inside a lane
    sched = _schedule(n, 50, k, 0, small=0.09)
    orders = []
    for j, size in enumerate(sizes):
        shards = np.full(-(-size // 32), 32, np.int64)
        shards[-1] -= int(shards.sum() - size)
        orders.append(DomainOrder(shards, 100 + j, True, block_size=64, lanes=lanes))
    planner = QuotaPlanner(seed=seed, batch_size=g, composition="systematic", budgets=[None] * k, lanes=lanes)
    twice = []
    for i in range(n):
        plan = planner.plan(i, sched.segments)
        dom, ids, _ = emission(orders, seed, g, g, [RankBatch(i, plan, 0, True)])
        if len(np.unique(dom * 1_000_000 + ids)) < g:
            twice.append(i)
    assert planner.counts[0] > 16 * sizes[0]
    assert not twice, twice[:10]
