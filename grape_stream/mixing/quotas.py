"""How many samples of each domain global batch ``i`` takes, and each domain's position after ``n`` batches.

The quotas of global batch ``i`` (``G`` samples, all ranks together) depend only on ``(seed, i, the
weights in force at batch i and where that weight piece began, which domains have spent their data
budget)``: no rank, no worker, no random state carried from batch to batch. Two schemes
(``composition=``):

``"systematic"`` (default): stratified systematic resampling, in closed form
    With the weights ``alpha`` of a piece that starts at batch ``s``, let ``c_k = G * (alpha_1 + ... +
    alpha_k)`` (the cumulative edges, the last exactly ``G``). Batch ``s + d`` draws one offset ``u_d``
    in [0, 1) and gives domain k ``edge_k(u_d) - edge_{k-1}(u_d)`` slots, ``edge_k(u) = floor(c_k) +
    [u < frac(c_k)]`` (= ``ceil(c_k - u)``: systematic resampling of the ``G`` slots). Every batch's
    quotas sum to ``G`` exactly, domain k gets ``floor(G alpha_k)`` or ``ceil(G alpha_k)``, a weight of 0
    gives exactly 0, and each ``u_d`` is uniform, so the expectation is exactly ``G alpha_k``.

    The offsets are a scrambled van der Corput sequence in base ``STRATA = 1024`` (:class:`PieceQuotas`):
    every aligned block of 1024 consecutive batches of a piece has one offset in each of 1024 equal
    strata of [0, 1), every block of 1024**2 batches one in each of 1024**2 strata, and so on (each
    digit permuted by a hash of ``(seed, piece origin, the higher digits)``). So the cumulative edge after
    ``d`` batches, ``E_k(d) = d floor(c_k) + #{j < d : u_j < frac(c_k)}``, is a closed formula of ``d``'s
    digits -- at most 3 x 1024 comparisons per domain, whatever ``d``. A domain's position after ``n``
    batches is a sum of such differences over the weight pieces: O(K * pieces), not O(n) (resuming at
    batch 10^6 costs what resuming at batch 10^3 does). The stratification also keeps every domain within
    a few tens of samples of ``n G alpha_k`` over a piece of any length (within 2 after every
    aligned block of 1024 batches), where independent offsets drift like a random walk (``sqrt(n)``).
Canonical nodes (``lanes``, :func:`lane_split`)
    Laid out grouped by domain, the ``G`` samples of a batch are dealt to ``C`` lanes round-robin, the deal
    starting at lane ``rho`` (the batch's *rotation*): grouped sample ``p`` goes to lane ``(p + rho) mod C``,
    so lane ``c`` takes ``ceil((Q_k - c') / C) - ceil((Q_{k-1} - c') / C)`` of domain ``k`` (``Q`` the
    cumulative quotas, ``c' = (c - rho) mod C``): ``G / C`` samples in all, ``floor`` or ``ceil`` of
    ``q_k / C`` of each domain, and the lanes' quotas add up to the batch's exactly (the quotas above do
    not depend on ``C``). Why rotate: dealt from lane 0 every batch, a domain whose share of a batch is
    below ``C`` always lands on the low-numbered lanes, which then run epochs ahead of the others in that
    domain. The systematic composition's rotation is the sum of the batch offset's three digits mod ``C``
    (:func:`deal_rotation`): over every aligned block of 1024 batches each rotation comes up equally often
    (``C`` dividing 1024) and a lane's count over a piece stays a closed formula of the same digits
    (:mod:`grape_stream.mixing.lane_counts`); the multinomial composition's is a hash of the batch.
``"multinomial"``
    ``Multinomial(G, alpha)`` per batch (Philox keyed by ``(seed, i)``): i.i.d. domains, as in sampling
    one domain per sample. Higher variance; positions are summed batch by batch (resuming at batch ``n``
    costs O(n)).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from grape_stream.config.choices import Composition, values
from grape_stream.mixing.counter_rng import (
    TAG_DEAL,
    TAG_MULTI,
    TAG_STRATA,
    hash64,
    hash_int,
    keyed_permutation,
    keyed_permutation_at,
    uniform01,
)

__all__ = [
    "COMPOSITIONS",
    "STRATA",
    "BatchPlan",
    "PieceQuotas",
    "Segment",
    "StreamExhausted",
    "batch_quota",
    "budget_for",
    "cumulative",
    "deal_rotation",
    "default_on_spent",
    "effective_weights",
    "lane_split",
    "systematic_counts",
]

COMPOSITIONS = values(Composition)

#: The base of the systematic offsets' digits (a power of two: its permutations need no cycle-walking).
STRATA = 1024


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


def cumulative(alpha: np.ndarray) -> np.ndarray:
    """Cumulative weights with exact zero-width intervals for zero weights and a last edge of exactly 1."""
    cum = np.cumsum(alpha)
    cum = cum / cum[-1]
    last = int(np.flatnonzero(alpha > 0)[-1])
    cum[last:] = 1.0
    return cum


def systematic_counts(alpha: np.ndarray, slots: int, u: np.ndarray) -> np.ndarray:
    """(len(u), K) slot counts of systematic resampling with offsets ``u`` (one row per batch)."""
    cum = cumulative(np.asarray(alpha, dtype=np.float64))
    u = np.asarray(u, dtype=np.float64).reshape(-1, 1)
    edges = np.clip(np.ceil(slots * cum[None, :] - u), 0, slots).astype(np.int64)
    edges[:, -1] = slots
    return np.diff(edges, axis=1, prepend=0)


def lane_split(quota: np.ndarray, lanes: int, which: np.ndarray | range | None = None,
               rotation: int = 0) -> np.ndarray:
    """(len(which), K) samples of each domain that lanes ``which`` (default all) take of a batch's ``quota``
    when the deal starts at lane ``rotation`` (module docstring: grouped samples dealt round-robin)."""
    c = np.arange(lanes, dtype=np.int64) if which is None else np.asarray(which, dtype=np.int64)
    if rotation:
        c = (c - int(rotation)) % lanes
    # ceil((Q - c) / C) = Q // C + [c < Q mod C] for 0 <= c < C: a comparison, not a (C, K) division (the
    # planner splits every batch it plans, so this is on its per-batch path)
    whole, rest = np.divmod(np.cumsum(quota), lanes)
    edges = whole[None, :] + (c[:, None] < rest[None, :])
    out = edges.copy()
    out[:, 1:] -= edges[:, :-1]
    return out


def deal_rotation(offsets: np.ndarray | int, lanes: int) -> np.ndarray:
    """The lane where the deal of batches with systematic offsets ``offsets`` (the integers ``U < 2**52``
    of :class:`PieceQuotas`) starts: the sum of their three base-1024 digits, mod ``lanes``."""
    u = np.asarray(offsets, dtype=np.int64)
    top = U_BITS - DIGIT_BITS
    digits = sum((u >> (top - DIGIT_BITS * i)) & (STRATA - 1) for i in range(LEVELS))
    return np.asarray(digits % lanes, dtype=np.int64)


def hashed_rotation(seed: int, batch: int, lanes: int) -> int:
    """The multinomial composition's deal rotation of global batch ``batch`` (it has no offsets)."""
    return hash_int(seed, batch, TAG_DEAL) % lanes if lanes > 1 else 0


