"""Every canonical node's count of every domain over a stretch of a weight piece, in closed form.

Why: a planner jumps (a resume at batch 10^6, an anchor's walk over the last weight pieces, a DataLoader
worker skipping the batches of the other workers) and must know where each canonical node (lane) stands
in each domain without summing the batches one by one. The batches' deal rotates
(:func:`~grape_stream.mixing.quotas.lane_split`), so what a lane gets depends on each batch's rotation;
the rotation is read off the batch's systematic offset ``U`` (the sum of its digits mod ``C``:
:func:`~grape_stream.mixing.quotas.deal_rotation`) precisely so that the counts stay a formula of the
digits that the domains' counts already use.

The formula. In batch ``d`` (rotation ``rho``), domain k's cumulative edge is ``F_k + h`` with ``h = [U_d <
T_k]``; write ``F_k = a_k C + m_k``. Lane ``c`` takes ``ceil((F_k + h - c') / C) = a_k + [c' < m_k] + h [c' =
m_k]`` of the grouped samples before the edge, ``c' = (c - rho) mod C``. Over ``n`` batches::

    E_k[c] = n a_k + sum_{x < m_k} H[(c - x) mod C] + H_k[(c - m_k) mod C]

``H[s]``: the batches with rotation ``s``; ``H_k[s]``: those of them with ``U < T_k`` (``K + 1`` rows of ``C``
residue counts, the last row for "every batch"). The lane's count of domain k is ``E_k - E_{k-1}``.

The residue counts of the piece's first ``d`` batches come from the blocks that count its domains
(:meth:`~grape_stream.mixing.quotas.PieceQuotas.prefix_levels`). A whole block of ``1024**lv`` batches has its
top ``lv`` digits take every value once and shares its low bits ``L``; its batches under ``T`` with rotation
``s`` are the digit tuples below ``T``'s top ``lv`` digits (lexicographically) that sum to ``s - r(L)``, plus one
if ``L`` is below ``T``'s low bits and ``T``'s top digits sum to ``s - r(L)``. Summed over a level's blocks:
``A * S_lv(T) + shift(B(T), sigma_lv(T))``, ``A`` the (C,) histogram of the blocks' ``r(L)``, ``B(T)`` that of
the blocks with ``L`` below ``T``'s low bits, ``*`` cyclic convolution, and ``S_lv(T)`` the (C,) residue counts of
the tuples below ``T``'s digits (fixed per piece), by recursion over the digits: ``S_1 = ind(t_0)``,
``S_{lv+1} = S_lv * ind(1024) + shift(ind(t_lv), t_0 + ... + t_{lv-1})`` with ``ind(t)[s] = #{v < t : v = s mod C}``.
Cost: the comparisons the domains' counts make, and a (K+1, C) x (C, C) product per level; a short stretch
(a worker's jump of a few batches) is counted batch by batch from the offsets a process has at hand.
"""

from __future__ import annotations

import numpy as np

from grape_stream.mixing.quotas import DIGIT_BITS, LEVELS, STRATA, U_BITS, PieceQuotas, deal_rotation

__all__ = ["EXPLICIT_BATCHES", "LaneCounts"]

#: Stretches of at most this many batches are counted batch by batch (their offsets: two blocks at most).
EXPLICIT_BATCHES = 2 * STRATA


def _ind(t: np.ndarray, lanes: int) -> np.ndarray:
    """(R, C) ``#{v < t_r : v = s mod C}``."""
    t = np.asarray(t, dtype=np.int64)
    return t[:, None] // lanes + (np.arange(lanes)[None, :] < (t % lanes)[:, None])


def _shift(x: np.ndarray, by: np.ndarray) -> np.ndarray:
    """(R, C) ``x[r, (s - by_r) mod C]``."""
    c = x.shape[1]
    return np.take_along_axis(x, (np.arange(c)[None, :] - np.asarray(by, np.int64)[:, None]) % c, axis=1)


