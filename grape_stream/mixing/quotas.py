"""Batch composition: how many samples of each domain batch ``i`` takes, as a pure function.

The number of samples of domain ``k`` in batch ``i`` on rank ``r`` depends only on
``(seed, i, r, the weights in force at batch i, which domains have spent their data budget)``. No
random state is carried from batch to batch: every random number is a hash of its coordinates (a
counter-based RNG, splitmix64 here; Philox for the multinomial option). Therefore

* any DataLoader worker can compose any batch without talking to the others,
* the per-domain read positions after ``n`` batches (the whole data position of the mixer) are a sum
  of quotas that can be recomputed from ``(seed, n, weight schedule)`` on resume, vectorised, and
* the composition of a batch never depends on the number of workers or on their timing.

Two schemes (``composition=``):

``"systematic"`` (default)
    Systematic resampling of the ``B`` slots of a batch: one uniform offset ``u`` per batch, slot
    ``s`` goes to the domain whose cumulative-weight interval holds ``(s + u) / B``. Each domain gets
    ``floor(B * alpha_k)`` or ``ceil(B * alpha_k)`` samples, with expectation exactly ``B * alpha_k``;
    a weight of 0 gives exactly 0. After the slots are shuffled (also counter-based) every single
    sample's domain is still distributed as ``alpha`` -- only the batch-to-batch noise is removed.
``"multinomial"``
    ``Multinomial(B, alpha)`` per batch: i.i.d. domains, as in sampling one domain per sample. Higher
    variance; resuming recomputes it batch by batch (slower on very long runs).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

__all__ = [
    "COMPOSITIONS",
    "BatchPlan",
    "QuotaPlanner",
    "Segment",
    "hash64",
    "uniform01",
    "systematic_counts",
    "batch_quota",
    "slot_permutation",
    "effective_weights",
]

COMPOSITIONS = ("systematic", "multinomial")

# Tags keep the random streams of different purposes independent.
TAG_OFFSET = 0x0FF5E7
TAG_PERM = 0x9E5D
TAG_REFILL = 0x5EF111
TAG_MULTI = 0x3A17
TAG_PROBE = 0x960BE

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (bijective on uint64, full avalanche)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


_MASK = (1 << 64) - 1
_GOLDEN_I, _M1_I, _M2_I = int(_GOLDEN), int(_M1), int(_M2)


def _mix_int(z: int) -> int:
    """:func:`_mix` on one Python int (the same uint64 arithmetic, without numpy's per-call cost)."""
    z = (z + _GOLDEN_I) & _MASK
    z = ((z ^ (z >> 30)) * _M1_I) & _MASK
    z = ((z ^ (z >> 27)) * _M2_I) & _MASK
    return z ^ (z >> 31)


def hash64(*keys: int | np.integer | np.ndarray) -> np.ndarray:
    """A uint64 hash of integer coordinates (arrays broadcast), e.g. ``hash64(seed, batch, rank, TAG)``.

    Leading scalar keys are mixed with Python ints (bit-identical: the same operations modulo 2**64, a
    negative key taken as its int64 two's complement, as ``astype(uint64)`` does); numpy takes over at the
    first array key. That keeps a per-batch hash of a few coordinates at a few microseconds.
    """
    h_int = 0
    i = 0
    for k in keys:
        if not isinstance(k, (int, np.integer)) or isinstance(k, np.uint64):
            break
        v = int(k)
        if not -(1 << 63) <= v < (1 << 63):
            raise OverflowError(f"hash key {v} does not fit in int64")
        h_int = _mix_int(h_int ^ (v & _MASK))
        i += 1
    with np.errstate(over="ignore"):
        h = np.asarray(h_int, dtype=np.uint64)
        for k in keys[i:]:
            arr = np.asarray(k)
            if arr.dtype != np.uint64:
                arr = np.asarray(arr, dtype=np.int64).astype(np.uint64)
            h = _mix(h ^ arr)
        return np.atleast_1d(h)


def uniform01(h: np.ndarray) -> np.ndarray:
    """Map uint64 hashes to floats in [0, 1) (53 random bits)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def effective_weights(alpha: np.ndarray, available: np.ndarray) -> np.ndarray:
    """``alpha`` restricted to the available (unspent) domains and renormalised.

    When the weights put no mass on any available domain, the available domains share it equally: the
    batch must still be filled from data that exists.
    """
    a = np.where(available, alpha, 0.0)
    total = a.sum()
    if total > 0:
        return a / total
    n = int(available.sum())
    if n == 0:
        raise ValueError("no domain is available")
    return available.astype(np.float64) / n


def _cumulative(alpha: np.ndarray) -> np.ndarray:
    """Cumulative weights with exact zero-width intervals for zero weights and a last edge of exactly 1."""
    cum = np.cumsum(alpha)
    cum = cum / cum[-1]
    last = int(np.flatnonzero(alpha > 0)[-1])
    cum[last:] = 1.0
    return cum


def systematic_counts(alpha: np.ndarray, slots: int, u: np.ndarray) -> np.ndarray:
    """(len(u), K) slot counts of systematic resampling with offsets ``u`` (one row per batch)."""
    cum = _cumulative(np.asarray(alpha, dtype=np.float64))
    u = np.asarray(u, dtype=np.float64).reshape(-1, 1)
    edges = np.clip(np.ceil(slots * cum[None, :] - u), 0, slots).astype(np.int64)
    edges[:, -1] = slots
    return np.diff(edges, axis=1, prepend=0)


def _philox(key: np.ndarray) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(key=int(key[0])))


def batch_quota(composition: str, alpha: np.ndarray, slots: int, seed: int, batch: int, rank: int,
                tag: int = TAG_OFFSET, round_: int = 0) -> np.ndarray:
    """Quotas (K,) of one batch: the scalar form of the vectorised computation in :class:`QuotaPlanner`."""
    if composition == "systematic":
        u = uniform01(hash64(seed, batch, rank, tag, round_))
        return systematic_counts(alpha, slots, u)[0]
    if composition == "multinomial":
        rng = _philox(hash64(seed, batch, rank, TAG_MULTI if tag == TAG_OFFSET else tag, round_))
        p = np.asarray(alpha, dtype=np.float64)
        return rng.multinomial(slots, p / p.sum()).astype(np.int64)
    raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")


def slot_permutation(seed: int, batch: int, rank: int, slots: int) -> np.ndarray:
    """The order in which a batch's samples (grouped by domain) are emitted: a counter-based shuffle."""
    keys = hash64(seed, batch, rank, TAG_PERM, np.arange(slots, dtype=np.int64))
    return np.argsort(keys, kind="stable")


# --------------------------------------------------------------------------------------------------
# Per-rank read positions
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """Batches ``[start, end)`` use weights ``alpha`` of schedule version ``version``.

    The planner's input: :class:`grape_stream.mixing.schedule.EffectiveSchedule` cuts the weight
    schedule into these pieces.
    """

    start: int
    end: int
    version: int
    alpha: np.ndarray


@dataclass
class BatchPlan:
    """What batch ``batch`` takes: ``quota[k]`` samples of domain k at positions ``start[k]...`` of the
    rank's stream of that domain."""

    batch: int
    version: int
    alpha: np.ndarray  # the effective weights (budgets applied)
    quota: np.ndarray
    start: np.ndarray


class StreamExhausted(Exception):
    """Every domain has spent its data budget: no further batch can be filled."""

    def __init__(self, batch: int) -> None:
        super().__init__(f"every domain has spent its max_epochs budget; the stream ends before batch {batch}")
        self.batch = batch


_NO_BUDGET = np.iinfo(np.int64).max
_CHUNK = 1 << 14


class QuotaPlanner:
    """Walks batches in increasing order, keeping the number of samples each domain has served.

    ``counts[k]`` is the position in this rank's stream of domain k before batch ``batch``; it is all
    the data state the mixer has. Batches are processed in vectorised chunks; a batch in which a data
    budget runs out is handled on its own (its overflowing quota is clipped and the freed slots are
    re-drawn among the domains that still have data).
    """

    def __init__(self, *, seed: int, rank: int, batch_size: int, composition: str,
                 budgets: Sequence[int | None] | np.ndarray, start_batch: int = 0,
                 start_counts: Iterable[int] | None = None,
                 on_spent: Callable[[int, int], None] | None = None) -> None:
        if composition not in COMPOSITIONS:
            raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
        self.seed = int(seed)
        self.rank = int(rank)
        self.B = int(batch_size)
        self.composition = composition
        self.budgets = np.array([_NO_BUDGET if b is None else int(b) for b in budgets], dtype=np.int64)
        self.K = len(self.budgets)
        self.batch = int(start_batch)
        self.counts = np.zeros(self.K, np.int64) if start_counts is None else np.array(list(start_counts), np.int64)
        if self.counts.shape != (self.K,):
            raise ValueError(f"start_counts must have {self.K} entries")
        self.exhausted_at: int | None = None
        self.on_spent = on_spent
        self._spent_reported = self.counts >= self.budgets
        self._u_start = 0
        self._u = np.empty(0)
        self._budgeted = bool((self.budgets != _NO_BUDGET).any())
        self._all_available = np.ones(self.K, bool)
        self._weights_key: tuple | None = None
        self._weights: tuple[np.ndarray, np.ndarray] = (np.empty(0), np.empty(0))

    # -- public ------------------------------------------------------------------------------------
    def plan(self, batch: int, segments: Callable[[int, int], list[Segment]]) -> BatchPlan | None:
        """Advance to ``batch`` and return its plan (``None`` once every budget is spent)."""
        if batch < self.batch:
            raise ValueError(f"planner is at batch {self.batch}; cannot go back to {batch}")
        self.advance_to(batch, segments)
        if self.exhausted_at is not None:
            return None
        (seg,) = segments(batch, batch + 1)
        start = self.counts.copy()
        try:
            quota, alpha = self._one_batch(batch, seg.alpha)
        except StreamExhausted:
            self.exhausted_at = batch
            return None
        self.counts += quota
        self.batch = batch + 1
        self._report_spent()
        return BatchPlan(batch, seg.version, alpha, quota, start)

    def advance_to(self, batch: int, segments: Callable[[int, int], list[Segment]]) -> None:
        """Account for every batch in ``[self.batch, batch)``."""
        if batch <= self.batch or self.exhausted_at is not None:
            return
        for seg in segments(self.batch, batch):
            self._advance_segment(seg)
            if self.exhausted_at is not None:
                return

    @property
    def available(self) -> np.ndarray:
        return self.counts < self.budgets

    # -- internals ---------------------------------------------------------------------------------
    def _advance_segment(self, seg: Segment) -> None:
        b = seg.start
        while b < seg.end:
            avail = self.available
            if not avail.any():
                self.exhausted_at = b
                return
            alpha = effective_weights(seg.alpha, avail)
            if self.composition == "multinomial":
                self._scalar_batch(b, seg.alpha)
                if self.exhausted_at is not None:
                    return
                b += 1
                continue
            n = min(seg.end - b, _CHUNK)
            idx = np.arange(b, b + n, dtype=np.int64)
            u = uniform01(hash64(self.seed, idx, self.rank, TAG_OFFSET, 0))
            q = systematic_counts(alpha, self.B, u)
            cum = np.cumsum(q, axis=0) + self.counts
            hit = np.flatnonzero((cum[:, avail] >= self.budgets[avail]).any(axis=1))
            if hit.size == 0:
                self.counts = cum[-1].copy()
                b += n
                continue
            t = int(hit[0])
            if (cum[t] > self.budgets).any():
                # Batch b+t overflows a budget: account up to it, then clip and refill it on its own.
                if t > 0:
                    self.counts = cum[t - 1].copy()
                b += t
                self.batch = b
                self._scalar_batch(b, seg.alpha)
                if self.exhausted_at is not None:
                    return
                b += 1
            else:
                # A budget is met exactly by batch b+t: later batches must be drawn without that domain.
                self.counts = cum[t].copy()
                b += t + 1
                self.batch = b
                self._report_spent()
        self.batch = seg.end

    def _scalar_batch(self, b: int, alpha: np.ndarray) -> None:
        try:
            quota, _ = self._one_batch(b, alpha)
        except StreamExhausted:
            self.exhausted_at = b
            return
        self.counts += quota
        self.batch = b + 1
        self._report_spent()

    def _one_batch(self, b: int, alpha_sched: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        avail = self.available if self._budgeted else self._all_available
        if not avail.any():
            raise StreamExhausted(b)
        key = (id(alpha_sched), avail.tobytes())
        if self._weights_key is not None and self._weights_key[:2] == key and self._weights_key[2] is alpha_sched:
            alpha, scaled = self._weights
        else:  # new weights or a newly spent domain: computed once per segment, not per batch
            alpha = effective_weights(alpha_sched, avail)
            scaled = self.B * _cumulative(alpha)
            self._weights_key, self._weights = (*key, alpha_sched), (alpha, scaled)
        if self.composition == "systematic":
            # systematic_counts(alpha, B, u)[0] with B * cum computed once (the same floating-point ops).
            # (np.minimum/np.maximum: np.clip's Python wrapper costs more than the arithmetic; no NaN here.)
            edges = np.minimum(np.maximum(np.ceil(scaled - self._offset(b)[0]), 0), self.B).astype(np.int64)
            edges[-1] = self.B
            q = edges.copy()
            q[1:] -= edges[:-1]
        else:
            q = batch_quota(self.composition, alpha, self.B, self.seed, b, self.rank)
        if not self._budgeted:
            return q, alpha  # no max_epochs: nothing can be spent (the clipping below would change nothing)
        remaining = self.budgets - self.counts
        excess = int(np.maximum(q - remaining, 0).sum())
        q = np.minimum(q, remaining)
        round_ = 0
        while excess > 0:
            round_ += 1
            room = (self.counts + q) < self.budgets
            if not room.any():
                raise StreamExhausted(b)
            extra = batch_quota(self.composition, effective_weights(alpha_sched, room), excess, self.seed, b,
                                self.rank, TAG_REFILL, round_)
            q = q + extra
            excess = int(np.maximum(q - remaining, 0).sum())
            q = np.minimum(q, remaining)
        return q, alpha

    def _offset(self, b: int) -> np.ndarray:
        """The systematic offset of batch ``b`` (hashes computed for 1024 batches at a time)."""
        i = b - self._u_start
        if not 0 <= i < len(self._u):
            self._u_start = b
            self._u = uniform01(hash64(self.seed, np.arange(b, b + 1024, dtype=np.int64), self.rank, TAG_OFFSET, 0))
            i = 0
        return self._u[i:i + 1]

    def _report_spent(self) -> None:
        if not self._budgeted:
            return
        spent = self.counts >= self.budgets
        new = np.flatnonzero(spent & ~self._spent_reported)
        self._spent_reported = spent
        if self.on_spent is not None:
            for k in new:
                self.on_spent(int(k), self.batch)


def default_on_spent(names: Sequence[str]) -> Callable[[int, int], None]:
    def _warn(k: int, batch: int) -> None:
        warnings.warn(
            f"domain {names[k]!r} has spent its max_epochs data budget before batch {batch}; its weight "
            "now goes to the other domains",
            RuntimeWarning,
            stacklevel=2,
        )

    return _warn


def budget_for(max_epochs: float | None, epoch_len: int) -> int | None:
    """Samples a rank may read from a domain whose rank-epoch has ``epoch_len`` samples."""
    if max_epochs is None:
        return None
    if not (max_epochs > 0) or math.isinf(max_epochs):
        raise ValueError(f"max_epochs must be a positive finite number or None, got {max_epochs!r}")
    return int(math.floor(max_epochs * epoch_len + 1e-9))
