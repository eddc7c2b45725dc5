"""Composing batches: the loop each process (main or DataLoader worker) runs to build its batches.

A process reads the cursor and the weight schedule from the shared table, plans batch ``i`` with a
:class:`~grape_stream.mixing.quotas.QuotaPlanner` (quotas and read positions are a pure function of
``(seed, i, rank, schedule)``), reads the samples by random access, shuffles them into emission order
and hands them out as one collated batch (:class:`~grape_stream.mixing.loader.MixerDataLoader`) or as
single samples (a plain DataLoader). Worker ``w`` of ``W`` composes batches ``start + w, start + w + W,
...``: exactly the ones torch's DataLoader asks it for, so no process talks to another.
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
from grape_stream.mixing.quotas import BatchPlan, QuotaPlanner, default_on_spent, slot_permutation
from grape_stream.mixing.schedule import EffectiveSchedule, WeightSchedule
from grape_stream.mixing.shard_reader import DomainReader, Prefetcher
from grape_stream.mixing.weight_table import ScheduleOverflow
from grape_stream.retry import RetryPolicy

__all__ = ["RESERVED_KEYS", "BatchComposer", "MainProcess", "batch_tensors", "packed_batch", "packed_batches",
           "samples_of"]

#: Keys the mixer adds to every sample; a dataset column with one of these names is refused.
RESERVED_KEYS = ("domain", "weights_version", "batch_index", "sample_index", "epoch")


@dataclass
class MainProcess:
    """What only the main process does while composing: stop once the mixer is closed, own its prefetchers."""

    is_closed: Callable[[], bool]
    prefetchers: weakref.WeakSet[Prefetcher] = field(default_factory=weakref.WeakSet)


@dataclass
class BatchComposer:
    """The fixed facts of one rank's plan, shared by every process that composes its batches."""

    seed: int
    rank: int
    batch_size: int
    composition: str
    domain_names: list[str]
    orders: list[DomainOrder]
    budgets: list[int | None]
    datasets: list[Any]
    predownload: int
    needs_prefetch: list[bool]
    retry: list[RetryPolicy]

    def planner(self, start: int = 0, counts: Sequence[int] | np.ndarray | None = None,
                on_spent: Callable[[int, int], None] | None = None) -> QuotaPlanner:
        return QuotaPlanner(seed=self.seed, rank=self.rank, batch_size=self.batch_size, composition=self.composition,
                            budgets=self.budgets, start_batch=start, start_counts=counts, on_spent=on_spent)

    def readers(self) -> list[DomainReader]:
        return [DomainReader(name, ds, retry=policy)
                for name, ds, policy in zip(self.domain_names, self.datasets, self.retry)]

    # -- one batch ---------------------------------------------------------------------------------
    def gather(self, plan: BatchPlan, readers: list[DomainReader],
               batch_reader: BatchReader | None = None) -> dict[str, Any]:
        """The batch's columns in emission order: stacked arrays where possible, else lists.

        Emission slot ``j`` holds the ``perm[j]``-th sample of the batch grouped by domain (domains in
        index order, each in its read order), ``perm`` = :func:`slot_permutation`. The sample ids are
        put in emission order first and read in one pass (:class:`BatchReader`); when a shard does not
        allow that, domain by domain (same samples, same order).
        """
        ks = np.flatnonzero(plan.quota)
        quota = plan.quota[ks]
        pieces = [self.orders[k].window_ids(s, q)
                  for k, s, q in zip(ks.tolist(), plan.start[ks].tolist(), quota.tolist())]
        ids = np.concatenate([p[0] for p in pieces])
        n = len(ids)
        perm = slot_permutation(self.seed, plan.batch, self.rank, n)
        dom = np.repeat(ks, quota)[perm]
        ids_e = ids[perm]
        cols = batch_reader.read(dom, ids_e) if batch_reader is not None else None
        out: dict[str, Any] = self._gather_by_domain(ks, pieces, readers, perm) if cols is None else cols
        out["domain"] = dom
        out["sample_index"] = ids_e
        out["epoch"] = np.concatenate([p[1] for p in pieces])[perm]
        out["weights_version"] = np.full(n, plan.version, np.int64)
        out["batch_index"] = np.full(n, plan.batch, np.int64)
        return out

    def _gather_by_domain(self, ks: np.ndarray, pieces: list[tuple[np.ndarray, np.ndarray]],
                          readers: list[DomainReader], perm: np.ndarray) -> dict[str, Any]:
        """The data columns read domain by domain (any shard format), in emission order."""
        parts: list[dict[str, Any]] = []
        for k, (ids, _) in zip(ks.tolist(), pieces):
            cols: dict[str, Any] | None = readers[k].read_batch(ids)
            if cols is None:
                rows = readers[k].read(ids)
                cols = {key: [r[key] for r in rows] for key in rows[0]}
            parts.append(cols)
        keys = list(parts[0])
        for p, k in zip(parts[1:], ks[1:]):
            if list(p) != keys:
                raise ValueError(
                    f"domain {self.domain_names[int(k)]!r} has columns {list(p)} but "
                    f"{self.domain_names[int(ks[0])]!r} has {keys}: all domains must have the same columns"
                )
        out: dict[str, Any] = {}
        for key in keys:
            vals = [p[key] for p in parts]
            if all(isinstance(v, np.ndarray) for v in vals) and len({(v.dtype, v.shape[1:]) for v in vals}) == 1:
                out[key] = np.concatenate(vals)[perm]
            else:
                flat = [x for v in vals for x in (list(v) if isinstance(v, np.ndarray) else v)]
                out[key] = [flat[j] for j in perm]
        return out

    def prefetch_ahead(self, plan: BatchPlan, prefetcher: Prefetcher, readers: list[DomainReader],
                       horizon: np.ndarray) -> None:
        """Ask for the shards of each domain's next ``predownload * alpha_k`` samples.

        ``horizon[k]`` is how far domain k has been looked ahead already; the look-ahead is renewed
        (twice as far) only when the read position comes within half of it, so this costs little per batch.
        """
        ahead_all = np.ceil(self.predownload * plan.alpha).astype(np.int64) + 1
        pos_all = plan.start + plan.quota
        due = (plan.alpha > 0) & np.asarray(self.needs_prefetch, bool) & (pos_all + ahead_all // 2 >= horizon)
        for k in np.flatnonzero(due).tolist():
            ahead = int(ahead_all[k])
            pos = int(pos_all[k])
            begin = max(pos, int(horizon[k]))
            ids, _ = self.orders[k].sample_ids(begin, pos + 2 * ahead - begin)
            horizon[k] = pos + 2 * ahead
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
        next_seq = table.read_into(sched, max(0, table.published - table.C + table.C // 4))
        try:
            sched.at(start)
        except KeyError:
            raise ScheduleOverflow(
                f"the weights in force at batch {start} are no longer in the shared schedule; raise "
                "schedule_capacity"
            ) from None
        loop = _Loop(self, schedule, sched, next_seq, slot,
                     self.planner(start, counts, default_on_spent(self.domain_names) if worker == 0 else None))
        if main is not None and loop.prefetcher is not None:
            main.prefetchers.add(loop.prefetcher)
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
                plan, cols = plan_cols
                if batched:
                    out = packed_batch(cols) if batched == "packed" else batch_tensors(cols)
                    if main is not None:
                        schedule.advance_cursor(batch + 1, plan.start + plan.quota)
                    yield out
                else:
                    samples = samples_of(cols)
                    last = samples.pop()
                    yield from samples
                    if main is not None:
                        # Without workers, the consumer holds batch `batch` once its last sample is taken:
                        # from then on it counts as consumed, and a new iteration starts after it.
                        schedule.advance_cursor(batch + 1, plan.start + plan.quota)
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


def _messages(loop: "_Loop", start: int, per_message: int, num_workers: int, worker: int) -> Iterator[PackedBatch]:
    """Worker ``worker``'s messages: messages ``worker, worker + W, ...`` (torch's round-robin), message
    ``t`` holding the :func:`message_size` batches that follow messages ``0..t-1``, from batch ``start``."""
    begin, t = start, 0
    while True:
        size = message_size(t, per_message, num_workers)
        if t % num_workers == worker:
            group = [c for c in map(loop.compose, range(begin, begin + size)) if c is not None]
            if group:
                yield packed_batches(group)
            if len(group) < size:
                return
        begin += size
        t += 1


class _Loop:
    """One process's composing state: the planner, its readers and prefetcher, its view of the schedule."""

    def __init__(self, composer: BatchComposer, schedule: WeightSchedule, sched: EffectiveSchedule, next_seq: int,
                 slot: int, planner: QuotaPlanner) -> None:
        self.composer, self.table, self.sched = composer, schedule.table, sched
        self.next_seq, self.slot = next_seq, slot
        self.planner = planner
        self.readers = composer.readers()
        self.batch_reader = BatchReader(self.readers)
        self.prefetcher = Prefetcher(self.readers) if any(composer.needs_prefetch) else None
        self.horizon = np.zeros(len(composer.orders), np.int64)

    def compose_plan(self, batch: int) -> tuple[BatchPlan, dict[str, Any]] | None:
        """Batch ``batch``'s plan and columns (None once the stream is exhausted)."""
        self.next_seq = self.table.read_into(self.sched, self.next_seq)
        self.table.claim(self.slot, batch)
        plan = self.planner.plan(batch, self.sched.segments)
        if plan is None:
            return None
        cols = self.composer.gather(plan, self.readers, self.batch_reader)
        if self.prefetcher is not None:
            self.composer.prefetch_ahead(plan, self.prefetcher, self.readers, self.horizon)
        self.sched.prune_before(batch)
        return plan, cols

    def compose(self, batch: int) -> dict[str, Any] | None:
        got = self.compose_plan(batch)
        return None if got is None else got[1]

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


def packed_batches(group: list[dict[str, Any]]) -> PackedBatch:
    """Consecutive batches (equal sizes) as one PackedBatch: each column concatenated, ``batches`` = their number."""
    if len(group) == 1:
        return packed_batch(group[0])
    n = len(group[0]["batch_index"])
    meta = np.empty((len(RESERVED_KEYS), n * len(group)), np.int64)
    for j, cols in enumerate(group):
        for i, key in enumerate(RESERVED_KEYS):
            meta[i, j * n:(j + 1) * n] = cols[key]
    data: dict[str, Any] = {}
    for key in group[0]:
        if key in RESERVED_KEYS:
            continue
        vals = [cols[key] for cols in group]
        if all(isinstance(v, np.ndarray) for v in vals) and len({(v.dtype, v.shape[1:]) for v in vals}) == 1:
            data[key] = np.concatenate(vals)
        else:
            data[key] = [x for v in vals for x in v]
    return PackedBatch(data, meta, RESERVED_KEYS, batches=len(group))


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
