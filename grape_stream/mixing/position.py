"""The mixer's data position as plain numbers: the checkpoint state and the per-domain stats.

The position is topology-free: ``batch`` global batches consumed (all ranks together), every domain's
position in its global stream (``positions``), the global batch size and the weight schedule (in global
batches). A checkpoint written by 8 ranks with 2 workers each therefore resumes on 2 ranks with 3
workers, or on 1 rank with micro-batches, at exactly the next global batch. It also stores a fingerprint
of everything the stream assumes (seed, composition, shuffling, domains and their sizes, budgets); a
checkpoint whose fingerprint differs would continue a different stream, so it is refused with one line.

A checkpoint also stores an ``anchor``: every domain's position at the start of one of the last
``TAIL_PIECES`` weight pieces before its batch (:meth:`StreamPosition.anchor`). A resume checks that the
schedule leads from the anchor to the stored positions (a walk over those few pieces: the cost of a
resume does not grow with the batch); a state without one (written before the anchor existed) is
checked from its origin, over every piece.

``grape_stream.mixer/4`` (this format) has the fields of ``/3``; its stream deals each global batch's samples
to the canonical nodes from a rotating start (:func:`~grape_stream.mixing.quotas.lane_split`), where ``/3``
dealt from node 0 every batch and let the nodes drift apart in the small domains. With one canonical node the
two deals are the same stream, so a ``/3`` state of ``canonical_nodes=1`` and a ``/2`` state load exactly; a
``/3`` state of several canonical nodes cannot be continued (its node positions belong to the old deal) and
is refused with one line.

``grape_stream.mixer/3`` adds to ``/2`` the stream's ``canonical_nodes`` ``C`` and, when ``C > 1``, every
canonical node's position in its stream of every domain (``node_positions``, also in the origin and the
anchor; ``positions`` stay the per-domain sums). A ``/2`` state is a state of one canonical node: it resumes
exactly with ``canonical_nodes=1`` (the default adopts it).

``grape_stream.mixer/2`` adds to ``/1``: ``global_batch_size``, ``positions``, ``origin``
(the batch, sample count and positions where the current global batch size took effect: 0 unless the
global batch size was changed on a resume) and ``written_by`` (the topology that wrote it, information
only); ``world_size`` and ``batch_size`` are no longer checked. ``/1`` states (per-rank streams) cannot
be continued by the global stream: they are refused with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from grape_stream.errors import DataError
from grape_stream.mixing.compose import BatchComposer
from grape_stream.mixing.domains import DomainStream
from grape_stream.mixing.epoch_order import DomainOrder
from grape_stream.mixing.planner import QuotaPlanner
from grape_stream.mixing.schedule import WeightSchedule, read_entries

__all__ = ["STATE_FORMAT", "TAIL_PIECES", "MixerStateError", "Origin", "SavedPosition", "StreamPosition", "check_state",
           "domain_stats", "make_state", "state_batch"]

STATE_FORMAT = "grape_stream.mixer/4"
_FORMAT_3 = "grape_stream.mixer/3"
_FORMAT_2 = "grape_stream.mixer/2"
_FORMAT_1 = "grape_stream.mixer/1"

#: A checkpoint's anchor is at the start of the TAIL_PIECES-th last weight piece before its batch.
TAIL_PIECES = 8


class MixerStateError(DataError):
    """A checkpoint's data position that this mixer cannot continue exactly (one line: what and why)."""


def positions_dict(lane_positions: Sequence[int] | np.ndarray, lanes: int) -> dict[str, Any]:
    """``{"positions": per-domain sums}`` plus, with several canonical nodes, ``"node_positions"``: one list a node."""
    lp = np.asarray(lane_positions, dtype=np.int64).reshape(lanes, -1)
    out: dict[str, Any] = {"positions": lp.sum(axis=0).tolist()}
    if lanes > 1:
        out["node_positions"] = lp.tolist()
    return out


