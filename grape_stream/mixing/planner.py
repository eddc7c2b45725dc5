"""Walking the global stream: every domain's position before each global batch, budgets included.

``QuotaPlanner.counts[k]`` is how many samples of domain k the global batches before
``QuotaPlanner.batch`` took, and ``QuotaPlanner.position`` how many each canonical node (lane) took
(``lanes * K`` numbers, lane after lane, summing to ``counts``): all the data state the mixer has, the
same on every rank and worker. Jumping
from batch ``a`` to batch ``b`` costs O(K * weight pieces in between) with the systematic composition
(:class:`~grape_stream.mixing.quotas.PieceQuotas`), whatever ``b - a``; a ``max_epochs`` budget that
runs out inside a piece is found by bisection (positions only grow), its batch is clipped and its freed
slots re-drawn among the domains that still have data, and the piece goes on with the other domains'
renormalised weights (same origin, same offsets). The multinomial composition has no closed form: it
walks batch by batch.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from grape_stream.mixing.counter_rng import TAG_REFILL
from grape_stream.mixing.lane_counts import LaneCounts
from grape_stream.mixing.quotas import (
    COMPOSITIONS,
    BatchPlan,
    PieceQuotas,
    Segment,
    StreamExhausted,
    batch_quota,
    effective_weights,
    hashed_rotation,
    lane_split,
    multinomial_quota,
)

__all__ = ["QuotaPlanner", "Segments"]

#: ``segments(start, end)``: the weight pieces covering global batches ``[start, end)``.
Segments = Callable[[int, int], list[Segment]]

_NO_BUDGET = np.iinfo(np.int64).max


class QuotaPlanner:
    """Walks global batches in increasing order, keeping each domain's position in its global stream."""

    def __init__(self, *, seed: int, batch_size: int, composition: str, budgets: Sequence[int | None] | np.ndarray,
                 start_batch: int = 0, start_counts: Iterable[int] | None = None,
                 on_spent: Callable[[int, int], None] | None = None, lanes: int = 1) -> None:
        if composition not in COMPOSITIONS:
            raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
        self.seed = int(seed)
        self.G = int(batch_size)
        self.composition = composition
        self.budgets = np.array([_NO_BUDGET if b is None else int(b) for b in budgets], dtype=np.int64)
        self.K = len(self.budgets)
        self.batch = int(start_batch)
        self.lanes = int(lanes)
        n = self.lanes * self.K
        start = np.zeros(n, np.int64) if start_counts is None else np.array(list(start_counts), np.int64)
        if start.shape != (self.lanes * self.K,):
            raise ValueError(f"start_counts must have {self.lanes} x {self.K} entries")
        self._lane_pos = start.reshape(self.lanes, self.K)
        self.counts = self._lane_pos.sum(axis=0)
        self.exhausted_at: int | None = None
        self.on_spent = on_spent
        self._spent_reported = self.counts >= self.budgets
        self._budgeted = bool((self.budgets != _NO_BUDGET).any())
        self._all = np.ones(self.K, bool)
        self._pieces: dict[tuple[int, bytes, bytes], tuple[np.ndarray, PieceQuotas]] = {}
        self._lane_counts: dict[PieceQuotas, LaneCounts] = {}
        self._last: BatchPlan | None = None

    # -- public ------------------------------------------------------------------------------------
    def plan(self, batch: int, segments: Segments) -> BatchPlan | None:
        """Advance to global batch ``batch`` and return its plan (``None`` once every budget is spent).

        Asking again for the batch just planned returns the same plan (a rank's micro-batches share one
        global batch)."""
        last = self._last
        if last is not None and last.batch == batch:
            return last
        if batch < self.batch:
            raise ValueError(f"planner is at batch {self.batch}; cannot go back to {batch}")
        self.advance_to(batch, segments)
        if self.exhausted_at is not None:
            return None
        (seg,) = segments(batch, batch + 1)
        start = self.position
        try:
            quota, alpha = self._one_batch(batch, seg)
        except StreamExhausted:
            self.exhausted_at = batch
            return None
        rotation = self._rotation(batch, seg)
        self._take(quota, rotation)
        self.batch = batch + 1
        self._report_spent()
        self._last = BatchPlan(batch, seg.version, alpha, quota, start, self.lanes, rotation)
        return self._last

    def advance_to(self, batch: int, segments: Segments) -> None:
        """Account for every global batch in ``[self.batch, batch)``."""
        if batch <= self.batch or self.exhausted_at is not None:
            return
        for seg in segments(self.batch, batch):
            self._advance_segment(seg)
            if self.exhausted_at is not None:
                return

    @property
    def position(self) -> np.ndarray:
        """(lanes * K,) every lane's position in its stream of every domain (a copy)."""
        return self._lane_pos.reshape(-1).copy()

    def _take(self, quota: np.ndarray, rotation: int) -> None:
        """Account for one batch of quotas ``quota`` (the lanes take their round-robin shares, the deal
        starting at lane ``rotation``)."""
        self.counts += quota
        self._lane_pos += quota[None, :] if self.lanes == 1 else lane_split(quota, self.lanes, rotation=rotation)

    def _rotation(self, b: int, seg: Segment) -> int:
        """Where the deal of global batch ``b`` starts: read off its systematic offset (which the piece's
        renormalised weights after a spent budget share), else a hash of the batch."""
        if self.lanes == 1:
            return 0
        if self.composition == "systematic":
            return self._piece(seg, self.available if self._budgeted else self._all)[1].rotation(b - seg.origin,
                                                                                                 self.lanes)
        return hashed_rotation(self.seed, b, self.lanes)

    @property
    def available(self) -> np.ndarray:
        return self.counts < self.budgets

    # -- internals ---------------------------------------------------------------------------------
    def _piece(self, seg: Segment, avail: np.ndarray) -> tuple[np.ndarray, PieceQuotas]:
        """(effective weights, closed-form quotas) of ``seg`` with the domains ``avail`` (cached)."""
        key = (seg.origin, seg.alpha.tobytes(), avail.tobytes())
        hit = self._pieces.get(key)
        if hit is None:
            alpha = effective_weights(seg.alpha, avail)
            hit = (alpha, PieceQuotas(self.seed, seg.origin, alpha, self.G))
            if len(self._pieces) >= 8:
                self._pieces.pop(next(iter(self._pieces)))
            self._pieces[key] = hit
        return hit

    def _advance_segment(self, seg: Segment) -> None:
        while self.batch < seg.end:
            avail = self.available
            if not avail.any():
                self.exhausted_at = self.batch
                return
            if self.composition == "multinomial":
                self._scalar_batch(self.batch, seg)
                if self.exhausted_at is not None:
                    return
                continue
            _, piece = self._piece(seg, avail if self._budgeted else self._all)
            d0, d1 = self.batch - seg.origin, seg.end - seg.origin
            counts = piece.counts(d0, d1)
            if not self._budgeted or not (self.counts + counts >= self.budgets)[avail].any():
                self._take_piece(piece, d0, d1, counts)
                self.batch = seg.end
                self._report_spent()
                return
            # Some budget is reached inside the piece: bisect for the first batch that reaches one.
            lo, hi = d0, d1  # reached after hi batches, not after lo
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if ((self.counts + piece.counts(d0, mid)) >= self.budgets)[avail].any():
                    hi = mid
                else:
                    lo = mid
            self._take_piece(piece, d0, lo)
            self.batch = seg.origin + lo
            self._scalar_batch(self.batch, seg)  # clips and re-draws it when it overflows a budget
            if self.exhausted_at is not None:
                return

    def _take_piece(self, piece: PieceQuotas, d0: int, d1: int, counts: np.ndarray | None = None) -> None:
        self.counts = self.counts + (piece.counts(d0, d1) if counts is None else counts)
        if self.lanes == 1:
            self._lane_pos = self.counts.reshape(1, -1).copy()
            return
        lane_counts = self._lane_counts.get(piece)
        if lane_counts is None:
            lane_counts = self._lane_counts[piece] = LaneCounts(piece, self.lanes)
            if len(self._lane_counts) > 8:
                self._lane_counts.pop(next(iter(self._lane_counts)))
        self._lane_pos = self._lane_pos + lane_counts.counts(d0, d1)

    def _scalar_batch(self, b: int, seg: Segment) -> None:
        try:
            quota, _ = self._one_batch(b, seg)
        except StreamExhausted:
            self.exhausted_at = b
            return
        self._take(quota, self._rotation(b, seg))
        self.batch = b + 1
        self._report_spent()

    def _one_batch(self, b: int, seg: Segment) -> tuple[np.ndarray, np.ndarray]:
        avail = self.available if self._budgeted else self._all
        if not avail.any():
            raise StreamExhausted(b)
        alpha, piece = self._piece(seg, avail)
        if self.composition == "systematic":
            q = piece.quota(b - seg.origin)
        else:
            q = multinomial_quota(alpha, self.G, self.seed, b)
        if not self._budgeted:
            return q, alpha
        remaining = self.budgets - self.counts
        excess = int(np.maximum(q - remaining, 0).sum())
        q = np.minimum(q, remaining)
        round_ = 0
        while excess > 0:
            round_ += 1
            room = (self.counts + q) < self.budgets
            if not room.any():
                raise StreamExhausted(b)
            extra = batch_quota(self.composition, effective_weights(seg.alpha, room), excess, self.seed, b,
                                TAG_REFILL, round_)
            q = q + extra
            excess = int(np.maximum(q - remaining, 0).sum())
            q = np.minimum(q, remaining)
        return q, alpha

    def _report_spent(self) -> None:
        if not self._budgeted:
            return
        spent = self.counts >= self.budgets
        new = np.flatnonzero(spent & ~self._spent_reported)
        self._spent_reported = spent
        if self.on_spent is not None:
            for k in new:
                self.on_spent(int(k), self.batch)
