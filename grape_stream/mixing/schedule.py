"""The weight schedule: which weights compose each global batch, and the rule that picks a switch batch.

Every ``set_weights`` call becomes an entry ``(version, from_batch, alpha)``; the weights of global batch
``j`` are those of the latest entry whose ``from_batch <= j`` (:class:`EffectiveSchedule`). The mixer's
side (:class:`WeightSchedule`) keeps the entries, publishes them to the DataLoader workers through the
shared :class:`~grape_stream.mixing.weight_table.SharedWeightTable`, and chooses ``from_batch`` so that
no batch a worker may already have composed is changed:
``from_batch = max(at_batch, ceil((consumed + lag) / m))`` (docs/mixer.md, "Lag"; ``consumed`` and
``lag`` count this rank's loader batches, ``m`` of them per global batch). It also owns the loader
position that rule depends on (batches consumed, loader depth), because the two only make sense together.
"""

from __future__ import annotations

import warnings
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from grape_stream.mixing.quotas import Segment
from grape_stream.mixing.weight_table import ScheduleOverflow, SharedWeightTable
from grape_stream.simplex import SUM_ATOL, check_simplex

__all__ = ["EffectiveSchedule", "SavedSchedule", "WeightSchedule", "read_entries", "validate_weights"]


def validate_weights(weights: Any, k: int) -> np.ndarray:
    """``k`` finite non-negative weights, not all zero, normalised to sum to 1 (else ValueError)."""
    return check_simplex(weights, name="weights", size=k)