def read_positions(d: Mapping[str, Any], lanes: int, k: int, what: str) -> np.ndarray:
    """The (lanes * K,) lane positions of a checkpoint's ``{"positions", "node_positions"}`` (``what``: where)."""
    try:
        total = np.asarray(d.get("positions") or [], dtype=np.int64)
        lanes_ = np.asarray(d.get("node_positions") if lanes > 1 else [total], dtype=np.int64)
    except (TypeError, ValueError):
        raise MixerStateError(f"the checkpoint's {what} positions are not lists of integers") from None
    if total.shape != (k,) or lanes_.shape != (lanes, k) or (lanes_ < 0).any() \
            or not np.array_equal(lanes_.sum(axis=0), total):
        raise MixerStateError(f"the checkpoint's {what} does not hold {k} domain positions for each of its "
                              f"{lanes} canonical nodes (summing to its positions)")
    return lanes_.reshape(-1)


@dataclass(frozen=True)
class Origin:
    """Where the current global batch size took effect: global batch, samples before it, lane positions."""

    batch: int
    num_samples: int
    positions: tuple[int, ...]

    def as_dict(self, lanes: int) -> dict[str, Any]:
        return {"batch": self.batch, "num_samples": self.num_samples, **positions_dict(self.positions, lanes)}


@dataclass(frozen=True)
class SavedPosition:
    """What :func:`check_state` reads out of a checkpoint."""

    batch: int
    global_batch_size: int
    positions: np.ndarray  # (lanes * K,) lane positions
    origin: Origin
    schedule: list[dict[str, Any]]
    anchor: tuple[int, np.ndarray] | None  # (global batch, positions) the check starts from; None: the origin
    lanes: int = 1


def state_batch(num_samples: int | None, from_beginning: bool, *, global_batch_size: int, origin: Origin,
                consumed: int, micro: int, consumed_known: bool, resume_batch: int) -> int:
    """The global batch a ``state_dict(num_samples, from_beginning)`` call refers to (see the mixer's docstring).

    ``consumed`` counts this rank's loader batches (``micro`` per global batch)."""
    g = int(global_batch_size)
    if num_samples is None:
        if not consumed_known:
            raise ValueError(
                "state_dict(num_samples=None) with a plain DataLoader with workers: the mixer cannot know "
                "how many batches were consumed; pass num_samples= (global samples) or use mixer.dataloader()"
            )
        if consumed % micro:
            raise MixerStateError(
                f"state_dict after {consumed} loader batches, inside global batch {consumed // micro} (micro-batch "
                f"{consumed % micro} of {micro}): save after a whole global batch (an optimizer step)"
            )
        return consumed // micro
    if int(num_samples) != num_samples or num_samples < 0:
        raise ValueError(f"num_samples={num_samples!r} is not a non-negative whole number")
    counted = int(num_samples) - (origin.num_samples if from_beginning else 0)
    if counted < 0 or counted % g:
        raise ValueError(
            f"num_samples={num_samples!r} is not a whole number of global batches of {g} samples"
            + (f" after the {origin.num_samples} samples before batch {origin.batch}" if origin.num_samples else "")
        )
    return counted // g + (origin.batch if from_beginning else resume_batch)


def make_state(batch: int, positions: np.ndarray, *, global_batch_size: int, origin: Origin,
               fingerprint: Mapping[str, Any], schedule: list[dict[str, Any]],
               written_by: Mapping[str, int], anchor: tuple[int, np.ndarray] | None = None,
               lanes: int = 1) -> dict[str, Any]:
    """The checkpoint dict (plain Python types): format, position (lane positions ``positions``), the
    fingerprint's keys, the weight schedule and the anchor a resume checks the position from (none: from
    the origin)."""
    num_samples = origin.num_samples + (batch - origin.batch) * int(global_batch_size)
    state = {"format": STATE_FORMAT, "batch": int(batch), "num_samples": int(num_samples),
             "global_batch_size": int(global_batch_size), "canonical_nodes": int(lanes),
             **positions_dict(positions, lanes), "origin": origin.as_dict(lanes), **fingerprint,
             "schedule": schedule, "written_by": dict(written_by)}
    if anchor is not None:
        state["anchor"] = {"batch": int(anchor[0]), **positions_dict(anchor[1], lanes)}
    return state


def state_lanes(state: Mapping[str, Any]) -> int | None:
    """The canonical node count of a checkpoint's stream (1 for ``/2``; None: not a state this release reads)."""
    if not isinstance(state, Mapping) or state.get("format") not in (STATE_FORMAT, _FORMAT_3, _FORMAT_2):
        return None
    lanes = state.get("canonical_nodes", 1) if state.get("format") != _FORMAT_2 else 1
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        raise MixerStateError(f"the checkpoint's canonical_nodes {lanes!r} is not a positive integer")
    return None if state.get("format") == _FORMAT_3 and lanes > 1 else lanes