def batch_quota(composition: str, alpha: np.ndarray, slots: int, seed: int, batch: int, tag: int,
                round_: int = 0) -> np.ndarray:
    """Quotas (K,) of ``slots`` slots drawn once, keyed by ``(seed, batch, tag, round_)``: the multinomial
    composition's batches and both compositions' re-draws of slots freed by a spent budget."""
    if composition == "systematic":
        return systematic_counts(alpha, slots, uniform01(hash64(seed, batch, tag, round_)))[0]
    if composition == "multinomial":
        rng = np.random.Generator(np.random.Philox(key=int(hash64(seed, batch, tag, round_)[0])))
        p = np.asarray(alpha, dtype=np.float64)
        return rng.multinomial(slots, p / p.sum()).astype(np.int64)
    raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")


def multinomial_quota(alpha: np.ndarray, slots: int, seed: int, batch: int) -> np.ndarray:
    return batch_quota("multinomial", alpha, slots, seed, batch, TAG_MULTI)


#: The offsets' digits: ``LEVELS`` base-``STRATA`` digits of the batch index, each through its own keyed
#: permutation, fill the top ``LEVELS * 10`` of ``U_BITS`` bits; the rest is one random number per
#: ``STRATA ** LEVELS`` (about 10^9) batches.
LEVELS, DIGIT_BITS, U_BITS = 3, 10, 52
_TOP_BITS = U_BITS - LEVELS * DIGIT_BITS