def _window(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(R, C) ``sum_{y < m_r} x[r, (s - y) mod C]`` (``0 <= m_r < C``): one cumulative sum, two lookups."""
    r, c = x.shape
    cs = np.zeros((r, 2 * c + 1), np.int64)
    np.cumsum(np.concatenate([x, x], axis=1), axis=1, out=cs[:, 1:])
    end = np.arange(c) + c + 1
    return cs[:, end] - np.take_along_axis(cs, end[None, :] - np.asarray(m, np.int64)[:, None], axis=1)


class LaneCounts:
    """The closed form of one weight piece's lane counts for ``lanes`` canonical nodes (module docstring)."""

    def __init__(self, piece: PieceQuotas, lanes: int) -> None:
        self.piece, self.lanes = piece, int(lanes)
        c = self.lanes
        self.t = np.append(piece.threshold, np.int64(1) << U_BITS)  # the last row: every batch
        self.strict: dict[int, np.ndarray] = {}  # S_lv(T), built by the first long stretch (_whole_blocks)
        self.sigma: dict[int, np.ndarray] = {}
        self.a, self.m = piece.floor // c, piece.floor % c
        # the per-stretch lookups of counts(): fixed per piece, so indices are built once
        k = len(self.m)
        self._end = np.arange(c) + c + 1
        self._start = self._end[None, :] - self.m[:, None]  # (K, C) into the doubled cumulative sum
        self._edge = (np.arange(k)[:, None] * c + (np.arange(c)[None, :] - self.m[:, None]) % c).ravel()

    def _whole_blocks(self) -> None:
        """``S_lv(T)`` and ``sigma_lv(T)`` of every threshold (module docstring), for levels 1 to 3."""
        c, rows = self.lanes, len(self.t)
        top = U_BITS - DIGIT_BITS
        digits = [self.t >> top] + [(self.t >> (top - DIGIT_BITS * i)) & (STRATA - 1) for i in range(1, LEVELS)]
        full = np.full(rows, STRATA % c)
        strict, sigma = _ind(digits[0], c), digits[0]
        self.strict[1], self.sigma[1] = strict.astype(np.float64), sigma % c
        for lv in range(1, LEVELS):
            strict = (STRATA // c) * strict.sum(axis=1, keepdims=True) + _window(strict, full) \
                + _shift(_ind(digits[lv], c), sigma)
            sigma = sigma + digits[lv]
            self.strict[lv + 1], self.sigma[lv + 1] = strict.astype(np.float64), sigma % c

    def residues(self, level: int, lows: np.ndarray) -> np.ndarray:
        """(K+1, C) residue counts of the batches of whole blocks of ``1024**level`` batches with low bits
        ``lows`` (level 0: batches with offsets ``lows``)."""
        c, rows = self.lanes, len(self.t)
        lows = np.asarray(lows, dtype=np.int64)
        r = deal_rotation(lows, c)
        under = self.t if level == 0 else self.t & ((1 << (U_BITS - DIGIT_BITS * level)) - 1)
        hits = lows[:, None] < under[None, :]
        b = np.bincount((r[:, None] + c * np.arange(rows)[None, :])[hits], minlength=rows * c).reshape(rows, c)
        if level == 0:
            return b
        if not self.strict:
            self._whole_blocks()
        a = np.bincount(r, minlength=c).astype(np.float64)
        circulant = a[(np.arange(c)[None, :] - np.arange(c)[:, None]) % c]  # [y, s] = a[(s - y) mod C]
        # exact in float64: every count is an integer below 2**53 (at most 1024**3 tuples x 1023 blocks)
        return _shift(b, self.sigma[level]) + np.rint(self.strict[level] @ circulant).astype(np.int64)

    def prefix(self, d: int) -> np.ndarray:
        """(K+1, C) residue counts of the piece's batches ``0 .. d - 1``."""
        out = np.zeros((len(self.t), self.lanes), np.int64)
        for level, lows in self.piece.prefix_levels(d):
            out += self.residues(level, lows)
        return out

    def counts(self, d0: int, d1: int) -> np.ndarray:
        """(lanes, K) samples of each domain each lane takes in the piece's batches ``d0 .. d1 - 1``."""
        n = int(d1) - int(d0)
        if n <= EXPLICIT_BATCHES:
            h = self.residues(0, self.piece.offsets(d0, d1))
        else:
            h = self.prefix(d1) - self.prefix(d0)
        cs = np.zeros(2 * self.lanes + 1, np.int64)
        np.cumsum(np.concatenate([h[-1], h[-1]]), out=cs[1:])
        edges = (n * self.a)[:, None] + (cs[self._end][None, :] - cs[self._start])  # the rotations below m_k
        edges += h[:-1].ravel()[self._edge].reshape(edges.shape)  # the batches whose edge k rose, at c' = m_k
        edges[1:] -= edges[:-1].copy()
        return edges.T
