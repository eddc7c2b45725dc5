"""The mixer's data position as plain numbers: the checkpoint state and the per-domain stats.

The position is topology-free: ``batch`` global batches consumed (all ranks together), every domain's
position in its global stream (``positions``), the global batch size and the weight schedule (in global
batches). A checkpoint written by 8 ranks with 2 workers each therefore resumes on 2 ranks with 3
workers, or on 1 rank with micro-batches, at exactly the next global batch. It also stores a fingerprint
of everything the stream assumes (seed, composition, shuffling, domains and their sizes, budgets); a
checkpoint whose fingerprint differs would continue a different stream, so it is refused with one line.

``grape_stream.mixer/2`` (this format) adds to ``/1``: ``global_batch_size``, ``positions``, ``origin``
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
from grape_stream.mixing.schedule import EffectiveSchedule, WeightSchedule

__all__ = ["STATE_FORMAT", "MixerStateError", "Origin", "SavedPosition", "StreamPosition", "check_state",
           "domain_stats", "make_state", "state_batch"]

STATE_FORMAT = "grape_stream.mixer/2"
_FORMAT_1 = "grape_stream.mixer/1"


class MixerStateError(DataError):
    """A checkpoint's data position that this mixer cannot continue exactly (one line: what and why)."""


@dataclass(frozen=True)
class Origin:
    """Where the current global batch size took effect: global batch, samples before it, domain positions."""

    batch: int
    num_samples: int
    positions: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "num_samples": self.num_samples, "positions": list(self.positions)}


@dataclass(frozen=True)
class SavedPosition:
    """What :func:`check_state` reads out of a checkpoint."""

    batch: int
    global_batch_size: int
    positions: np.ndarray
    origin: Origin
    schedule: list[dict[str, Any]]


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
               written_by: Mapping[str, int]) -> dict[str, Any]:
    """The checkpoint dict (plain Python types): format, position, the fingerprint's keys, the weight schedule."""
    num_samples = origin.num_samples + (batch - origin.batch) * int(global_batch_size)
    return {"format": STATE_FORMAT, "batch": int(batch), "num_samples": int(num_samples),
            "global_batch_size": int(global_batch_size), "positions": [int(p) for p in positions],
            "origin": origin.as_dict(), **fingerprint, "schedule": schedule, "written_by": dict(written_by)}


def check_state(state: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> SavedPosition:
    """The position of a checkpoint that fits this mixer; :class:`MixerStateError` naming what does not."""
    fmt = state.get("format") if isinstance(state, Mapping) else None
    if fmt == _FORMAT_1:
        raise MixerStateError(
            f"the checkpoint's data position is {_FORMAT_1} (per-rank streams of an older grape_stream): the "
            f"topology-independent stream of {STATE_FORMAT} cannot continue it exactly; finish that run with the "
            "grape_stream release that wrote it, or start the data stream afresh"
        )
    if fmt != STATE_FORMAT:
        raise MixerStateError(f"not a WeightedStreamingMixer state (format {fmt!r}, expected {STATE_FORMAT!r})")
    diff = {k: (state.get(k), v) for k, v in fingerprint.items() if state.get(k) != v}
    if diff:
        detail = "; ".join(f"{k}: checkpoint {a!r} vs this mixer {b!r}" for k, (a, b) in diff.items())
        raise MixerStateError(f"the checkpoint's data position does not fit this mixer ({detail})")
    schedule = state.get("schedule") or []
    if not schedule or [e["version"] for e in schedule] != list(range(len(schedule))):
        raise MixerStateError("the checkpoint's weight schedule is empty or its versions are not 0, 1, 2, ...")
    k = len(fingerprint["domains"])
    positions = np.asarray(state.get("positions") or [], dtype=np.int64)
    o = state.get("origin") or {}
    origin = Origin(int(o.get("batch", 0)), int(o.get("num_samples", 0)), tuple(int(x) for x in o.get("positions", ())))
    if positions.shape != (k,) or len(origin.positions) != k or (positions < 0).any():
        raise MixerStateError(f"the checkpoint's positions or origin do not hold {k} domain positions")
    return SavedPosition(int(state["batch"]), int(state["global_batch_size"]), positions, origin, list(schedule))


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
    (closed form from the origin, or onward from the last batch asked for)."""

    def __init__(self, composer: BatchComposer, schedule: WeightSchedule, fingerprint: Mapping[str, Any]) -> None:
        self.composer, self.schedule, self.fingerprint = composer, schedule, dict(fingerprint)
        self.topology = composer.topology
        self.origin = Origin(0, 0, (0,) * len(composer.orders))
        self.resume_batch = 0
        self._planner: QuotaPlanner | None = None

    def planner_at(self, batch: int) -> QuotaPlanner:
        """A planner standing at global batch ``batch`` (or where the stream ended before it)."""
        if batch < self.origin.batch:
            raise ValueError(f"batch {batch} is before batch {self.origin.batch}, where the global batch size "
                             f"became {self.topology.global_batch_size}")
        p = self._planner
        if p is None or p.batch > batch:
            p = self._planner = self.composer.planner(self.origin.batch, self.origin.positions)
        p.advance_to(batch, self.schedule.effective.segments)
        return p

    def counts_at(self, batch: int) -> np.ndarray:
        return self.planner_at(batch).counts.copy()

    def state(self, num_samples: int | None, from_beginning: bool) -> dict[str, Any]:
        t, s = self.topology, self.schedule
        batch = state_batch(num_samples, from_beginning, global_batch_size=t.global_batch_size, origin=self.origin,
                            consumed=s.consumed, micro=t.micro, consumed_known=s.consumed_known(),
                            resume_batch=self.resume_batch)
        return make_state(batch, self.counts_at(batch), global_batch_size=t.global_batch_size, origin=self.origin,
                          fingerprint=self.fingerprint, schedule=s.entries(), written_by=t.describe())

    def load(self, state: Mapping[str, Any]) -> int:
        """Check and adopt a checkpoint's position; return its global batch (the schedule is restored too)."""
        saved = check_state(state, self.fingerprint)
        g = self.topology.global_batch_size
        if self.composer.composition == "systematic":  # closed form: cheap to check the stored positions
            check = QuotaPlanner(seed=self.composer.seed, batch_size=saved.global_batch_size,
                                 composition="systematic", budgets=self.composer.budgets,
                                 start_batch=saved.origin.batch, start_counts=saved.origin.positions)
            effective = EffectiveSchedule()
            for e in saved.schedule:
                effective.add(int(e["version"]), int(e["from_batch"]), np.asarray(e["alpha"], np.float64))
            check.advance_to(saved.batch, effective.segments)
            if not np.array_equal(check.counts, saved.positions):
                raise MixerStateError(
                    f"the checkpoint's domain positions at batch {saved.batch} ({saved.positions.tolist()}) are not "
                    f"where its weight schedule leads ({check.counts.tolist()}): edited by hand, or written by "
                    "another grape_stream release"
                )
        self.schedule.restore(saved.schedule, saved.batch)
        if saved.global_batch_size == g:
            self.origin = saved.origin
        else:  # a new global batch size: every domain continues where it stopped, batches of g from here on
            num_samples = saved.origin.num_samples + (saved.batch - saved.origin.batch) * saved.global_batch_size
            self.origin = Origin(saved.batch, num_samples, tuple(int(p) for p in saved.positions))
        self._planner = self.composer.planner(saved.batch, saved.positions)
        self.resume_batch = saved.batch
        return saved.batch
