"""WeightedStreamingMixer: K streaming domains mixed by weights that change while the loader runs.

One mosaicml-streaming ``StreamingDataset`` per domain provides the index, downloads, decompression,
the node-wide shard cache with ``cache_limit`` eviction and the shared-memory coordination. The mixer
replaces streaming's *iteration*: it reads each domain by random access in an order it plans itself,
because streaming's ``__iter__`` fixes per-worker partitions and per-epoch proportions up front and
starts every epoch with a barrier across all workers of the node, while a mixture with live weights
needs per-batch quotas and independent epochs per domain. The stream is a sequence of *global*
batches, a pure function of ``(seed, global batch index, weight schedule)`` and of no topology:

* global batch ``i`` takes ``quota[k]`` samples of domain ``k`` (:mod:`grape_stream.mixing.quotas`),
* at the next positions of that domain's global stream (:mod:`grape_stream.mixing.epoch_order`:
  shard-aware shuffled epochs),
* with the weights of the schedule entry in force at batch ``i`` (:mod:`grape_stream.mixing.schedule`),
* and each rank reads its slice of the batch's keyed slot order (:mod:`grape_stream.mixing.topology`,
  :mod:`grape_stream.mixing.rows`),

so DataLoader workers compose their batches independently (worker ``w`` composes batches
``w, w + W, ...``, exactly the ones torch's DataLoader asks it for), the samples depend neither on the
number of workers nor on the number of ranks, and the whole data position is ``(global batches
consumed, every domain's position, weight schedule)``: a run resumed on any topology continues exactly.
See docs/mixer.md. This module wires the parts together (the package docstring lists them) and holds
the public methods.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

from grape_stream.config import MixerConfig, with_overrides
from grape_stream.mixing.collate import collate_samples
from grape_stream.mixing.compose import RESERVED_KEYS, BatchComposer, MainProcess
from grape_stream.mixing.domains import (
    PASSTHROUGH,
    DomainStream,
    as_domains,
    check_streaming_kwargs,
    domain_dirs,
    name_seed,
    open_datasets,
    prepare_locals,
    release_all,
)
from grape_stream.mixing.epoch_order import DomainOrder
from grape_stream.mixing.loader import MixerDataLoader
from grape_stream.mixing.position import STATE_FORMAT, MixerStateError, StreamPosition, domain_stats, state_lanes
from grape_stream.mixing.probe import probe_ids, probe_samples
from grape_stream.mixing.quotas import COMPOSITIONS, budget_for, effective_weights
from grape_stream.mixing.schedule import WeightSchedule, validate_weights
from grape_stream.mixing.shard_reader import DomainReader, DomainReadError, Prefetcher
from grape_stream.mixing.topology import Topology
from grape_stream.mixing.weight_table import MAX_SLOTS
from grape_stream.retry import default_policy
from grape_stream.stale_temp import sweep_stale_multiprocessing_dirs
from grape_stream.streaming_compat.local_index import DomainUnavailableError, RemoteMismatchError
from grape_stream.streaming_compat.shard_state import bytes_to_int, shm_prefix
from grape_stream.world import dataloader_worker, streaming_world

__all__ = [
    "DomainStream",
    "WeightedStreamingMixer",
    "MixerDataLoader",
    "collate_samples",
    "DomainUnavailableError",
    "DomainReadError",
    "RemoteMismatchError",
    "STATE_FORMAT",
    "MixerStateError",
    "RESERVED_KEYS",
]


class WeightedStreamingMixer(IterableDataset):
    """Mix K streaming domains by weights that may change at any batch, deterministically and resumably.

    Use with ``mixer.dataloader(num_workers=W)`` (recommended: it tracks the batches consumed, so that
    ``set_weights`` takes effect at a deterministic batch) or with
    ``torch.utils.data.DataLoader(mixer, batch_size=batch_size, num_workers=W)``. The DataLoader's batch
    size must equal ``batch_size``. Every sample is a dict with the dataset's columns (``tokens`` as an
    int64 tensor) plus ``domain`` (index), ``weights_version`` (the schedule entry that composed its
    batch), ``batch_index`` (this rank's loader batch; the global batch is ``batch_index // micro``),
    ``sample_index`` (id within the domain) and ``epoch`` (of the domain).

    Args:
        domains: the K domains: DomainStream objects, dicts of their fields, or mosaicml-streaming ``Stream``
            objects (``streams=`` is the same list: named by their path, ``proportion`` is the initial weight).
        weights: initial mixture (K non-negative numbers summing to 1); default uniform.
        batch_size: samples per batch per rank (the DataLoader's batch size: one micro-batch).
        seed: seeds the batch composition and every domain's shuffle.
        global_batch_size: samples per global batch, all ranks and micro-batches together (default
            ``batch_size * world_size``); a multiple of ``batch_size * world_size``. The stream of global
            batches depends on it, not on the topology: keep it fixed to resume on another world size.
        config: the mixer's settings, a :class:`~grape_stream.config.MixerConfig` (a recipe's ``data.mixer``);
            default: its defaults. docs/mixer.md explains each: ``shuffle``, ``composition`` (see
            :mod:`grape_stream.mixing.quotas`), ``shuffle_block_size``, ``lag`` (global batches between a
            ``set_weights`` call and the first batch it changes; default: the loader's prefetch depth; set it
            to make the switch points independent of the loader's settings and of the topology),
            ``schedule_capacity``, ``overwrite_local``, ``s3_dummy_credentials``, ``prefetch``,
            ``retry_deadline`` (seconds a failing shard download is retried before one error naming the
            domain, shard, remote, endpoint and cause; per domain: ``DomainStream(retry_deadline=...)``), and
            the StreamingDataset arguments ``cache_limit`` (split evenly across the domains unless a
            DomainStream sets its own), ``predownload`` (default ``8 * batch_size``), ``download_retry``,
            ``download_timeout``, ``validate_hash``, ``keep_zip``, ``allow_unsafe_types``.
        **options: keyword overrides of ``config``'s fields (``lag=0``, ``cache_limit="10gb"``); a misspelt
            name is one error naming the closest field.
    """

    def __init__(
        self,
        domains: Sequence[DomainStream | Mapping[str, Any] | Any] | None = None,
        weights: Sequence[float] | np.ndarray | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        *,
        global_batch_size: int | None = None,
        config: MixerConfig | Mapping[str, Any] | None = None,
        streams: Sequence[Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        check_streaming_kwargs(options)
        self.config = c = with_overrides(config, MixerConfig, options, where="WeightedStreamingMixer")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if c.composition not in COMPOSITIONS:
            raise ValueError(f"composition must be one of {COMPOSITIONS}, got {c.composition!r}")
        if c.lag is not None and (not isinstance(c.lag, (int, np.integer)) or c.lag < 0):
            raise ValueError(f"lag must be a non-negative integer or None, got {c.lag!r}")
        self.domains, weights = as_domains(domains, weights, streams)
        self.domain_names = [d.name for d in self.domains]
        self.K = len(self.domains)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(c.shuffle)
        self.composition = str(c.composition)  # a plain word: it goes into the state (weights_only loads)
        self.shuffle_block_size = int(c.shuffle_block_size)
        world = streaming_world()
        self.rank, self.world_size, self.local_rank = world.rank, world.size, world.local_rank
        self.nodes = world.nodes
        lanes = world.nodes if c.canonical_nodes is None else c.canonical_nodes
        self.topology = Topology.of(world.rank, world.size, self.batch_size, global_batch_size, lanes=lanes,
                                    nodes=world.nodes)
        alpha0 = np.full(self.K, 1.0 / self.K) if weights is None else validate_weights(weights, self.K)
        locals_, stream_dirs = domain_dirs(self.domains)
        self._locals = locals_

        opts = {k: getattr(c, k) for k in PASSTHROUGH}
        self.predownload = int(opts.pop("predownload") or 8 * self.batch_size)
        total_cache = opts.pop("cache_limit")
        if isinstance(total_cache, str):
            total_cache = bytes_to_int(total_cache)
        prepare_locals(self.domains, locals_, stream_dirs, local_rank=self.local_rank, config=c)
        self._owner_pid = os.getpid()
        self._datasets: list[Any] = open_datasets(
            self.domains, locals_, batch_size=self.batch_size, predownload=self.predownload,
            total_cache=total_cache, opts=opts, local_rank=self.local_rank)
        self._finalizer: Any = weakref.finalize(self, release_all, list(self._datasets), self._owner_pid)

        # -- the plan ---------------------------------------------------------------------------------
        self._orders = [
            DomainOrder(ds.samples_per_shard, name_seed(self.seed, d.name), self.shuffle, self.shuffle_block_size)
            for d, ds in zip(self.domains, self._datasets)
        ]
        self.max_epochs = [d.max_epochs for d in self.domains]
        self._composer = BatchComposer(
            seed=self.seed, topology=self.topology, composition=self.composition,
            domain_names=self.domain_names, orders=self._orders,
            budgets=[budget_for(d.max_epochs, o.num_samples) for d, o in zip(self.domains, self._orders)],
            datasets=self._datasets, predownload=self.predownload,
            needs_prefetch=[bool(c.prefetch) and (d.remote is not None or any(s.compression for s in ds.shards))
                            for d, ds in zip(self.domains, self._datasets)],
            retry=[default_policy().with_deadline(d.own_or("retry_deadline", c.retry_deadline)) for d in self.domains],
        )
        self._alpha0 = alpha0
        self._set_lanes(self.topology.lanes)
        self._main_readers: list[DomainReader] | None = None
        self._closed = False
        self._prefetchers: weakref.WeakSet[Prefetcher] = weakref.WeakSet()

    def _set_lanes(self, lanes: int) -> None:
        """Plan the stream of ``lanes`` canonical nodes (``topology.lanes``): at construction, or a resume
        that adopts its checkpoint's count (before iterating, as ``load_state_dict`` must be)."""
        t = self.topology
        self.topology = Topology.of(t.rank, t.world_size, t.batch_size, t.global_batch_size, lanes=lanes,
                                    nodes=self.nodes)
        for o, name in zip(self._orders, self.domain_names):
            o.set_lanes(lanes, name)
        self._composer.topology = self.topology
        self._schedule = WeightSchedule(self.K, self._alpha0, self.config.schedule_capacity, self.config.lag,
                                        self.topology.micro, lanes)
        self._position = StreamPosition(self._composer, self._schedule, self._fingerprint())

    def __getstate__(self) -> dict[str, Any]:
        """For spawned DataLoader workers: drop the objects that belong to this process."""
        state = self.__dict__.copy()
        state.update(_main_readers=None, _finalizer=None, _prefetchers=None)
        return state

    # ================================================================================================
    # weights (the rule lives in grape_stream.mixing.schedule)
    # ================================================================================================
    @property
    def weights(self) -> np.ndarray:
        """The latest weights given (they apply from :attr:`weights_from_batch` on)."""
        return self._schedule.latest[2].copy()

    @property
    def weights_version(self) -> int:
        """Version of the latest weights (0 = the initial weights, +1 per ``set_weights``)."""
        return self._schedule.latest[0]

    @property
    def weights_from_batch(self) -> int:
        return self._schedule.latest[1]

    @property
    def weight_history(self) -> list[dict[str, Any]]:
        """Every schedule entry: ``{"version", "from_batch", "alpha"}``."""
        return self._schedule.entries()

    def weights_at(self, batch: int) -> tuple[int, np.ndarray]:
        """(version, weights) that compose batch ``batch`` according to the schedule so far."""
        return self._schedule.at(batch)

    @property
    def lag(self) -> int:
        """Batches between ``set_weights`` and the first batch it changes (see class docstring)."""
        return self._schedule.lag

    @property
    def fixed_lag(self) -> int | None:
        """The ``lag`` given to the constructor (None: it follows the loader's prefetch depth)."""
        return self._schedule.fixed_lag

    def set_weights(self, alpha: Sequence[float] | np.ndarray | torch.Tensor, at_batch: int | None = None, *,
                    consumed: int | None = None) -> int:
        """Schedule new weights; return the index of the first batch they compose.

        Batches that a worker may already have composed are never changed: the effective batch is
        ``max(at_batch, consumed + lag)``, where ``consumed`` (batches the trainer has taken from the
        loader) is tracked by :meth:`dataloader` (and by iteration without workers), or passed here.
        ``at_batch=None`` means "as soon as possible": ``consumed + lag``. With a plain DataLoader with
        workers and neither ``at_batch`` nor ``consumed``, the mixer can only go by what the workers
        have composed so far, which depends on their timing (a warning says so). The switch is recorded
        in the schedule (``weight_history``, ``state_dict``) and in every sample's ``weights_version``.
        """
        if self._closed:
            raise RuntimeError("the mixer is closed")
        return self._schedule.schedule(alpha, at_batch, consumed)

    # ================================================================================================
    # iteration, and the loader protocol (grape_stream.mixing.loader.BatchSource)
    # ================================================================================================
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._iter(batched=False)

    def iter_batches(self, packed: bool = False, per_message: int = 1) -> Iterator[Any]:
        """Whole collated batches; ``packed``: as ``PackedBatch`` arrays (what a MixerDataLoader worker sends),
        in a worker ``per_message`` consecutive batches to one."""
        return self._iter(batched="packed" if packed else True, per_message=per_message)

    def _iter(self, batched: bool | str, per_message: int = 1) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("the mixer is closed")
        info = dataloader_worker()  # the main process (slot 0: it moves the cursor) or a worker
        if info is None:
            main = MainProcess(is_closed=lambda: self._closed, prefetchers=self._prefetchers)
            return self._composer.batches(self._schedule, slot=0, num_workers=1, worker=0, batched=batched,
                                          main=main)
        worker, num_workers = info
        if worker + 1 >= MAX_SLOTS:
            raise RuntimeError(f"the mixer supports at most {MAX_SLOTS - 1} DataLoader workers per rank")
        return self._composer.batches(self._schedule, slot=worker + 1, num_workers=num_workers,
                                      worker=worker, batched=batched, main=None, per_message=per_message)

    def begin_tracked_iteration(self, depth: int) -> None:
        """A counting loader starts: up to ``depth`` batches may be in flight from now on."""
        self._schedule.loader_depth = depth
        self._schedule.tracked = True
        self.seek(self._schedule.consumed)
        self._schedule.iterating = True

    def note_consumed(self, batches: int) -> None:
        """The trainer has taken ``batches`` batches in all (the count never goes down)."""
        self._schedule.note_consumed(batches)

    def dataloader(self, num_workers: int = 0, **kwargs: Any) -> MixerDataLoader:
        """A DataLoader over this mixer that tracks consumed batches (see :class:`MixerDataLoader`).

        With workers, the ``pymp-*`` temp folders that earlier SIGKILLed runs left are swept first
        (grape_stream.stale_temp: only folders no live process uses)."""
        if num_workers > 0:
            sweep_stale_multiprocessing_dirs()
        return MixerDataLoader(self, num_workers=num_workers, **kwargs)

    def seek(self, batch: int) -> None:
        """Make the next iteration start at loader batch ``batch`` (all earlier batches count as consumed)."""
        if int(batch) != batch or batch < 0:
            raise ValueError(f"batch must be a non-negative integer, got {batch!r}")
        self._schedule.seek(int(batch), self._position.counts_at(self.topology.global_batch(int(batch))))

    # ================================================================================================
    # position, stats, Composer's dataset-state protocol
    # ================================================================================================
    @property
    def consumed_batches(self) -> int:
        """Loader batches this rank's trainer has taken (as far as the mixer can know; see :meth:`set_weights`)."""
        return self._schedule.consumed

    @property
    def global_batch_size(self) -> int:
        """Samples per global batch (all ranks and micro-batches): what the stream is made of."""
        return self.topology.global_batch_size

    def stats(self) -> dict[str, Any]:
        """The stream's position after this rank's consumed batches: per-domain samples drawn (all ranks
        together), epochs, budgets, weights."""
        n = self._schedule.consumed
        g = self.topology.global_batch(n)
        p = self._position.planner_at(g)
        counts = p.counts.copy()
        version, alpha = self._schedule.effective.at(g)
        avail = counts < p.budgets
        eff = effective_weights(alpha, avail) if avail.any() else np.zeros(self.K)
        return {
            "batches": n, "global_batches": g, "samples": n * self.batch_size, "rank": self.rank,
            "world_size": self.world_size, "global_batch_size": self.global_batch_size, "weights_version": version,
            "latest_weights_version": self.weights_version, "exhausted_at": p.exhausted_at,
            "domains": domain_stats(self.domains, self._orders, counts, avail, alpha, eff),
        }

    def _fingerprint(self) -> dict[str, Any]:
        """What a checkpoint's position assumes about the stream (a resumed mixer must match it)."""
        return {
            "seed": self.seed, "composition": self.composition, "shuffle": self.shuffle,
            "shuffle_block_size": self.shuffle_block_size, "domains": list(self.domain_names),
            "domain_sizes": [int(o.num_samples) for o in self._orders], "max_epochs": list(self.max_epochs),
        }

    def state_dict(self, num_samples: int | None = None, from_beginning: bool = True) -> dict[str, Any]:
        """The data position as plain Python types (topology-independent: save it from rank 0).

        ``num_samples`` counts samples over all ranks, as Composer and streaming do: since the start of
        the stream (``from_beginning=True``, what Composer passes) or since this run resumed
        (``from_beginning=False``); a whole number of global batches. None uses the batches the mixer
        knows were consumed.
        """
        return self._position.state(num_samples, from_beginning)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: restore the weight schedule and start the next iteration at the saved global batch.

        Call before iterating (Composer does). Any world size, worker count and micro-batch split: the
        global batches from here on are exactly those of an uninterrupted run (given the same later
        ``set_weights`` switch batches). A different ``global_batch_size`` continues every domain exactly
        where it stopped, in batches of the new size; its ``canonical_nodes`` is adopted unless set. Refused
        with one line: a checkpoint of another stream (seed, domains, sizes, budgets, canonical nodes, ...)
        or of format ``/1`` (:class:`MixerStateError`), a node count incompatible with its canonical one.
        """
        lanes = state_lanes(state)
        if lanes not in (None, self.topology.lanes) and self.config.canonical_nodes is None:
            self._set_lanes(lanes)  # the stream continues on its canonical node count (checked against ours)
        batch = self._position.load(state)
        self.seek(batch * self.topology.micro)

    # ================================================================================================
    # probes
    # ================================================================================================
    def probe(self, domain_index: int, n: int, key: Any, *, rank: int | None = None,
              world_size: int | None = None) -> list[dict[str, Any]]:
        """``n`` samples of one domain by random access, a pure function of ``(seed, key, domain)``.

        Independent of the training stream's position; the same on every rank unless ``rank`` and
        ``world_size`` are given, in which case the ranks get disjoint samples. Each sample is a dict with
        the dataset's columns as numpy arrays (``tokens``), ``domain`` and ``sample_index``.
        """
        ids = probe_ids(domain_index, n, key, seed=self.seed, domain_names=self.domain_names,
                        domain_sizes=[o.num_samples for o in self._orders], rank=rank, world_size=world_size)
        if self._main_readers is None:
            self._main_readers = self._composer.readers()
        return probe_samples(self._main_readers[int(domain_index)], ids, int(domain_index))

    # ================================================================================================
    # lifecycle
    # ================================================================================================
    def close(self) -> None:
        """Release streaming's shared memory and file locks now (after the loaders are done)."""
        if self._closed or os.getpid() != self._owner_pid:
            return
        self._closed = True
        for p in list(self._prefetchers):
            p.stop()  # no background download may touch the datasets once released
        if self._main_readers is not None:
            for r in self._main_readers:
                r.close()
            self._main_readers = None
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "WeightedStreamingMixer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def shm_prefixes(self) -> list[int]:
        """Streaming's shared-memory prefixes of the domains (for leak checks)."""
        return [shm_prefix(ds) for ds in self._datasets]

    def __repr__(self) -> str:
        return (f"WeightedStreamingMixer(domains={self.domain_names}, batch_size={self.batch_size}, seed={self.seed}, "
                f"rank={self.rank}/{self.world_size}, weights_version={self.weights_version})")

