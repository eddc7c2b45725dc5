"""Composing batches: the loop each process (main or DataLoader worker) runs to build its batches.

A process reads the cursor and the weight schedule from the shared table, plans the global batch of its
loader batch ``j`` with a :class:`~grape_stream.mixing.planner.QuotaPlanner` (quotas and read positions
are a pure function of ``(seed, global batch, schedule)``), finds the samples of its slots
(:mod:`grape_stream.mixing.rows`), reads them by random access and hands them out as one collated batch
(:class:`~grape_stream.mixing.loader.MixerDataLoader`) or as single samples (a plain DataLoader). Worker
``w`` of ``W`` composes batches ``start + w, start + w + W, ...``: exactly the ones torch's DataLoader
asks it for, so no process talks to another.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from grape_stream.mixing.batch_read import BatchReader
from grape_stream.mixing.collate import PackedBatch, to_tensor
from grape_stream.mixing.epoch_order import DomainOrder
from grape_stream.mixing.planner import QuotaPlanner
from grape_stream.mixing.quotas import BatchPlan, default_on_spent
from grape_stream.mixing.rows import RESERVED_KEYS, run_columns
from grape_stream.mixing.schedule import EffectiveSchedule, WeightSchedule
from grape_stream.mixing.shard_reader import DomainReader, Prefetcher
from grape_stream.mixing.topology import RankBatch, Topology
from grape_stream.mixing.weight_table import ScheduleOverflow
from grape_stream.retry import RetryPolicy

__all__ = ["RESERVED_KEYS", "BatchComposer", "MainProcess", "batch_tensors", "packed_batch", "samples_of"]



@dataclass
class MainProcess:
    """What only the main process does while composing: stop once the mixer is closed, own its prefetchers."""

    is_closed: Callable[[], bool]
    prefetchers: weakref.WeakSet[Prefetcher] = field(default_factory=weakref.WeakSet)


@dataclass
class BatchComposer:
    """The fixed facts of one rank's plan, shared by every process that composes its batches."""

    seed: int
    topology: Topology
    composition: str
    domain_names: list[str]
    orders: list[DomainOrder]
    budgets: list[int | None]
    datasets: list[Any]
    predownload: int
    needs_prefetch: list[bool]
    retry: list[RetryPolicy]
    #: (weights, look-ahead per domain, half of it or -inf where nothing is fetched) for prefetch_ahead
    _look_ahead: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)

    @property
    def batch_size(self) -> int:
        return self.topology.batch_size

    def planner(self, start: int = 0, counts: Sequence[int] | np.ndarray | None = None,
                on_spent: Callable[[int, int], None] | None = None) -> QuotaPlanner:
        """A planner of the global stream at global batch ``start`` with lane positions ``counts``."""
        return QuotaPlanner(seed=self.seed, batch_size=self.topology.global_batch_size, composition=self.composition,
                            budgets=self.budgets, start_batch=start, start_counts=counts, on_spent=on_spent,
                            lanes=self.topology.lanes)

    def readers(self) -> list[DomainReader]:
        return [DomainReader(name, ds, retry=policy)
                for name, ds, policy in zip(self.domain_names, self.datasets, self.retry)]

    # -- one batch, or a run of consecutive batches ------------------------------------------------
    def gather(self, batch: RankBatch, readers: list[DomainReader],
               batch_reader: BatchReader | None = None) -> dict[str, Any]:
        """The batch's columns in emission order (the metadata columns included): stacked arrays where
        possible, else lists. See :meth:`gather_run`."""
        data, meta = self._columns([batch], readers, batch_reader)
        for key, row in zip(RESERVED_KEYS, meta):
            data[key] = row
        return data

    def gather_run(self, batches: Sequence[RankBatch], readers: list[DomainReader],
                   batch_reader: BatchReader | None = None) -> PackedBatch:
        """Consecutive batches as one :class:`PackedBatch`: rows batch after batch, each exactly as
        :meth:`gather` gives it, read in one pass over the shards (why: :mod:`grape_stream.mixing.rows`)."""
        data, meta = self._columns(batches, readers, batch_reader)
        return PackedBatch(data, meta, RESERVED_KEYS, batches=len(batches))

    def _columns(self, batches: Sequence[RankBatch], readers: list[DomainReader],
                 batch_reader: BatchReader | None) -> tuple[dict[str, Any], np.ndarray]:
        t = self.topology
        return run_columns(self.orders, self.seed, t.batch_size, t.global_batch_size, self.domain_names, batches,
                           readers, batch_reader)

    def prefetch_ahead(self, plan: BatchPlan, prefetcher: Prefetcher, readers: list[DomainReader],
                       horizon: np.ndarray) -> None:
        """Ask for the shards of the positions of each of this rank's lanes' streams that hold its next
        ``predownload * alpha_k`` samples: ``predownload * world_size / lanes * alpha_k`` positions of each
        lane (a lane's slots are shared by ``world_size / lanes`` ranks, their slots scattered over them).

        ``horizon[c, k]`` is how far lane c of domain k has been looked ahead already; the look-ahead is
        renewed (twice as far) only when the read position comes within half of it, so this costs little
        per batch.
        """
        t = self.topology
        cached = self._look_ahead
        if cached is None or cached[0] is not plan.alpha:  # new weights: once per segment, not per batch
            ahead = np.ceil(self.predownload * t.world_size / t.lanes * plan.alpha).astype(np.int64) + 1
            live = (plan.alpha > 0) & np.asarray(self.needs_prefetch, bool)
            cached = self._look_ahead = (plan.alpha, ahead, np.where(live, ahead // 2, np.iinfo(np.int64).min // 2))
        _, ahead_all, half = cached
        lanes = t.my_lanes()
        pos_all = plan.start.reshape(t.lanes, -1)[lanes.start:lanes.stop]
        due = pos_all + half[None, :] >= horizon[lanes.start:lanes.stop]
        if not due.any():
            return
        for i, k in zip(*(a.tolist() for a in np.nonzero(due))):
            c = lanes.start + i
            if readers[k].all_ready:  # e.g. every shard decompressed or downloaded already: never due again
                horizon[:, k] = np.iinfo(np.int64).max // 2
                continue
            ahead = int(ahead_all[k])
            pos = int(pos_all[i, k])
            begin = max(pos, int(horizon[c, k]))
            ids, _ = self.orders[k].sample_ids(begin, pos + 2 * ahead - begin, c)
            horizon[c, k] = pos + 2 * ahead
            for sid in dict.fromkeys(readers[k].shard_ids(ids).tolist()):
                if readers[k].needs_prepare(sid):
                    prefetcher.request(k, sid)

    # -- the loop ----------------------------------------------------------------------------------
    def batches(self, schedule: WeightSchedule, *, slot: int, num_workers: int, worker: int, batched: bool | str,
                main: MainProcess | None, per_message: int = 1) -> Iterator[Any]:
        """This process's batches from the shared cursor on (``slot`` 0 = main process, 1 + w = worker w):
        single samples (``batched=False``), collated batches (True) or :class:`PackedBatch` ("packed").

        ``per_message`` (workers, "packed" only): worker ``w`` composes runs of up to that many consecutive
        batches (see :func:`_messages`) and yields each run as one PackedBatch (one DataLoader message;
        the loader splits it). Which samples a batch holds does not depend on it."""
        table = schedule.table
        start, counts, _ = table.read_anchor()
        prev = table.claim(slot, start - 1)
        if prev >= start and main is None:
            warnings.warn(
                f"the mixer restarts at batch {start}, but worker {worker} had already composed up to batch "
                f"{prev}: a plain DataLoader was iterated again without moving the mixer's cursor. Use "
                "mixer.dataloader(...), or mixer.seek(batch) / load_state_dict before iterating again.",
                RuntimeWarning,
                stacklevel=1,  # this generator runs inside a DataLoader worker: no useful caller to point at
            )
        sched = EffectiveSchedule()
        next_seq = table.read_into(sched, max(table.base, table.published - table.C + table.C // 4))
        try:
            sched.at(start)
        except KeyError:
            raise ScheduleOverflow(
                f"the weights in force at batch {start} are no longer in the shared schedule; raise "
                "schedule_capacity"
            ) from None
        loop = _Loop(self, schedule, sched, next_seq, slot, start, counts,
                     default_on_spent(self.domain_names) if worker == 0 else None)
        if main is not None and loop.prefetcher is not None:
            main.prefetchers.add(loop.prefetcher)
        if batched and main is not None:
            try:
                yield from _main_batches(loop, schedule, start, main, packed=batched == "packed")
            finally:
                loop.close()
            return
        if batched == "packed" and main is None and per_message > 1:
            try:
                yield from _messages(loop, start, per_message, num_workers, worker)
            finally:
                loop.close()
            return
        batch = start + worker
        try:
            while True:
                if main is not None and main.is_closed():
                    raise RuntimeError("the mixer was closed while it was being iterated")
                plan_cols = loop.compose_plan(batch)
                if plan_cols is None:
                    return
                rb, cols = plan_cols
                if batched:  # a worker (the main process composes runs: _main_batches)
                    yield packed_batch(cols) if batched == "packed" else batch_tensors(cols)
                else:
                    samples = samples_of(cols)
                    last = samples.pop()
                    yield from samples
                    if main is not None:
                        # Without workers, the consumer holds batch `batch` once its last sample is taken:
                        # from then on it counts as consumed, and a new iteration starts after it.
                        schedule.advance_cursor(batch + 1, rb.next_counts)
                    yield last
                batch += num_workers
        finally:
            loop.close()


def message_size(message: int, per_message: int, num_workers: int) -> int:
    """Batches in message ``message`` (counted from where the iteration starts, all workers together).

    The first round of messages holds one batch each, the next two, then four, ... up to ``per_message``:
    the first batch arrives after one batch's composing (and downloads), not ``per_message``'s. Every
    message holds at most ``per_message`` batches, so the loader's depth bound holds from the start."""
    return min(per_message, 1 << min(message // num_workers, 30))


#: The main process (no DataLoader workers) composes runs of about this many samples at once (see
#: :func:`_main_batches`); measured with bench/loader.py.
SAMPLES_PER_RUN = 512


def _main_batches(loop: "_Loop", schedule: WeightSchedule, start: int, main: MainProcess,
                  packed: bool) -> Iterator[Any]:
    """The main process's collated batches (or PackedBatches), composed in runs of consecutive batches.

    Why runs: reading a run touches each shard once (:meth:`BatchComposer.gather_run`), where batch by
    batch a small batch pays for every shard it touches. Why it stays exact: a run is composed ahead
    with the weights known then, but nothing about a batch is published before it is handed out (its
    claim, the cursor, the consumed count), so ``set_weights`` still sees only the batches handed out;
    and when new weights were published since the run was composed, the rest of the run is dropped and
    composed again from the planner's state before it (a pure function of it: the same batches as
    without runs, whatever the timing). Runs grow 1, 2, 4, ... (the first batch is not delayed) up to
    ``SAMPLES_PER_RUN // batch_size`` batches.
    """
    table = loop.table
    per_run = max(1, SAMPLES_PER_RUN // loop.composer.batch_size)
    batch, t = start, 0
    while True:
        size = message_size(t, per_run, 1)
        seq = table.published
        rbs = loop.plans(batch, size, claim=False)
        if not rbs:
            return
        run = loop.composer.gather_run(rbs, loop.readers, loop.batch_reader)
        for j, rb in enumerate(rbs):
            if main.is_closed():
                raise RuntimeError("the mixer was closed while it was being iterated")
            if j and table.published != seq:  # new weights: batches from here on may change
                loop.rewind(rb)
                break
            table.claim(loop.slot, rb.batch)
            part = run.batch(j)
            out = part if packed else part.tensors()
            schedule.advance_cursor(rb.batch + 1, rb.next_counts)
            yield out
            batch = rb.batch + 1
        else:
            if len(rbs) < size:
                return  # the stream ended inside this run
        t += 1


def _messages(loop: "_Loop", start: int, per_message: int, num_workers: int, worker: int) -> Iterator[PackedBatch]:
    """Worker ``worker``'s messages: messages ``worker, worker + W, ...`` (torch's round-robin), message
    ``t`` holding the :func:`message_size` batches that follow messages ``0..t-1``, from batch ``start``."""
    begin, t = start, 0
    while True:
        size = message_size(t, per_message, num_workers)
        if t % num_workers == worker:
            plans = loop.plans(begin, size)
            if plans:
                yield loop.composer.gather_run(plans, loop.readers, loop.batch_reader)
            if len(plans) < size:
                return
        begin += size
        t += 1


class _Loop:
    """One process's composing state: the planner, its readers and prefetcher, its view of the schedule."""

    def __init__(self, composer: BatchComposer, schedule: WeightSchedule, sched: EffectiveSchedule, next_seq: int,
                 slot: int, start: int, counts: np.ndarray, on_spent: Callable[[int, int], None] | None) -> None:
        self.composer, self.table, self.sched = composer, schedule.table, sched
        self.next_seq, self.slot = next_seq, slot
        self.on_spent = on_spent
        self.topology = composer.topology
        self.planner = composer.planner(self.topology.global_batch(start), counts, on_spent)
        self.readers = composer.readers()
        self.batch_reader = BatchReader(self.readers)
        self.prefetcher = Prefetcher(self.readers) if any(composer.needs_prefetch) else None
        self.horizon = np.zeros((self.topology.lanes, len(composer.orders)), np.int64)

    def plan(self, batch: int, claim: bool = True, prune: bool = True) -> RankBatch | None:
        """Loader batch ``batch``: its global batch's plan and its slots (None once the stream is exhausted),
        its shards asked for ahead; with ``claim``, recorded in the shared table as started (see
        :meth:`SharedWeightTable.claim`); with ``prune``, weight pieces that ended before it forgotten."""
        self.next_seq = self.table.read_into(self.sched, self.next_seq)
        if claim:
            self.table.claim(self.slot, batch)
        topo = self.topology
        gb = topo.global_batch(batch)
        fresh = self.planner.batch <= gb
        plan = self.planner.plan(gb, self.sched.segments)
        if plan is None:
            return None
        if fresh and self.prefetcher is not None:
            self.composer.prefetch_ahead(plan, self.prefetcher, self.readers, self.horizon)
        if prune:
            self.sched.prune_before(gb)
        return RankBatch(batch, plan, topo.first_slot(batch), topo.ends_global_batch(batch))

    def plans(self, begin: int, size: int, claim: bool = True) -> list[RankBatch]:
        """Loader batches ``begin ... begin + size - 1`` (fewer where the stream ends). The weight pieces
        are kept from ``begin`` on: the main process may :meth:`rewind` to any batch of the run."""
        out: list[RankBatch] = []
        for b in range(begin, begin + size):
            rb = self.plan(b, claim, prune=False)
            if rb is None:
                break
            out.append(rb)
        self.sched.prune_before(self.topology.global_batch(begin))
        return out

    def rewind(self, rb: RankBatch) -> None:
        """Plan again from ``rb``'s global batch (its read positions are where the planner stood before it)."""
        self.planner = self.composer.planner(rb.plan.batch, rb.plan.start, self.on_spent)

    def compose_plan(self, batch: int) -> tuple[RankBatch, dict[str, Any]] | None:
        """Loader batch ``batch`` and its columns (None once the stream is exhausted)."""
        rb = self.plan(batch)
        if rb is None:
            return None
        return rb, self.composer.gather(rb, self.readers, self.batch_reader)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.stop()
        for r in self.readers:
            r.close()


def packed_batch(cols: dict[str, Any]) -> PackedBatch:
    """The batch as numpy arrays (what a DataLoader worker sends; ``.tensors()`` collates it)."""
    meta = np.empty((len(RESERVED_KEYS), len(cols["batch_index"])), np.int64)
    for i, key in enumerate(RESERVED_KEYS):
        meta[i] = cols[key]
    return PackedBatch({key: val for key, val in cols.items() if key not in RESERVED_KEYS}, meta, RESERVED_KEYS)


def batch_tensors(cols: dict[str, Any]) -> dict[str, Any]:
    """A collated batch (what ``collate_samples`` makes of the per-sample form); the per-sample metadata
    as rows of one tensor: one shared-memory block to pass between processes instead of five."""
    return packed_batch(cols).tensors()


def samples_of(cols: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch as single samples (what a plain DataLoader collates itself)."""
    n = len(cols["batch_index"])
    meta = {key: cols[key].tolist() for key in RESERVED_KEYS}
    data = {key: val for key, val in cols.items() if key not in RESERVED_KEYS}
    out = []
    for j in range(n):
        sample = {key: to_tensor(val[j]) for key, val in data.items()}
        for key in RESERVED_KEYS:
            sample[key] = meta[key][j]
        out.append(sample)
    return out