class PieceQuotas:
    """The systematic quotas of the batches of one weight piece, in closed form (module docstring).

    ``origin``: the batch where the piece's weights took effect (its randomness is keyed by it, so a
    piece is the same whichever batch a process starts at); ``alpha``: the effective weights.

    The offset of the piece's batch ``d`` is the integer ``U_d < 2**52`` (``u_d = U_d / 2**52``) whose
    top 10 bits are ``pi(d mod 1024)``, the next 10 ``pi'((d // 1024) mod 1024)``, the next 10
    ``pi''((d // 1024**2) mod 1024)`` (each permutation keyed by the higher digits) and the low 22 a hash
    of ``d // 1024**3``: a scrambled van der Corput sequence. Any aligned block of ``1024**j`` batches
    takes every value of its top ``10 j`` bits once, so how many of them have ``U < F`` is
    ``(F >> (52 - 10 j)) + [their common low bits < F mod 2**(52 - 10 j)]``: counting over ``d`` batches
    adds at most 3 x 1024 terms, and no domain drifts from ``d G alpha_k`` however long the piece (each
    level is exact over its blocks; inside a block of 1024 the gap is that of a random stratified
    prefix). Comparisons are on integers, so a batch's quota and the counts over its piece agree bit for
    bit. Digits are looked up one at a time in Python ints (:func:`keyed_permutation_at`) and a block's
    1024 offsets are computed at once when a process walks through it.
    """

    def __init__(self, seed: int, origin: int, alpha: np.ndarray, slots: int) -> None:
        scaled = slots * cumulative(np.asarray(alpha, dtype=np.float64))
        base = np.floor(scaled)
        self.floor = base.astype(np.int64)
        self.floor[-1] = slots
        frac = scaled - base
        frac[-1] = 0.0
        #: batch gets edge floor_k + 1 when U < threshold_k (u < frac_k, up to 2**-52)
        self.threshold = np.ceil(frac * float(1 << U_BITS)).astype(np.int64)
        self.seed, self.origin, self.slots = int(seed), int(origin), int(slots)
        self._state = hash_int(self.seed, self.origin, TAG_STRATA)  # the keys' common prefix, mixed once
        self._block: tuple[int, np.ndarray] | None = None  # (level-0 block, U of its 1024 batches)
        self._head: tuple[int, np.ndarray] | None = None  # (level-0 block, U of its first batches) of a prefix

    # -- the offsets ---------------------------------------------------------------------------------
    def _key(self, level: int, block: int) -> int:
        return hash_int(level, block, state=self._state)

    def _digits(self, level: int, block: int, upto: int) -> np.ndarray:
        """The permuted values of digits ``0 .. upto - 1`` of level ``level`` in block ``block``."""
        return keyed_permutation(self._key(level, block), STRATA, np.arange(upto, dtype=np.int64))

    def _digit(self, level: int, block: int, digit: int) -> int:
        return keyed_permutation_at(self._key(level, block), STRATA, digit)

    def _low(self, level: int, d: int) -> int:
        """The bits below the top ``10 * level`` of ``U`` shared by batch ``d``'s aligned block of
        ``1024**level`` batches (``level`` 0: ``U_d`` itself)."""
        top = d >> (DIGIT_BITS * LEVELS)
        low = hash_int(LEVELS, top, state=self._state) >> (64 - _TOP_BITS)
        for lv in range(LEVELS - 1, level - 1, -1):
            digit = (d >> (DIGIT_BITS * lv)) & (STRATA - 1)
            low |= self._digit(lv, d >> (DIGIT_BITS * (lv + 1)), digit) << (U_BITS - DIGIT_BITS * (lv + 1))
        return low

    def _offsets(self, block: int) -> np.ndarray:
        """``U`` of the 1024 batches of level-0 block ``block`` (cached: a process walks forward)."""
        if self._block is None or self._block[0] != block:
            perm = keyed_permutation(self._key(0, block), STRATA, np.arange(STRATA, dtype=np.int64))
            self._block = (block, (perm << (U_BITS - DIGIT_BITS)) | self._low(1, block << DIGIT_BITS))
        return self._block[1]

    def prefix_levels(self, d: int) -> list[tuple[int, np.ndarray]]:
        """The piece's batches ``0 .. d - 1`` as whole aligned blocks: ``(level, lows)`` per level that has
        some, ``lows`` the low ``52 - 10 * level`` bits of ``U`` shared by each block of ``1024**level``
        batches (whose top ``10 * level`` bits take every value once); level 0: the batches' ``U``."""
        d = int(d)
        parts = []
        top = d >> (DIGIT_BITS * LEVELS)
        if top:  # whole blocks of 1024**3 batches: one random low part each
            tops = hash64(self.seed, self.origin, TAG_STRATA, LEVELS, np.arange(top, dtype=np.int64))
            parts.append((LEVELS, (tops >> np.uint64(64 - _TOP_BITS)).astype(np.int64)))
        for lv in range(LEVELS - 1, -1, -1):  # whole blocks of 1024**lv batches under each digit before d's
            n = (d >> (DIGIT_BITS * lv)) & (STRATA - 1)
            if not n:
                continue
            split = U_BITS - DIGIT_BITS * lv  # a block's U: free top bits above `split`, its `lows` below
            if lv == 0 and self._block is not None and self._block[0] == d >> DIGIT_BITS:
                lows = self._block[1][:n]
            elif lv == 0 and self._head is not None and self._head[0] == d >> DIGIT_BITS and len(self._head[1]) >= n:
                lows = self._head[1][:n]
            else:
                digits = self._digits(lv, d >> (DIGIT_BITS * (lv + 1)), n)
                lows = (digits << (split - DIGIT_BITS)) | self._low(lv + 1, d)
                if lv == 0:  # the stretch's lane counts want the same offsets (a walk over short pieces)
                    self._head = (d >> DIGIT_BITS, lows)
            parts.append((lv, lows))
        return parts

    def prefix_hits(self, d: int) -> np.ndarray:
        """(K,) how many of the piece's batches ``0 .. d - 1`` have ``U < threshold_k``."""
        f = self.threshold
        out = np.zeros_like(f)
        for lv, lows in self.prefix_levels(d):
            split = U_BITS - DIGIT_BITS * lv
            out = out + len(lows) * (f >> split) + (lows[:, None] < (f & ((1 << split) - 1))[None, :]).sum(axis=0)
        return out

    def offsets(self, d0: int, d1: int) -> np.ndarray:
        """``U`` of the piece's batches ``d0 .. d1 - 1`` (a block's 1024 are computed and kept only when the
        stretch covers it or it is the one kept: a walk over many short pieces needs just its stretches)."""
        parts = []
        for block in range(d0 >> DIGIT_BITS, ((d1 - 1) >> DIGIT_BITS) + 1 if d1 > d0 else d0 >> DIGIT_BITS):
            lo, hi = max(d0 - (block << DIGIT_BITS), 0), min(d1 - (block << DIGIT_BITS), STRATA)
            if hi - lo == STRATA or (self._block is not None and self._block[0] == block):
                parts.append(self._offsets(block)[lo:hi])
            elif self._head is not None and self._head[0] == block and len(self._head[1]) >= hi:
                parts.append(self._head[1][lo:hi])
            else:
                digits = keyed_permutation(self._key(0, block), STRATA, np.arange(lo, hi, dtype=np.int64))
                parts.append((digits << (U_BITS - DIGIT_BITS)) | self._low(1, block << DIGIT_BITS))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def rotation(self, d: int, lanes: int) -> int:
        """Where the deal of the piece's batch ``d`` starts (:func:`deal_rotation`)."""
        if lanes == 1:
            return 0
        d = int(d)
        u, top = int(self._offsets(d >> DIGIT_BITS)[d & (STRATA - 1)]), U_BITS - DIGIT_BITS
        return sum((u >> (top - DIGIT_BITS * i)) & (STRATA - 1) for i in range(LEVELS)) % lanes  # deal_rotation

    # -- quotas and counts ---------------------------------------------------------------------------
    def counts(self, d0: int, d1: int) -> np.ndarray:
        """Samples of each domain in the piece's batches ``d0 .. d1 - 1`` (offsets from the origin)."""
        hits = self.prefix_hits(d1) - self.prefix_hits(d0)
        return np.diff((d1 - d0) * self.floor + hits, prepend=0)

    def quota(self, d: int) -> np.ndarray:
        """Quotas (K,) of the piece's batch ``d`` (offset from the origin)."""
        d = int(d)
        u = int(self._offsets(d >> DIGIT_BITS)[d & (STRATA - 1)])
        return np.diff(self.floor + (u < self.threshold), prepend=0)


