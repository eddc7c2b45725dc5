"""Batch-composition math of the mixer (grape_stream.mixing.quotas / planner / counter_rng / epoch_order),
against slow references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grape_stream.mixing.counter_rng import (
    TAG_MULTI,
    TAG_PERM,
    TAG_REFILL,
    TAG_STRATA,
    hash64,
    keyed_permutation,
    slot_permutation,
    uniform01,
)
from grape_stream.mixing.epoch_order import DomainOrder
from grape_stream.mixing.planner import QuotaPlanner
from grape_stream.mixing.quotas import PieceQuotas, batch_quota, budget_for, systematic_counts
from grape_stream.mixing.schedule import EffectiveSchedule


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


# ---------------------------------------------------------------------------------------------------
# slow references
# ---------------------------------------------------------------------------------------------------
def slow_systematic(alpha: np.ndarray, slots: int, u: float) -> np.ndarray:
    """Slot s goes to the domain whose cumulative interval [c_{k-1}, c_k) holds (s + u) / slots."""
    edges = np.concatenate([[0.0], np.cumsum(alpha) / np.sum(alpha)])
    counts = np.zeros(len(alpha), np.int64)
    for s in range(slots):
        x = (s + u) / slots
        for k in range(len(alpha)):
            if alpha[k] > 0 and edges[k] <= x < edges[k + 1] + (1e-12 if k == len(alpha) - 1 else 0):
                counts[k] += 1
                break
        else:  # x fell on the float edge of the last positive interval
            counts[np.flatnonzero(alpha > 0)[-1]] += 1
    return counts


def slow_effective(alpha: np.ndarray, avail: np.ndarray) -> np.ndarray:
    a = np.array([alpha[k] if avail[k] else 0.0 for k in range(len(alpha))])
    return a / a.sum() if a.sum() > 0 else avail / avail.sum()


def slow_offset(seed, origin, d):
    """u of a piece's batch d by the documented digit formula, one digit at a time (docs/mixer.md)."""
    u_int = int(hash64(seed, origin, TAG_STRATA, 3, d // 1024 ** 3)[0]) >> 42  # the low 22 bits
    for level in (2, 1, 0):
        digit = (d // 1024 ** level) % 1024
        block = d // 1024 ** (level + 1)
        perm = keyed_permutation(hash64(seed, origin, TAG_STRATA, level, block), 1024, np.arange(1024))
        u_int += int(perm[digit]) * 2 ** (52 - 10 * (level + 1))
    return u_int / 2.0 ** 52


def slow_counts(entries, seed, G, budgets, n_batches):
    """Per-batch quotas by the documented rule, one batch and one slot at a time."""
    K = len(entries[0][2])
    budgets = np.array([np.iinfo(np.int64).max if b is None else b for b in budgets])
    counts = np.zeros(K, np.int64)
    per_batch = []
    for j in range(n_batches):
        active = max((e for e in entries if e[1] <= j), key=lambda e: e[0])  # the highest version in force
        origin = active[1]  # where those weights took effect: the key of their offsets
        avail = counts < budgets
        if not avail.any():
            break
        alpha = slow_effective(active[2], avail)
        q = slow_systematic(alpha, G, slow_offset(seed, origin, j - origin))
        rem = budgets - counts
        excess = int(np.maximum(q - rem, 0).sum())
        q = np.minimum(q, rem)
        rnd = 0
        while excess:
            rnd += 1
            room = counts + q < budgets
            if not room.any():
                return per_batch, counts
            u2 = float(uniform01(hash64(seed, j, TAG_REFILL, rnd))[0])
            q = q + slow_systematic(slow_effective(active[2], room), excess, u2)
            excess = int(np.maximum(q - rem, 0).sum())
            q = np.minimum(q, rem)
        per_batch.append(q)
        counts = counts + q
    return per_batch, counts


def schedule_of(entries) -> EffectiveSchedule:
    s = EffectiveSchedule()
    for v, f, a in entries:
        s.add(v, f, np.asarray(a, float))
    return s


# ---------------------------------------------------------------------------------------------------
def test_systematic_counts_match_slow_reference_and_are_exact():
    rng = np.random.default_rng(0)
    for _ in range(200):
        K = int(rng.integers(1, 8))
        alpha = rng.dirichlet(np.ones(K))
        alpha[rng.random(K) < 0.3] = 0.0
        if alpha.sum() == 0:
            alpha[0] = 1.0
        alpha /= alpha.sum()
        B = int(rng.integers(1, 70))
        u = rng.random(5)
        fast = systematic_counts(alpha, B, u)
        for row, uu in zip(fast, u):
            np.testing.assert_array_equal(row, slow_systematic(alpha, B, uu))
            assert row.sum() == B
            assert np.all(row >= np.floor(B * alpha - 1e-9)) and np.all(row <= np.ceil(B * alpha + 1e-9))
            assert np.all(row[alpha == 0] == 0)


def test_hash_uniforms_are_uniform():
    u = uniform01(hash64(7, np.arange(200_000), 3, TAG_MULTI, 0))
    hist = np.histogram(u, bins=50, range=(0, 1))[0]
    assert chi2_pvalue(hist.astype(float), np.full(50, len(u) / 50)) > 1e-3
    assert 0.0 <= u.min() and u.max() < 1.0


def test_realised_fractions_match_weights():
    alpha = np.array([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    B, n = 24, 4000
    piece = PieceQuotas(11, 0, alpha, B)
    systematic = np.array([piece.quota(j) for j in range(n)])
    multinomial = np.array([batch_quota("multinomial", alpha, B, 11, j, TAG_MULTI) for j in range(n)])
    for composition, counts in (("systematic", systematic), ("multinomial", multinomial)):
        total = counts.sum(axis=0).astype(float)
        assert total[-1] == 0  # weight 0 is never drawn
        assert chi2_pvalue(total, alpha * B * n) > 1e-3, composition
        # The test has power: slightly different weights are rejected.
        wrong = np.array([0.48, 0.27, 0.15, 0.07, 0.03, 0.0])
        assert chi2_pvalue(total, wrong * B * n) < 1e-6, composition
    assert np.all(np.abs(systematic - B * alpha) < 1.0)  # floor or ceil of B * alpha, every batch
    # Stratified offsets: after every aligned block of 1024 batches each cumulative edge is within 1 of its
    # target, so each domain (a difference of two edges) within 2 of n B alpha.
    cum = np.cumsum(systematic, axis=0)
    for blocks in (1, 2, 3):
        assert np.all(np.abs(cum[1024 * blocks - 1] - 1024 * blocks * B * alpha) < 2.0)
    assert multinomial[:, 0].std() > 1.0  # i.i.d. draws vary from batch to batch


def test_piece_quotas_in_closed_form_equal_the_sum_of_batches_across_digit_boundaries():
    rng = np.random.default_rng(3)
    alpha = np.array([0.37, 0.0, 0.21, 0.42])
    piece = PieceQuotas(9, 123, alpha, 37)
    for start in (0, 700, 1024 ** 2 - 30, 5 * 1024 ** 2 + 1000, 1024 ** 3 - 40, 2 * 1024 ** 3 + 7):
        per = np.array([piece.quota(d) for d in range(start, start + 90)])
        assert (per.sum(axis=1) == 37).all() and (per[:, 1] == 0).all()
        cum = np.vstack([np.zeros(4, np.int64), np.cumsum(per, axis=0)])
        for a, b in rng.integers(0, 91, size=(20, 2)):
            a, b = sorted((int(a), int(b)))
            np.testing.assert_array_equal(piece.counts(start + a, start + b), cum[b] - cum[a])
        # each batch is the slow per-slot rule at the documented offset
        for d in range(start, start + 5):
            np.testing.assert_array_equal(piece.quota(d), slow_systematic(alpha, 37, slow_offset(9, 123, d)))
    far = piece.counts(0, 3 * 10 ** 9 + 17)  # no walk: the digits of the count
    assert np.all(np.abs(far - (3 * 10 ** 9 + 17) * 37 * alpha) < 64)


def test_effective_schedule_latest_call_wins():
    s = schedule_of([(0, 0, [1, 0]), (1, 10, [0, 1]), (2, 5, [0.5, 0.5]), (3, 20, [0.2, 0.8])])
    assert s.at(4)[0] == 0 and s.at(5)[0] == 2 and s.at(12)[0] == 2 and s.at(20)[0] == 3
    segs = s.segments(0, 25)
    assert [(g.start, g.end, g.version) for g in segs] == [(0, 5, 0), (5, 20, 2), (20, 25, 3)]
    with pytest.raises(ValueError):
        s.add(3, 30, np.array([1.0, 0.0]))


@pytest.mark.parametrize("composition", ["systematic", "multinomial"])
def test_planner_closed_form_equals_batch_by_batch(composition):
    entries = [(0, 0, [0.4, 0.3, 0.3, 0.0]), (1, 37, [0.1, 0.0, 0.2, 0.7]), (2, 90, [0.25, 0.25, 0.25, 0.25]),
               (3, 140, [0.5, 0.5, 0.0, 0.0]), (4, 120, [0.1, 0.2, 0.3, 0.4])]  # 4 lands before 3: 3 never applies
    sched = schedule_of(entries)
    budgets = [None, 300, None, 800]
    fast = QuotaPlanner(seed=5, batch_size=32, composition=composition, budgets=budgets)
    fast.advance_to(200, sched.segments)
    step = QuotaPlanner(seed=5, batch_size=32, composition=composition, budgets=budgets)
    plans = [step.plan(j, sched.segments) for j in range(200)]
    np.testing.assert_array_equal(fast.counts, step.counts)
    assert all(p is not None and p.quota.sum() == 32 for p in plans)
    assert step.counts[1] == 300 and step.counts[3] == 800  # budgets hit exactly, never exceeded
    if composition == "systematic":
        ref_batches, ref_counts = slow_counts(entries, 5, 32, budgets, 200)
        np.testing.assert_array_equal(fast.counts, ref_counts)
        for p, ref in zip(plans, ref_batches):
            np.testing.assert_array_equal(p.quota, ref)
    for mid in (13, 37, 91, 150):  # any start: the same positions
        part = QuotaPlanner(seed=5, batch_size=32, composition=composition, budgets=budgets)
        part.advance_to(mid, sched.segments)
        np.testing.assert_array_equal(part.counts, plans[mid].start)


def test_planner_resume_from_counts_is_identical():
    sched = schedule_of([(0, 0, [0.6, 0.4]), (1, 50, [0.1, 0.9])])
    a = QuotaPlanner(seed=1, batch_size=8, composition="systematic", budgets=[None, None])
    a.advance_to(70, sched.segments)
    b = QuotaPlanner(seed=1, batch_size=8, composition="systematic", budgets=[None, None],
                     start_batch=70, start_counts=a.counts)
    for j in range(70, 120):
        pa, pb = a.plan(j, sched.segments), b.plan(j, sched.segments)
        np.testing.assert_array_equal(pa.quota, pb.quota)
        np.testing.assert_array_equal(pa.start, pb.start)
    assert a.plan(119, sched.segments) is pa  # a micro-batch asks for its global batch again: the same plan


def test_budgets_exhaust_the_stream():
    sched = schedule_of([(0, 0, [0.5, 0.5])])
    p = QuotaPlanner(seed=0, batch_size=10, composition="systematic", budgets=[35, 42])
    plans = []
    j = 0
    while (pl := p.plan(j, sched.segments)) is not None:
        plans.append(pl)
        j += 1
    assert len(plans) == 7 and p.exhausted_at == 7  # 77 samples: 7 full batches, the 8th cannot be filled
    assert p.counts.sum() == 70


def test_slot_permutation_is_a_permutation_varies_and_is_uniform():
    for n in (1, 2, 3, 10, 32, 1000, 1024, 1025):
        a = slot_permutation(3, 10, n)
        assert sorted(a.tolist()) == list(range(n))
    a = slot_permutation(3, 10, 32)
    assert not np.array_equal(a, slot_permutation(3, 11, 32))
    np.testing.assert_array_equal(a, slot_permutation(3, 10, 32))
    # A rank evaluates only its own slots: the same values as the whole permutation.
    key = hash64(3, 10, TAG_PERM)
    np.testing.assert_array_equal(keyed_permutation(key, 32, np.arange(8, 16)), a[8:16])
    # Uniform, also jointly for pairs, on a small batch (the Feistel halves are 2 bits there).
    n = 10
    keys = hash64(9, np.arange(40_000), TAG_PERM)[:, None]
    perms = keyed_permutation(keys, n, np.tile(np.arange(n), (40_000, 1)))
    assert chi2_pvalue(np.bincount(perms[:, 0], minlength=n).astype(float), np.full(n, 4000.0)) > 1e-3
    pairs = np.bincount(perms[:, 0] * n + perms[:, 1], minlength=n * n)[[i * n + j for i in range(n)
                                                                         for j in range(n) if i != j]]
    assert chi2_pvalue(pairs.astype(float), np.full(n * (n - 1), 40_000 / (n * (n - 1)))) > 1e-3


def test_budget_for():
    assert budget_for(None, 100) is None
    assert budget_for(1, 100) == 100 and budget_for(0.5, 101) == 50 and budget_for(2.0, 3) == 6
    with pytest.raises(ValueError):
        budget_for(0, 10)


# ---------------------------------------------------------------------------------------------------
# DomainOrder
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [True, False])
def test_domain_order_epochs_are_complete_and_reshuffled(shuffle):
    sizes = np.array([37, 50, 50, 13, 50, 44])
    N = int(sizes.sum())
    o = DomainOrder(sizes, 99, shuffle, block_size=64)
    for epoch in range(3):
        ids, epochs = o.sample_ids(epoch * N, N)
        assert set(epochs.tolist()) == {epoch}
        assert sorted(ids.tolist()) == list(range(N))  # every sample once per epoch
    # Scattered positions (a rank's slots) map as the contiguous read does, across an epoch boundary.
    pos = np.array([N + 3, 2, N - 1, N, 5, 2 * N + 7])
    ids, epochs = o.ids_at(pos)
    full, full_e = o.sample_ids(0, 3 * N)
    np.testing.assert_array_equal(ids, full[pos])
    np.testing.assert_array_equal(epochs, full_e[pos])
    e0, _ = o.sample_ids(0, N)
    e1, _ = o.sample_ids(N, N)
    if shuffle:
        assert not np.array_equal(e0, e1)  # reshuffled every epoch
        again = DomainOrder(sizes, 99, True, block_size=64)
        np.testing.assert_array_equal(again.sample_ids(5, 40)[0], o.sample_ids(5, 40)[0])  # deterministic
        other = DomainOrder(sizes, 98, True, block_size=64)
        assert not np.array_equal(other.sample_ids(0, 40)[0], o.sample_ids(0, 40)[0])
    else:
        np.testing.assert_array_equal(e0, np.arange(N))
        np.testing.assert_array_equal(e0, e1)


def test_domain_order_is_shard_local():
    """Consecutive positions come from the few shards of one shuffle block, not from everywhere."""
    sizes = np.full(400, 100)
    o = DomainOrder(sizes, 1, True, block_size=300)
    ids, _ = o.sample_ids(900, 300)  # exactly one block: 300 samples of 3 (permuted) shards of 100
    assert len(set(o.shard_of(ids).tolist())) == 3
    ids, _ = o.sample_ids(1000, 300)  # any window of one block's length touches at most two blocks
    assert len(set(o.shard_of(ids).tolist())) <= 8
    assert len(set(ids.tolist())) == 300


def _hash64_numpy(*keys):
    """The all-numpy hash64 (before the scalar-prefix fast path): the reference it must match bit for bit."""
    from grape_stream.mixing.counter_rng import _mix

    with np.errstate(over="ignore"):
        h = np.zeros((), dtype=np.uint64)
        for k in keys:
            arr = np.asarray(k)
            if arr.dtype != np.uint64:
                arr = np.asarray(arr, dtype=np.int64).astype(np.uint64)
            h = _mix(h ^ arr)
        return np.atleast_1d(h)


def test_hash64_scalar_prefix_is_bit_identical_to_numpy():
    rng = np.random.default_rng(5)
    for _ in range(200):
        scalars = [int(x) for x in rng.integers(-(1 << 63), (1 << 63) - 1, size=rng.integers(1, 5), dtype=np.int64)]
        tail = rng.integers(-(1 << 40), 1 << 40, size=7)
        np.testing.assert_array_equal(hash64(*scalars), _hash64_numpy(*scalars))
        np.testing.assert_array_equal(hash64(*scalars, tail), _hash64_numpy(*scalars, tail))
        np.testing.assert_array_equal(hash64(np.int64(scalars[0]), np.uint64(1 << 63), 3),
                                      _hash64_numpy(np.int64(scalars[0]), np.uint64(1 << 63), 3))
    with pytest.raises(OverflowError):
        hash64(1 << 64)


class _ReferenceOrder(DomainOrder):
    """DomainOrder with the generators built as they were first written: ``default_rng`` of a list of Python
    ints for every order and block, one-element orders included (the reference the fast build must match)."""

    def _rng(self, *coords: int) -> np.random.Generator:
        return np.random.default_rng([self.seed & 0xFFFFFFFF, self.seed >> 32, *coords])

    @staticmethod
    def _permutation(rng, n: int) -> np.ndarray:
        return rng().permutation(n)


@pytest.mark.parametrize("lanes", [1, 4, 37])
def test_domain_order_generators_are_those_of_the_reference(lanes):
    """The cheaper generator build changes no sample: every position of several epochs of every canonical
    node (spans inside one shard, of one piece, among them), for seeds whose words are 0, small and all ones."""
    sizes = np.array([37, 50, 50, 13, 50, 44, 9, 64])
    for seed in (0, 5, (1 << 32) - 1, 1 << 32, 0xFFFFFFFFFFFFFFFF, 0x9E3779B97F4A7C15):
        fast, ref = (cls(sizes, seed, True, block_size=16, lanes=lanes) for cls in (DomainOrder, _ReferenceOrder))
        for lane in range(lanes):
            n = 5 * int(fast.lane_lens[lane])
            np.testing.assert_array_equal(fast.sample_ids(0, n, lane)[0], ref.sample_ids(0, n, lane)[0])
    big = DomainOrder(sizes, 3, True, block_size=16)  # a coordinate past one word: numpy's own list path
    np.testing.assert_array_equal(big._rng(1 << 33, 1).permutation(50),
                                  np.random.default_rng([3, 0, 1 << 33, 1]).permutation(50))