class EffectiveSchedule:
    """The weights in force at each batch index, from the ordered list of ``set_weights`` calls.

    Entry ``(version v, from_batch f, alpha)`` means "batches ``>= f`` use ``alpha``" and a later call
    wins: batch ``j`` uses the highest version whose ``from_batch <= j``. Entries must be added in
    version order; each add truncates whatever an older entry said about batches ``>= f``.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._versions: list[int] = []
        self._alphas: list[np.ndarray] = []
        self.last_version = -1

    def add(self, version: int, from_batch: int, alpha: np.ndarray) -> None:
        if version <= self.last_version:
            raise ValueError(f"schedule versions must increase: {version} after {self.last_version}")
        self.last_version = version
        # Drop pieces starting at or after from_batch; the piece covering from_batch is cut there.
        while self._starts and self._starts[-1] >= from_batch:
            self._starts.pop()
            self._versions.pop()
            self._alphas.pop()
        self._starts.append(int(from_batch))
        self._versions.append(int(version))
        self._alphas.append(np.asarray(alpha, dtype=np.float64).copy())

    def prune_before(self, batch: int) -> None:
        """Forget pieces that end at or before ``batch`` (workers only ever move forward)."""
        i = bisect_right(self._starts, batch) - 1
        if i > 0:
            del self._starts[:i], self._versions[:i], self._alphas[:i]

    @classmethod
    def from_entries(cls, froms: Sequence[int], alphas: np.ndarray) -> "EffectiveSchedule":
        """The schedule of entries ``0, 1, ...`` (``froms[v]``, ``alphas[v]``) in one pass: what
        :meth:`add` gives entry after entry, without copying every weight vector."""
        out = cls()
        starts, versions = out._starts, out._versions
        for v, f in enumerate(froms):
            while starts and starts[-1] >= f:
                starts.pop()
                versions.pop()
            starts.append(int(f))
            versions.append(v)
        out._alphas = [alphas[v] for v in versions]
        out.last_version = len(froms) - 1
        return out

    def at(self, batch: int) -> tuple[int, np.ndarray]:
        i = bisect_right(self._starts, batch) - 1
        if i < 0:
            raise KeyError(f"no weights are defined for batch {batch}")
        return self._versions[i], self._alphas[i]

    def segments(self, start: int, end: int) -> list[Segment]:
        """Constant-weight pieces covering batches ``[start, end)``."""
        out: list[Segment] = []
        if end <= start:
            return out
        i = bisect_right(self._starts, start) - 1
        if i < 0:
            raise KeyError(f"no weights are defined for batch {start}")
        b = start
        while b < end:
            nxt = self._starts[i + 1] if i + 1 < len(self._starts) else end
            e = min(end, nxt)
            if e > b:
                out.append(Segment(b, e, self._versions[i], self._alphas[i], self._starts[i]))
            b = e
            i += 1
        return out

    def tail_start(self, begin: int, end: int, pieces: int) -> int:
        """The first batch of the ``pieces``-th last weight piece covering batches ``[begin, end)``, not
        before ``begin`` (``begin`` when the range is empty)."""
        if end <= begin:
            return begin
        i = bisect_right(self._starts, end - 1) - 1
        return max(begin, self._starts[max(0, i - pieces + 1)])

    def __len__(self) -> int:
        return len(self._starts)


class WeightSchedule:
    """The mixer's weight schedule and the loader position its switch rule needs.

    ``history`` holds every entry (``version == index``); ``effective`` answers "which weights at batch
    j"; ``table`` carries the entries and the cursor to the workers. ``consumed`` counts the batches the
    trainer has taken, ``loader_depth`` is the prefetch depth a counting loader reported, ``tracked``
    whether such a loader is in use, ``iterating`` whether batches may be in flight. Only the main
    process changes any of it; workers read the table.
    """

    def __init__(self, num_domains: int, alpha0: np.ndarray, capacity: int, lag: int | None, micro: int = 1,
                 lanes: int = 1) -> None:
        self.K = int(num_domains)
        self.lanes = int(lanes)  # the cursor holds every canonical node's position of every domain
        self.micro = int(micro)  # loader batches per global batch
        self.fixed_lag = None if lag is None else int(lag) * self.micro  # in loader batches
        self.history: list[tuple[int, int, np.ndarray]] = []  # (version, from_batch, alpha); version == index
        self.effective = EffectiveSchedule()
        self.table = SharedWeightTable(self.K, capacity, self.K * self.lanes)
        self.consumed = 0
        self.loader_depth: int | None = None
        self.tracked = False
        self.iterating = False
        self._warned: set[str] = set()
        self.append(0, alpha0)
        self.table.set_cursor(0, np.zeros(self.K * self.lanes, np.int64))

    # -- reading -------------------------------------------------------------------------------------
    @property
    def lag(self) -> int:
        """Loader batches between ``set_weights`` and the first batch it may change."""
        if self.fixed_lag is not None:
            return self.fixed_lag
        return self.loader_depth or 0

    @property
    def latest(self) -> tuple[int, int, np.ndarray]:
        """(version, from_batch, alpha) of the latest entry."""
        return self.history[-1]

    def entries(self) -> list[dict[str, Any]]:
        """Every entry as plain Python types (what a checkpoint stores)."""
        return [{"version": v, "from_batch": f, "alpha": a.tolist()} for v, f, a in self.history]

    def at(self, batch: int) -> tuple[int, np.ndarray]:
        """(version, weights) in force at batch ``batch``."""
        v, a = self.effective.at(batch)
        return v, a.copy()

    def consumed_known(self) -> bool:
        """Whether ``consumed`` is exact: a counting loader, or no worker has composed anything."""
        workers_active = self.table.max_claimed(workers_only=True) >= 0
        return self.tracked or not workers_active

    # -- writing -------------------------------------------------------------------------------------
    def append(self, from_batch: int, alpha: np.ndarray) -> int:
        version = len(self.history)
        self.history.append((version, int(from_batch), alpha.copy()))
        self.effective.add(version, int(from_batch), alpha)
        self.table.publish(version, version, int(from_batch), alpha)
        return version

    def note_consumed(self, batches: int) -> None:
        self.consumed = max(self.consumed, int(batches))

    def advance_cursor(self, next_batch: int, counts: np.ndarray) -> None:
        """The main process handed out every batch before ``next_batch``: consumed, and where to resume."""
        self.consumed = max(self.consumed, next_batch)
        self.table.set_cursor(next_batch, counts)

    def seek(self, batch: int, counts: np.ndarray) -> None:
        """Move the cursor: the next iteration starts at ``batch`` with read positions ``counts``."""
        self.table.set_cursor(batch, counts)
        self.table.set_base(self.effective.at(batch // self.micro)[0])
        self.table.reset_claims(batch)
        self.consumed = batch
        self.iterating = False

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)  # the caller of mixer.set_weights

    def schedule(self, alpha: Sequence[float] | np.ndarray | torch.Tensor, at_batch: int | None = None,
                 consumed: int | None = None) -> int:
        """Add new weights at the switch batch the rule allows; return that batch.

        See :meth:`grape_stream.mixing.mixer.WeightedStreamingMixer.set_weights` for the rule as users
        see it. Raises :class:`ScheduleOverflow` when too many entries would be pending for the table.
        """
        alpha = validate_weights(alpha, self.K)
        if at_batch is not None and (isinstance(at_batch, bool) or int(at_batch) != at_batch or at_batch < 0):
            raise ValueError(f"at_batch must be a non-negative integer, got {at_batch!r}")
        if consumed is not None and (int(consumed) != consumed or consumed < 0):
            raise ValueError(f"consumed must be a non-negative integer, got {consumed!r}")
        known = consumed is not None or self.consumed_known()
        n_consumed = int(consumed) if consumed is not None else self.consumed
        if consumed is not None:
            self.consumed = max(self.consumed, n_consumed)
        # Before a loader has started there is nothing in flight: the next batch can still change. An
        # explicit lag always applies (switch points then depend only on the consumed count).
        in_flight = self.iterating or self.fixed_lag is not None or self.table.max_claimed(workers_only=True) >= 0
        floor = n_consumed + (self.lag if in_flight else 0) if known else None
        composed = self.table.max_claimed()  # loader batches
        m = self.micro
        if at_batch is None:
            if floor is None:
                self._warn_once(
                    "untracked",
                    "set_weights with a plain DataLoader with workers: the mixer cannot see how many batches "
                    "were consumed, so the switch batch depends on worker timing. Use mixer.dataloader(...) "
                    "or pass at_batch= / consumed= for a reproducible switch.",
                )
                target = -(-(composed + 1) // m)
            else:
                target = -(-floor // m)
        else:
            target = int(at_batch) if floor is None else max(int(at_batch), -(-floor // m))
        if target <= composed // m:  # a loader batch of global batch `target` may be composed already
            moved = -(-(composed + 1 + max(1, self.table.active_workers())) // m)
            self._warn_once(
                "composed",
                f"set_weights: batch {target} was already composed (workers are at batch {composed // m}); the "
                f"new weights apply from batch {moved}. The loader prefetches deeper than lag={self.lag}: use "
                "mixer.dataloader(...), or pass lag= (>= num_workers * prefetch_factor) to the mixer.",
            )
            target = moved
        low = min(n_consumed, composed + 1) if composed >= 0 else n_consumed
        self._check_pending(low // m)
        self.append(target, alpha)
        return target

    def _check_pending(self, low: int) -> None:
        """Refuse a new entry when the workers could lose entries still in force from batch ``low`` on."""
        try:
            active_version = self.effective.at(max(0, low))[0]
        except KeyError:  # pragma: no cover - version 0 starts at batch 0
            active_version = 0
        if len(self.history) - active_version >= (3 * self.table.C) // 4:
            raise ScheduleOverflow(
                f"{len(self.history) - active_version} weight changes are pending beyond batch {low}; "
                f"raise schedule_capacity (now {self.table.C})"
            )

    def restore(self, saved: "SavedSchedule", batch: int) -> None:
        """Replace the schedule by a checkpoint's (:func:`read_entries`) resumed at global batch ``batch``.

        Only the entries the workers may need go to the shared table, in one write, and its readers are
        told to start at the entry in force at ``batch`` (the older ones only concern earlier batches)."""
        n = len(saved.froms)
        in_force = saved.effective.at(batch)[0]
        first = max(0, n - (3 * self.table.C) // 4)
        if in_force < first:
            raise ScheduleOverflow(
                f"{n - in_force} weight changes are pending after batch {batch}; "
                f"raise schedule_capacity (now {self.table.C})"
            )
        self.history = [(v, f, saved.alphas[v]) for v, f in enumerate(saved.froms)]
        self.effective = saved.effective
        self.table.reset()
        self.table.publish_many(first, saved.froms[first:], saved.alphas[first:])
        self.table.set_base(in_force)


@dataclass(frozen=True)
class SavedSchedule:
    """A checkpoint's schedule entries, checked: ``froms[v]`` and ``alphas[v]`` of entry ``v`` (the weights
    exactly as stored: those the run composed with) and the effective schedule they make."""

    froms: list[int]
    alphas: np.ndarray
    effective: EffectiveSchedule


def read_entries(entries: Sequence[Mapping[str, Any]], k: int) -> SavedSchedule:
    """A checkpoint's entries (versions 0, 1, ... in order) as arrays, each weight vector checked as
    ``set_weights`` checks it (ValueError naming the problem), in one pass: O(entries) numpy work."""
    try:
        froms = [int(e["from_batch"]) for e in entries]
        alphas = np.array([e["alpha"] for e in entries], dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        alphas = np.empty((0, 0))
        froms = []
    if alphas.shape != (len(entries), k):
        for e in entries:  # the first bad entry raises, naming what is wrong with it
            validate_weights(e["alpha"], k)
            int(e["from_batch"])
        raise ValueError("the checkpoint's weight schedule entries are malformed")  # pragma: no cover
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(alphas).all(axis=1) & (alphas >= 0).all(axis=1) & (abs(alphas.sum(axis=1) - 1.0) <= SUM_ATOL)
    bad = np.flatnonzero(~ok)
    if bad.size:
        validate_weights(alphas[bad[0]], k)  # raises, naming what is wrong
    alphas.flags.writeable = False
    return SavedSchedule(froms, alphas, EffectiveSchedule.from_entries(froms, alphas))