@dataclass(frozen=True)
class Segment:
    """Batches ``[start, end)`` use weights ``alpha`` of schedule version ``version``; the weights took
    effect at batch ``origin <= start`` (the key of the piece's randomness).

    The planner's input: :class:`grape_stream.mixing.schedule.EffectiveSchedule` cuts the weight
    schedule into these pieces.
    """

    start: int
    end: int
    version: int
    alpha: np.ndarray
    origin: int = 0


@dataclass
class BatchPlan:
    """What global batch ``batch`` takes: ``quota[k]`` samples of domain k; lane ``c`` takes its share
    (:func:`lane_split`, the deal starting at lane ``rotation``) at positions ``start[c * K + k] ...`` of its
    stream of domain k."""

    batch: int
    version: int
    alpha: np.ndarray  # the effective weights (budgets applied)
    quota: np.ndarray
    start: np.ndarray  # (lanes * K,) lane positions before the batch
    lanes: int = 1
    rotation: int = 0

    def split(self, which: range | None = None) -> np.ndarray:
        """(len(which), K) the share of lanes ``which`` (default all) of each domain."""
        return lane_split(self.quota, self.lanes, which, self.rotation)

    def end(self) -> np.ndarray:
        """Lane positions after the batch."""
        if self.lanes == 1:
            return self.start + self.quota
        return self.start + self.split().reshape(-1)


class StreamExhausted(Exception):
    """Every domain has spent its data budget: no further batch can be filled."""

    def __init__(self, batch: int) -> None:
        super().__init__(f"every domain has spent its max_epochs budget; the stream ends before batch {batch}")
        self.batch = batch


def default_on_spent(names: Sequence[str]) -> Callable[[int, int], None]:
    def _warn(k: int, batch: int) -> None:
        warnings.warn(
            f"domain {names[k]!r} has spent its max_epochs data budget before batch {batch}; its weight "
            "now goes to the other domains",
            RuntimeWarning,
            stacklevel=2,
        )

    return _warn


def budget_for(max_epochs: float | None, num_samples: int) -> int | None:
    """Samples the whole run (all ranks together) may read from a domain of ``num_samples`` samples."""
    if max_epochs is None:
        return None
    if not (max_epochs > 0) or math.isinf(max_epochs):
        raise ValueError(f"max_epochs must be a positive finite number or None, got {max_epochs!r}")
    return int(math.floor(max_epochs * num_samples + 1e-9))