def _read_anchor(state: Mapping[str, Any], batch: int, positions: np.ndarray,
                 origin: Origin) -> tuple[int, np.ndarray] | None:
    """A checkpoint's anchor, if it has one: between its origin and its batch, positions in between too."""
    a = state.get("anchor")
    if a is None:
        return None
    try:
        at = int(a["batch"])
        a["positions"]
    except (KeyError, TypeError, ValueError):
        raise MixerStateError("the checkpoint's anchor is not {batch, positions}") from None
    pos = read_positions(a, state_lanes(state) or 1, len(origin.positions) // (state_lanes(state) or 1), "anchor")
    if (pos.shape != positions.shape or not origin.batch <= at <= batch
            or (pos < np.asarray(origin.positions)).any() or (pos > positions).any()):
        raise MixerStateError(
            f"the checkpoint's anchor (batch {at}) does not lie between its origin (batch {origin.batch}) and its "
            f"position (batch {batch}): edited by hand, or written by another grape_stream release"
        )
    return at, pos


def check_state(state: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> SavedPosition:
    """The position of a checkpoint that fits this mixer; :class:`MixerStateError` naming what does not."""
    fmt = state.get("format") if isinstance(state, Mapping) else None
    if fmt == _FORMAT_1:
        raise MixerStateError(
            f"the checkpoint's data position is {_FORMAT_1} (per-rank streams of an older grape_stream): the "
            f"topology-independent stream of {STATE_FORMAT} cannot continue it exactly; finish that run with the "
            "grape_stream release that wrote it, or start the data stream afresh"
        )
    if fmt not in (STATE_FORMAT, _FORMAT_3, _FORMAT_2):
        raise MixerStateError(f"not a WeightedStreamingMixer state (format {fmt!r}, expected {STATE_FORMAT!r})")
    lanes = state_lanes(state)
    if lanes is None:
        raise MixerStateError(
            f"the checkpoint's data position is {_FORMAT_3} with canonical_nodes={state.get('canonical_nodes')} "
            f"(each batch dealt to the canonical nodes from node 0, which let them drift apart): {STATE_FORMAT} "
            "deals from a rotating start and cannot continue it exactly; finish that run with the grape_stream "
            "release that wrote it, or start the data stream afresh"
        )
    diff = {k: (state.get(k), v) for k, v in fingerprint.items() if state.get(k) != v}
    if diff:
        detail = "; ".join(f"{k}: checkpoint {a!r} vs this mixer {b!r}" for k, (a, b) in diff.items())
        raise MixerStateError(f"the checkpoint's data position does not fit this mixer ({detail})")
    schedule = state.get("schedule") or []
    if not schedule or [e["version"] for e in schedule] != list(range(len(schedule))):
        raise MixerStateError("the checkpoint's weight schedule is empty or its versions are not 0, 1, 2, ...")
    k = len(fingerprint["domains"])
    positions = read_positions(state, lanes, k, "position")
    o = state.get("origin") or {}
    origin = Origin(int(o.get("batch", 0)), int(o.get("num_samples", 0)),
                    tuple(read_positions(o, lanes, k, "origin").tolist()))
    batch = int(state["batch"])
    return SavedPosition(batch, int(state["global_batch_size"]), positions, origin, list(schedule),
                         _read_anchor(state, batch, positions, origin), lanes)


def _short(positions: np.ndarray) -> str:
    p = positions.tolist()
    return str(p) if len(p) <= 24 else f"{p[:24]}... ({len(p)} lane positions)"


def domain_stats(domains: Sequence[DomainStream], orders: Sequence[DomainOrder], counts: np.ndarray,
                 available: np.ndarray, alpha: np.ndarray, effective: np.ndarray) -> list[dict[str, Any]]:
    """Per-domain samples drawn (all ranks together), epochs, budget state and weights at positions ``counts``."""
    doms = []
    for k, d in enumerate(domains):
        o = orders[k]
        doms.append({
            "name": d.name,
            "samples_drawn": int(counts[k]),
            "epochs_completed": int(counts[k] // o.epoch_len),
            "epoch_progress": float(counts[k] / o.epoch_len),
            "samples_per_epoch": int(o.epoch_len),
            "num_samples": int(o.num_samples),
            "max_epochs": d.max_epochs,
            "spent": bool(not available[k]),
            "weight": float(alpha[k]),
            "effective_weight": float(effective[k]),
        })
    return doms


class StreamPosition:
    """The main process's side of the position: where the current global batch size took effect (the
    origin), where this run resumed, and a planner that finds every domain's position at any global batch
    (closed form from the nearest position known before it, or onward from the last batch asked for).

    Known positions: the origin, the resume point and its anchor, the last ``_KEEP`` piece starts the
    planner passed (the anchors of later states) and, without budgets, the cursor (where the next
    iteration starts: the main process moves it batch by batch; with budgets the planner walks instead,
    so that it passes the piece starts). A ``set_weights`` entry only changes batches from its
    ``from_batch`` on, so the positions known after it are forgotten (and a planner past it restarts)."""

    _KEEP = 64

    def __init__(self, composer: BatchComposer, schedule: WeightSchedule, fingerprint: Mapping[str, Any]) -> None:
        self.composer, self.schedule, self.fingerprint = composer, schedule, dict(fingerprint)
        self.topology = composer.topology
        self.lanes = composer.topology.lanes
        self.origin = Origin(0, 0, (0,) * (len(composer.orders) * self.lanes))
        self.resume_batch = 0
        self._planner: QuotaPlanner | None = None
        self._known: dict[int, np.ndarray] = {}
        self._entries_seen = len(schedule.history)

    def _note(self, batch: int, counts: np.ndarray) -> None:
        self._known.pop(batch, None)
        self._known[batch] = counts.copy()
        if len(self._known) > self._KEEP:
            self._known.pop(next(iter(self._known)))

    def _forget_changed(self) -> None:
        """Drop what new schedule entries changed: positions known after their first batch."""
        history = self.schedule.history
        if len(history) == self._entries_seen:
            return
        first = min(f for _, f, _ in history[self._entries_seen:])
        self._entries_seen = len(history)
        self._known = {b: c for b, c in self._known.items() if b <= first}
        if self._planner is not None and self._planner.batch > first:
            self._planner = None

    def _known_before(self, batch: int) -> tuple[int, np.ndarray]:
        """The latest (global batch <= ``batch``, positions) known without a walk (origin at least)."""
        best = (self.origin.batch, np.asarray(self.origin.positions, np.int64))
        points = list(self._known.items())
        if all(b is None for b in self.composer.budgets):
            cursor, counts, _ = self.schedule.table.read_anchor()
            points.append((self.topology.global_batch(cursor), counts))
        for b, c in points:
            if best[0] < b <= batch:
                best = (b, c)
        return best

    def planner_at(self, batch: int) -> QuotaPlanner:
        """A planner standing at global batch ``batch`` (or where the stream ended before it)."""
        if batch < self.origin.batch:
            raise ValueError(f"batch {batch} is before batch {self.origin.batch}, where the global batch size "
                             f"became {self.topology.global_batch_size}")
        self._forget_changed()
        p = self._planner
        if p is None or p.batch > batch or p.exhausted_at is None:
            start, counts = self._known_before(batch)
            if p is None or p.batch > batch or start > p.batch:
                p = self._planner = self.composer.planner(start, counts)
        segments = self.schedule.effective.segments
        for seg in segments(p.batch, batch) if p.exhausted_at is None else ():
            if p.batch == seg.origin:  # a piece starts: the anchor of a later state, perhaps
                self._note(p.batch, p.position)
            p.advance_to(seg.end, segments)
            if p.exhausted_at is not None:
                break
        return p

    def counts_at(self, batch: int) -> np.ndarray:
        """Every lane's position of every domain before global batch ``batch``."""
        return self.planner_at(batch).position

    def anchor(self, batch: int, counts: np.ndarray) -> tuple[int, np.ndarray]:
        """Where a resume checks the position ``counts`` at ``batch`` from: every domain's position at the
        start ``a`` of the ``TAIL_PIECES``-th last weight piece before ``batch`` (not before the origin).

        While no budget has run out at ``batch``, they are found backwards from ``counts`` over those
        pieces (closed form: a pure function of the position and the schedule, the same on every
        topology). Else (the domains available changed somewhere), forwards from a known position at
        most ``4 * TAIL_PIECES`` pieces before ``a``, or the earliest known position after ``a``."""
        c, eff = self.composer, self.schedule.effective
        start = eff.tail_start(self.origin.batch, batch, TAIL_PIECES)
        if start >= batch:
            return batch, counts
        budgets = np.array([np.iinfo(np.int64).max if b is None else b for b in c.budgets], np.int64)
        if (counts.reshape(self.lanes, -1).sum(axis=0) < budgets).all():
            walk = c.planner(start, np.zeros_like(counts))  # no budget is reached on the way: counts only grow
            walk.advance_to(batch, eff.segments)
            return start, counts - walk.position
        lo, lo_counts = self._known_before(start)
        if lo >= eff.tail_start(self.origin.batch, start, 4 * TAIL_PIECES):
            walk = c.planner(lo, lo_counts)
            walk.advance_to(start, eff.segments)
            if walk.exhausted_at is None:
                return start, walk.position
        later = sorted(b for b in self._known if start < b < batch)
        return (later[0], self._known[later[0]].copy()) if later else (batch, counts)

    def state(self, num_samples: int | None, from_beginning: bool) -> dict[str, Any]:
        t, s = self.topology, self.schedule
        batch = state_batch(num_samples, from_beginning, global_batch_size=t.global_batch_size, origin=self.origin,
                            consumed=s.consumed, micro=t.micro, consumed_known=s.consumed_known(),
                            resume_batch=self.resume_batch)
        p = self.planner_at(batch)
        counts = p.position
        anchor = None
        if self.composer.composition == "systematic":
            anchor = (batch, counts) if p.exhausted_at is not None else self.anchor(batch, counts)
        return make_state(batch, counts, global_batch_size=t.global_batch_size, origin=self.origin,
                          fingerprint=self.fingerprint, schedule=s.entries(), written_by=t.describe(), anchor=anchor,
                          lanes=self.lanes)

    def load(self, state: Mapping[str, Any]) -> int:
        """Check and adopt a checkpoint's position; return its global batch (the schedule is restored too).

        Systematic composition: the stored positions must be where the schedule leads from the anchor
        (a walk over the last few weight pieces), or from the origin in a state without an anchor."""
        saved = check_state(state, self.fingerprint)
        if saved.lanes != self.lanes:
            raise MixerStateError(
                f"the checkpoint's stream has canonical_nodes={saved.lanes} but this mixer is set to {self.lanes}: "
                f"set canonical_nodes={saved.lanes} (or leave it unset) to continue it"
            )
        schedule = read_entries(saved.schedule, len(self.composer.orders))
        if self.composer.composition == "systematic":  # closed form: cheap to check the stored positions
            start, counts = saved.anchor or (saved.origin.batch, saved.origin.positions)
            check = QuotaPlanner(seed=self.composer.seed, batch_size=saved.global_batch_size,
                                 composition="systematic", budgets=self.composer.budgets,
                                 start_batch=start, start_counts=counts, lanes=saved.lanes)
            check.advance_to(saved.batch, schedule.effective.segments)
            if not np.array_equal(check.position, saved.positions):
                raise MixerStateError(
                    f"the checkpoint's domain positions at batch {saved.batch} ({_short(saved.positions)}) are not "
                    f"where its weight schedule leads from batch {start} ({_short(check.position)}): edited by "
                    "hand, or written by another grape_stream release"
                )
        self.schedule.restore(schedule, saved.batch)
        if saved.global_batch_size == self.topology.global_batch_size:
            self.origin = saved.origin
        else:  # a new global batch size: every domain continues where it stopped, batches of g from here on
            num_samples = saved.origin.num_samples + (saved.batch - saved.origin.batch) * saved.global_batch_size
            self.origin = Origin(saved.batch, num_samples, tuple(int(p) for p in saved.positions))
        self._planner = self.composer.planner(saved.batch, saved.positions)
        self.resume_batch = saved.batch
        self._known, self._entries_seen = {}, len(self.schedule.history)
        if saved.anchor is not None and saved.anchor[0] >= self.origin.batch:
            self._note(*saved.anchor)
        self._note(saved.batch, saved.positions)
        return saved.batch
