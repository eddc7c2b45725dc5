"""WeightedStreamingMixer: K streaming domains mixed by weights that change while the loader runs.

One mosaicml-streaming ``StreamingDataset`` per domain provides the index, downloads, decompression,
the node-wide shard cache with ``cache_limit`` eviction and the shared-memory coordination. The mixer
replaces streaming's *iteration*: it reads each domain by random access in an order it plans itself,
because streaming's ``__iter__`` fixes per-worker partitions and per-epoch proportions up front and
starts every epoch with a barrier across all workers of the node, while a mixture with live weights
needs per-batch quotas and independent epochs per domain. The plan is a pure function of
``(seed, batch index, rank, weight schedule)``:

* batch ``i`` of rank ``r`` takes ``quota[k]`` samples of domain ``k`` (:mod:`grape_stream.mixing.quotas`),
* read at the next positions of the rank's endless stream of that domain
  (:mod:`grape_stream.mixing.epoch_order`: shard-aware shuffled epochs, disjoint across ranks),
* with the weights of the schedule entry in force at batch ``i`` (:mod:`grape_stream.mixing.weight_table`),

so DataLoader workers compose their batches independently (worker ``w`` composes batches
``w, w + W, ...``, exactly the ones torch's DataLoader asks it for), the samples do not depend on the
number of workers, and the whole data position is ``(batches consumed, weight schedule)``: a resumed
run recomputes every domain's read position and replays exactly. See docs/mixer.md.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from grape_stream.mixing.epoch_order import DEFAULT_BLOCK_SIZE, DomainOrder
from grape_stream.mixing.quotas import (
    COMPOSITIONS,
    TAG_PROBE,
    BatchPlan,
    EffectiveSchedule,
    QuotaPlanner,
    budget_for,
    hash64,
    slot_permutation,
)
from grape_stream.mixing.loader import MixerDataLoader, _convert, collate_samples
from grape_stream.mixing.shard_reader import DomainReader, DomainReadError, Prefetcher
from grape_stream.streaming_compat.shm import (
    cleanup_stale_streaming_shm,
    describe_local_users,
    detach_scanner_attachments,
    record_owner,
    registration_lock,
    release_streaming_dataset,
)
from grape_stream.streaming_compat.local_index import (
    DomainUnavailableError,
    RemoteMismatchError,
    check_s3_credentials,
    check_same_locals_across_ranks,
    default_local_for,
    sync_local_index,
)
from grape_stream.mixing.weight_table import MAX_SLOTS, ScheduleOverflow, SharedWeightTable

try:  # the simplex helpers are shared with the reweighters
    from grape_stream.simplex import check_simplex as _check_simplex
except ImportError:  # pragma: no cover - simplex.py ships with the package
    _check_simplex = None

logger = logging.getLogger(__name__)

__all__ = [
    "DomainStream",
    "WeightedStreamingMixer",
    "MixerDataLoader",
    "collate_samples",
    "DomainUnavailableError",
    "DomainReadError",
    "RemoteMismatchError",
    "STATE_FORMAT",
]

STATE_FORMAT = "grape_stream.mixing.mixer/1"

#: Keys the mixer adds to every sample; a dataset column with one of these names is refused.
RESERVED_KEYS = ("domain", "weights_version", "batch_index", "sample_index", "epoch")

#: Streaming arguments passed through to every domain's StreamingDataset.
PASSTHROUGH = ("cache_limit", "predownload", "download_retry", "download_timeout", "validate_hash", "keep_zip",
               "allow_unsafe_types")
#: Streaming arguments that configure the iteration the mixer replaces.
PLANNED_BY_MIXER = {
    "shuffle_algo": "the mixer shuffles each domain with its own shard-aware block shuffle",
    "shuffle_seed": "pass seed=...",
    "num_canonical_nodes": "each rank reads a contiguous slice of every epoch",
    "partition_algo": "each rank reads a contiguous slice of every epoch",
    "batching_method": "batch composition comes from the weights (composition=...)",
    "sampling_method": "per-domain epochs are planned by the mixer (see max_epochs)",
    "sampling_granularity": "per-domain epochs are planned by the mixer",
    "epoch_size": "the mixer's stream is endless; set max_epochs per domain for a data budget",
    "replication": "not supported by the mixer",
    "batch_size": "pass batch_size to the mixer",
    "streams": "pass domains=[DomainStream(...)]",
    "remote": "set remote per DomainStream",
    "local": "set local per DomainStream",
    "split": "set split per DomainStream",
}


@dataclass
class DomainStream:
    """One source domain: an MDS dataset in a local directory or at a remote URL.

    Args:
        name: the domain's name (unique; also seeds its shuffle, so adding a domain does not reshuffle
            the others).
        remote: ``s3://...`` (or any remote streaming supports), or None for local data.
        local: local directory (the data itself when ``remote`` is None, else the cache). Defaults to a
            per-remote directory under the temp dir. Must be the same on all ranks of a node.
        split: sub-directory of ``remote``/``local`` (``OUT/<domain>/<split>`` layout of the converter).
        max_epochs: data budget: at most this many passes (may be fractional) over the domain; once
            spent the domain's weight goes to the others (with a warning). None = unlimited.
        cache_limit: this domain's shard-cache limit (bytes or "10gb"); default: the mixer's
            ``cache_limit`` divided evenly among the domains.
    """

    name: str
    remote: str | None = None
    local: str | None = None
    split: str | None = None
    max_epochs: float | None = None
    cache_limit: int | str | None = None

    def resolved_local(self) -> str:
        if self.local:
            return os.path.abspath(os.fspath(self.local))
        if self.remote:
            return default_local_for(self.remote, self.split)
        raise ValueError(f"domain {self.name!r} needs local=... (the data directory) or remote=...")


def _as_domain(d: DomainStream | Mapping[str, Any] | str) -> DomainStream:
    if isinstance(d, DomainStream):
        return d
    if isinstance(d, Mapping):
        return DomainStream(**d)
    raise TypeError(f"domains must be DomainStream objects or dicts, got {type(d).__name__}")


def _validate_weights(weights: Any, k: int) -> np.ndarray:
    if _check_simplex is not None:
        return _check_simplex(weights, name="weights", size=k)
    arr = np.asarray(weights, dtype=np.float64)  # pragma: no cover - fallback without simplex.py
    if arr.shape != (k,) or not np.all(np.isfinite(arr)) or (arr < 0).any() or arr.sum() <= 0:
        raise ValueError(f"weights must be {k} finite non-negative numbers, not all zero: {weights!r}")
    return arr / arr.sum()


def _key_to_int(key: Any) -> int:
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key) & 0xFFFFFFFFFFFFFFFF
    digest = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _name_seed(seed: int, name: str) -> int:
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return int(hash64(seed, np.uint64(h))[0])


def _world() -> tuple[int, int, int]:
    """(rank, world size, local rank), checking that torch.distributed and the env agree.

    Streaming reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE from the environment (torchrun sets
    them); a process group initialised without them would make every rank a "local leader".
    """
    env_rank = int(os.environ.get("RANK", 0))
    env_world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        if (rank, world) != (env_rank, env_world):
            raise RuntimeError(
                f"torch.distributed says rank {rank} of {world} but the environment says RANK={env_rank} "
                f"WORLD_SIZE={env_world}; streaming reads the environment: set RANK, WORLD_SIZE, LOCAL_RANK "
                "and LOCAL_WORLD_SIZE (torchrun does)"
            )
        return rank, world, local_rank
    return env_rank, env_world, local_rank


def _release_all(datasets: list[Any], owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return
    for ds in datasets:
        try:
            release_streaming_dataset(ds)
        except Exception as exc:  # pragma: no cover - best effort at exit
            logger.debug("releasing a StreamingDataset failed: %s", exc)


class WeightedStreamingMixer(IterableDataset):
    """Mix K streaming domains by weights that may change at any batch, deterministically and resumably.

    Use with ``mixer.dataloader(num_workers=W)`` (recommended: it tracks the batches consumed, so that
    ``set_weights`` takes effect at a deterministic batch) or with
    ``torch.utils.data.DataLoader(mixer, batch_size=batch_size, num_workers=W)``. The DataLoader's batch
    size must equal ``batch_size``. Every sample is a dict with the dataset's columns (``tokens`` as an
    int64 tensor) plus ``domain`` (index), ``weights_version`` (the schedule entry that composed its
    batch), ``batch_index``, ``sample_index`` (id within the domain) and ``epoch`` (of the domain).

    Args:
        domains: the K domains.
        weights: initial mixture (K non-negative numbers summing to 1); default uniform.
        batch_size: samples per batch per rank (the DataLoader's batch size).
        seed: seeds the batch composition and every domain's shuffle.
        shuffle: shuffle each domain's epochs (shard-aware block shuffle); False reads in index order.
        composition: ``"systematic"`` (exact quotas, default) or ``"multinomial"``; see
            :mod:`grape_stream.mixing.quotas`.
        shuffle_block_size: samples per shuffle block (like streaming's ``shuffle_block_size``): larger
            mixes better, smaller touches fewer shards at a time (cache-friendly).
        lag: batches between a ``set_weights`` call and the first batch it changes. Default: the loader's
            prefetch depth (``num_workers * prefetch_factor`` with :meth:`dataloader`, 0 without
            workers). Set it explicitly to make the switch points independent of ``num_workers``.
        schedule_capacity: weight changes that may be pending in shared memory at once.
        overwrite_local: replace a local cache directory that holds another remote's data.
        s3_dummy_credentials: for an S3 endpoint that needs no authentication, set placeholder AWS
            credentials when none are configured (streaming's client always signs requests).
        prefetch: download upcoming shards in a background thread (per process).
        **streaming_kwargs: passed to every StreamingDataset: ``cache_limit`` (split evenly across the
            domains unless a DomainStream sets its own), ``predownload`` (samples ahead, default
            ``8 * batch_size``), ``download_retry``, ``download_timeout``, ``validate_hash``,
            ``keep_zip``, ``allow_unsafe_types``.
    """

    def __init__(
        self,
        domains: Sequence[DomainStream | Mapping[str, Any]],
        weights: Sequence[float] | np.ndarray | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        *,
        composition: str = "systematic",
        shuffle_block_size: int = DEFAULT_BLOCK_SIZE,
        lag: int | None = None,
        schedule_capacity: int = 1024,
        overwrite_local: bool = False,
        s3_dummy_credentials: bool = False,
        prefetch: bool = True,
        **streaming_kwargs: Any,
    ) -> None:
        super().__init__()
        for key in streaming_kwargs:
            if key in PLANNED_BY_MIXER:
                raise TypeError(f"WeightedStreamingMixer does not take streaming's {key!r}: {PLANNED_BY_MIXER[key]}")
            if key not in PASSTHROUGH:
                raise TypeError(
                    f"WeightedStreamingMixer got an unexpected keyword argument {key!r} "
                    f"(streaming arguments passed through: {', '.join(PASSTHROUGH)})"
                )
        if batch_size is None or isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if composition not in COMPOSITIONS:
            raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
        if lag is not None and (not isinstance(lag, (int, np.integer)) or lag < 0):
            raise ValueError(f"lag must be a non-negative integer or None, got {lag!r}")
        self.domains = [_as_domain(d) for d in domains]
        if not self.domains:
            raise ValueError("the mixer needs at least one domain")
        names = [d.name for d in self.domains]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"domain names must be unique; repeated: {dup}")
        self.domain_names = names
        self.K = len(self.domains)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.composition = composition
        self.shuffle_block_size = int(shuffle_block_size)
        self._lag = None if lag is None else int(lag)
        self._prefetch = bool(prefetch)
        self.rank, self.world_size, self.local_rank = _world()
        alpha0 = np.full(self.K, 1.0 / self.K) if weights is None else _validate_weights(weights, self.K)

        locals_ = [d.resolved_local() for d in self.domains]
        stream_dirs = [os.path.join(loc, d.split) if d.split else loc for loc, d in zip(locals_, self.domains)]
        seen: dict[str, str] = {}
        for d, sd in zip(self.domains, stream_dirs):
            if sd in seen:
                raise ValueError(
                    f"domains {seen[sd]!r} and {d.name!r} use the same local directory {sd}; each domain needs "
                    "its own (streaming keeps one cache per directory)"
                )
            seen[sd] = d.name
        self._locals = locals_

        opts = {k: streaming_kwargs[k] for k in PASSTHROUGH if k in streaming_kwargs}
        self.predownload = int(opts.pop("predownload", None) or 8 * self.batch_size)
        total_cache = opts.pop("cache_limit", None)
        if isinstance(total_cache, str):
            from streaming.base.util import bytes_to_int

            total_cache = bytes_to_int(total_cache)
        self._download_retry = int(opts.get("download_retry", 2))
        self._download_timeout = float(opts.get("download_timeout", 60.0))

        # -- traps handled before streaming sees anything -------------------------------------------
        cleanup_stale_streaming_shm()
        check_s3_credentials([(d.name, d.remote) for d in self.domains], dummy_credentials=s3_dummy_credentials)
        check_same_locals_across_ranks(stream_dirs)
        self._sync_local_indexes(locals_, overwrite_local)

        # -- one StreamingDataset per domain ----------------------------------------------------------
        from streaming import StreamingDataset

        self._datasets: list[Any] = []
        self._owner_pid = os.getpid()
        try:
            with registration_lock(enabled=self.local_rank == 0):
                for d, loc in zip(self.domains, locals_):
                    limit = d.cache_limit if d.cache_limit is not None else (
                        None if total_cache is None else int(total_cache) // self.K)
                    try:
                        ds = StreamingDataset(
                            remote=d.remote, local=loc, split=d.split, batch_size=self.batch_size, shuffle=False,
                            predownload=self.predownload, cache_limit=limit, **opts,
                        )
                    except Exception as exc:
                        where = d.remote or loc
                        if "Reused local directory" in str(exc):
                            raise DomainUnavailableError(
                                f"domain {d.name!r}: local directory {loc} is registered by another "
                                f"StreamingDataset ({describe_local_users(loc)}); close the other mixer "
                                "(mixer.close()) or give this one its own local directory"
                            ) from exc
                        raise DomainUnavailableError(f"domain {d.name!r} ({where}): {type(exc).__name__}: {exc}") from exc
                    self._datasets.append(ds)
                    record_owner(ds)
                    self._check_columns(d.name, ds)
        except BaseException:
            _release_all(self._datasets, self._owner_pid)
            raise
        self._finalizer = weakref.finalize(self, _release_all, list(self._datasets), self._owner_pid)
        try:  # streaming's prefix scan left other jobs' segments mapped here; do not keep them alive
            detach_scanner_attachments()
        except Exception as exc:  # pragma: no cover - hygiene only
            logger.debug("detaching scanned segments failed: %s", exc)

        # -- the plan ---------------------------------------------------------------------------------
        self._orders = [
            DomainOrder(ds.samples_per_shard, _name_seed(self.seed, d.name), self.shuffle, self.shuffle_block_size,
                        self.rank, self.world_size)
            for d, ds in zip(self.domains, self._datasets)
        ]
        self.max_epochs = [d.max_epochs for d in self.domains]
        self._budgets = [budget_for(d.max_epochs, o.epoch_len) for d, o in zip(self.domains, self._orders)]
        self._needs_prefetch = [self._prefetch and (d.remote is not None or any(s.compression for s in ds.shards))
                                for d, ds in zip(self.domains, self._datasets)]

        self._history: list[tuple[int, int, np.ndarray]] = []  # (version, from_batch, alpha); version == index
        self._sched = EffectiveSchedule()
        self._table = SharedWeightTable(self.K, schedule_capacity)
        self._consumed = 0
        self._resume_batch = 0
        self._loader_depth: int | None = None
        self._tracked = False
        self._iterating = False
        self._warned: set[str] = set()
        self._main_planner: QuotaPlanner | None = None
        self._main_readers: list[DomainReader] | None = None
        self._closed = False
        self._prefetchers: weakref.WeakSet[Prefetcher] = weakref.WeakSet()
        self._append(0, alpha0)
        self._table.set_cursor(0, np.zeros(self.K, np.int64))

    # ================================================================================================
    # construction helpers
    # ================================================================================================
    def _sync_local_indexes(self, locals_: list[str], overwrite_local: bool) -> None:
        """Local leader checks every domain's index against its remote; all ranks learn of any error."""
        import torch.distributed as dist

        error: str | None = None
        exc_type: type[BaseException] = DomainUnavailableError
        if self.local_rank == 0:
            try:
                for d, loc in zip(self.domains, locals_):
                    sync_local_index(d.name, d.remote, loc, d.split, download_retry=self._download_retry,
                                     download_timeout=self._download_timeout, overwrite_local=overwrite_local)
            except (DomainUnavailableError, RemoteMismatchError) as exc:
                if not (dist.is_available() and dist.is_initialized()):
                    raise
                error, exc_type = str(exc), type(exc)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            errors: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, (error, exc_type.__name__))
            for err, name in errors:
                if err is not None:
                    cls = RemoteMismatchError if name == "RemoteMismatchError" else DomainUnavailableError
                    raise cls(err)
        elif error is not None:  # pragma: no cover - single process raises above
            raise exc_type(error)

    @staticmethod
    def _check_columns(name: str, ds: Any) -> None:
        cols = getattr(ds.shards[0], "column_names", None) or []
        clash = [c for c in cols if c in RESERVED_KEYS]
        if clash:
            raise ValueError(
                f"domain {name!r} has column(s) {clash}, which the mixer adds to every sample "
                f"(reserved: {RESERVED_KEYS}); rename them when converting"
            )

    # ================================================================================================
    # pickling for spawn workers: drop process-local objects
    # ================================================================================================
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_main_readers"] = None
        state["_main_planner"] = None
        state["_finalizer"] = None
        state["_prefetchers"] = None
        return state

    # ================================================================================================
    # weights
    # ================================================================================================
    @property
    def weights(self) -> np.ndarray:
        """The latest weights given (they apply from :attr:`weights_from_batch` on)."""
        return self._history[-1][2].copy()

    @property
    def weights_version(self) -> int:
        """Version of the latest weights (0 = the initial weights, +1 per ``set_weights``)."""
        return self._history[-1][0]

    @property
    def weights_from_batch(self) -> int:
        return self._history[-1][1]

    @property
    def weight_history(self) -> list[dict[str, Any]]:
        """Every schedule entry: ``{"version", "from_batch", "alpha"}``."""
        return [{"version": v, "from_batch": f, "alpha": a.tolist()} for v, f, a in self._history]

    def weights_at(self, batch: int) -> tuple[int, np.ndarray]:
        """(version, weights) that compose batch ``batch`` according to the schedule so far."""
        v, a = self._sched.at(batch)
        return v, a.copy()

    @property
    def lag(self) -> int:
        """Batches between ``set_weights`` and the first batch it changes (see class docstring)."""
        if self._lag is not None:
            return self._lag
        return self._loader_depth or 0

    def _append(self, from_batch: int, alpha: np.ndarray) -> int:
        version = len(self._history)
        self._history.append((version, int(from_batch), alpha.copy()))
        self._sched.add(version, int(from_batch), alpha)
        self._table.publish(version, version, int(from_batch), alpha)
        return version

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _consumed_known(self) -> bool:
        workers_active = self._table.max_claimed(workers_only=True) >= 0
        return self._tracked or not workers_active

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
        alpha = _validate_weights(alpha, self.K)
        if at_batch is not None and (isinstance(at_batch, bool) or int(at_batch) != at_batch or at_batch < 0):
            raise ValueError(f"at_batch must be a non-negative integer, got {at_batch!r}")
        if consumed is not None and (int(consumed) != consumed or consumed < 0):
            raise ValueError(f"consumed must be a non-negative integer, got {consumed!r}")
        known = consumed is not None or self._consumed_known()
        n_consumed = int(consumed) if consumed is not None else self._consumed
        if consumed is not None:
            self._consumed = max(self._consumed, n_consumed)
        # Before a loader has started there is nothing in flight: the next batch can still change. An
        # explicit lag always applies (switch points then depend only on the consumed count).
        in_flight = self._iterating or self._lag is not None or self._table.max_claimed(workers_only=True) >= 0
        floor = n_consumed + (self.lag if in_flight else 0) if known else None
        composed = self._table.max_claimed()
        if at_batch is None:
            if floor is None:
                self._warn_once(
                    "untracked",
                    "set_weights with a plain DataLoader with workers: the mixer cannot see how many batches "
                    "were consumed, so the switch batch depends on worker timing. Use mixer.dataloader(...) "
                    "or pass at_batch= / consumed= for a reproducible switch.",
                )
                target = composed + 1
            else:
                target = floor
        else:
            target = int(at_batch) if floor is None else max(int(at_batch), floor)
        if target <= composed:
            workers = max(1, int(np.count_nonzero(self._table._v["claimed"][1:] >= 0)))
            moved = composed + 1 + workers
            self._warn_once(
                "composed",
                f"set_weights: batch {target} was already composed (workers are at batch {composed}); the new "
                f"weights apply from batch {moved}. The loader prefetches deeper than lag={self.lag}: use "
                "mixer.dataloader(...), or pass lag= (>= num_workers * prefetch_factor) to the mixer.",
            )
            target = moved
        low = min(n_consumed, composed + 1) if composed >= 0 else n_consumed
        try:
            active_version = self._sched.at(max(0, low))[0]
        except KeyError:  # pragma: no cover - version 0 starts at batch 0
            active_version = 0
        if len(self._history) - active_version >= (3 * self._table.C) // 4:
            raise ScheduleOverflow(
                f"{len(self._history) - active_version} weight changes are pending beyond batch {low}; "
                f"raise schedule_capacity (now {self._table.C})"
            )
        self._append(target, alpha)
        return target

    # ================================================================================================
    # iteration
    # ================================================================================================
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._iter(batched=False)

    def _iter(self, batched: bool) -> Iterator[dict[str, Any]]:
        if self._closed:
            raise RuntimeError("the mixer is closed")
        info = get_worker_info()
        if info is None:
            return self._iterate(slot=0, num_workers=1, worker=0, batched=batched)
        if info.id + 1 >= MAX_SLOTS:
            raise RuntimeError(f"the mixer supports at most {MAX_SLOTS - 1} DataLoader workers per rank")
        return self._iterate(slot=info.id + 1, num_workers=info.num_workers, worker=info.id, batched=batched)

    def _iterate(self, slot: int, num_workers: int, worker: int, batched: bool = False) -> Iterator[dict[str, Any]]:
        table = self._table
        main = slot == 0
        start, counts, _ = table.read_anchor()
        prev = table.claim(slot, start - 1)
        if prev >= start and not main:
            warnings.warn(
                f"the mixer restarts at batch {start}, but worker {worker} had already composed up to batch "
                f"{prev}: a plain DataLoader was iterated again without moving the mixer's cursor. Use "
                "mixer.dataloader(...), or mixer.seek(batch) / load_state_dict before iterating again.",
                RuntimeWarning,
            )
        sched = EffectiveSchedule()
        next_seq = max(0, table.published - table.C + table.C // 4)
        next_seq = table.read_into(sched, next_seq)
        try:
            sched.at(start)
        except KeyError:
            raise ScheduleOverflow(
                f"the weights in force at batch {start} are no longer in the shared schedule; raise "
                "schedule_capacity"
            ) from None
        on_spent = None
        if worker == 0:
            from grape_stream.mixing.quotas import default_on_spent

            on_spent = default_on_spent(self.domain_names)
        planner = QuotaPlanner(seed=self.seed, rank=self.rank, batch_size=self.batch_size,
                               composition=self.composition, budgets=self._budgets, start_batch=start,
                               start_counts=counts, on_spent=on_spent)
        readers = [DomainReader(d.name, ds) for d, ds in zip(self.domains, self._datasets)]
        prefetcher = Prefetcher(readers) if any(self._needs_prefetch) else None
        if main and prefetcher is not None:
            self._prefetchers.add(prefetcher)
        horizon = np.zeros(self.K, np.int64)
        batch = start + worker
        try:
            while True:
                if main and self._closed:
                    raise RuntimeError("the mixer was closed while it was being iterated")
                next_seq = table.read_into(sched, next_seq)
                table.claim(slot, batch)
                plan = planner.plan(batch, sched.segments)
                if plan is None:
                    return
                cols = self._gather(plan, readers)
                if prefetcher is not None:
                    self._prefetch_ahead(plan, prefetcher, readers, horizon)
                sched.prune_before(batch)
                if batched:
                    out: Any = self._batch_tensors(cols)
                    if main:
                        self._consumed = max(self._consumed, batch + 1)
                        table.set_cursor(batch + 1, plan.start + plan.quota)
                    yield out
                else:
                    samples = self._samples(cols)
                    last = samples.pop()
                    yield from samples
                    if main:
                        # Without workers, the consumer holds batch `batch` once its last sample is taken:
                        # from then on it counts as consumed, and a new iteration starts after it.
                        self._consumed = max(self._consumed, batch + 1)
                        table.set_cursor(batch + 1, plan.start + plan.quota)
                    yield last
                batch += num_workers
        finally:
            if prefetcher is not None:
                prefetcher.stop()
            for r in readers:
                r.close()

    def _gather(self, plan: BatchPlan, readers: list[DomainReader]) -> dict[str, Any]:
        """The batch's columns in emission order: stacked arrays where possible, else lists."""
        parts: list[dict[str, Any]] = []
        meta: dict[str, list[np.ndarray]] = {"domain": [], "sample_index": [], "epoch": []}
        for k in np.flatnonzero(plan.quota):
            k = int(k)
            ids, epochs = self._orders[k].sample_ids(int(plan.start[k]), int(plan.quota[k]))
            cols = readers[k].read_batch(ids)
            if cols is None:
                rows = readers[k].read(ids)
                cols = {key: [r[key] for r in rows] for key in rows[0]}
            parts.append(cols)
            meta["domain"].append(np.full(len(ids), k, np.int64))
            meta["sample_index"].append(ids)
            meta["epoch"].append(epochs)
        keys = list(parts[0])
        for p, k in zip(parts[1:], np.flatnonzero(plan.quota)[1:]):
            if list(p) != keys:
                raise ValueError(
                    f"domain {self.domain_names[int(k)]!r} has columns {list(p)} but "
                    f"{self.domain_names[int(np.flatnonzero(plan.quota)[0])]!r} has {keys}: all domains must "
                    "have the same columns"
                )
        n = int(plan.quota.sum())
        perm = slot_permutation(self.seed, plan.batch, self.rank, n)
        out: dict[str, Any] = {}
        for key in keys:
            vals = [p[key] for p in parts]
            if all(isinstance(v, np.ndarray) for v in vals) and len({(v.dtype, v.shape[1:]) for v in vals}) == 1:
                out[key] = np.concatenate(vals)[perm]
            else:
                flat = [x for v in vals for x in (list(v) if isinstance(v, np.ndarray) else v)]
                out[key] = [flat[j] for j in perm]
        for key, arrs in meta.items():
            out[key] = np.concatenate(arrs)[perm]
        out["weights_version"] = np.full(n, plan.version, np.int64)
        out["batch_index"] = np.full(n, plan.batch, np.int64)
        return out

    @staticmethod
    def _batch_tensors(cols: dict[str, Any]) -> dict[str, Any]:
        """A collated batch (what ``collate_samples`` makes of the per-sample form)."""
        out: dict[str, Any] = {}
        for key, val in cols.items():
            if key in RESERVED_KEYS:
                continue
            if isinstance(val, np.ndarray):
                out[key] = _convert(val)
            else:
                out[key] = collate_samples([{key: v} for v in val])[key]
        # The per-sample metadata as rows of one tensor: one shared-memory block to pass between
        # processes instead of five.
        meta = torch.from_numpy(np.stack([cols[key] for key in RESERVED_KEYS]).astype(np.int64))
        for i, key in enumerate(RESERVED_KEYS):
            out[key] = meta[i]
        return out

    @staticmethod
    def _samples(cols: dict[str, Any]) -> list[dict[str, Any]]:
        n = len(cols["batch_index"])
        meta = {key: cols[key].tolist() for key in RESERVED_KEYS}
        data = {key: val for key, val in cols.items() if key not in RESERVED_KEYS}
        out = []
        for j in range(n):
            sample = {key: _convert(val[j]) for key, val in data.items()}
            for key in RESERVED_KEYS:
                sample[key] = meta[key][j]
            out.append(sample)
        return out

    def _prefetch_ahead(self, plan: BatchPlan, prefetcher: Prefetcher, readers: list[DomainReader],
                        horizon: np.ndarray) -> None:
        """Ask for the shards of each domain's next ``predownload * alpha_k`` samples.

        ``horizon[k]`` is how far domain k has been looked ahead already; the look-ahead is renewed
        (twice as far) only when the read position comes within half of it, so this costs little per batch.
        """
        for k in np.flatnonzero(plan.alpha > 0):
            k = int(k)
            if not self._needs_prefetch[k]:
                continue
            ahead = int(math.ceil(self.predownload * float(plan.alpha[k]))) + 1
            pos = int(plan.start[k] + plan.quota[k])
            if pos + ahead // 2 < horizon[k]:
                continue
            begin = max(pos, int(horizon[k]))
            ids, _ = self._orders[k].sample_ids(begin, pos + 2 * ahead - begin)
            horizon[k] = pos + 2 * ahead
            for sid in dict.fromkeys(readers[k].shard_ids(ids).tolist()):
                if readers[k].needs_prepare(sid):
                    prefetcher.request(k, sid)

    # ================================================================================================
    # loader helpers
    # ================================================================================================
    def dataloader(self, num_workers: int = 0, **kwargs: Any) -> "MixerDataLoader":
        """A DataLoader over this mixer that tracks consumed batches (see :class:`MixerDataLoader`)."""
        return MixerDataLoader(self, num_workers=num_workers, **kwargs)

    def seek(self, batch: int) -> None:
        """Make the next iteration start at batch ``batch`` (all earlier batches count as consumed)."""
        if int(batch) != batch or batch < 0:
            raise ValueError(f"batch must be a non-negative integer, got {batch!r}")
        counts = self._counts_at(int(batch))
        self._table.set_cursor(int(batch), counts)
        self._table.reset_claims(int(batch))
        self._consumed = int(batch)
        self._iterating = False

    def _begin_tracked_iteration(self, depth: int) -> None:
        self._loader_depth = depth
        self._tracked = True
        self.seek(self._consumed)
        self._iterating = True  # from now on up to `depth` batches may be in flight

    # ================================================================================================
    # position, stats
    # ================================================================================================
    @property
    def consumed_batches(self) -> int:
        """Batches the trainer has taken (as far as the mixer can know; see :meth:`set_weights`)."""
        return self._consumed

    def _counts_at(self, batch: int) -> np.ndarray:
        """This rank's read position in every domain before batch ``batch`` (recomputed from the plan)."""
        p = self._main_planner
        if p is None or p.batch > batch:
            p = QuotaPlanner(seed=self.seed, rank=self.rank, batch_size=self.batch_size, composition=self.composition,
                             budgets=self._budgets)
            self._main_planner = p
        p.advance_to(batch, self._sched.segments)
        return p.counts.copy()

    def stats(self) -> dict[str, Any]:
        """This rank's data position after the consumed batches: per-domain samples drawn, epochs, budgets."""
        n = self._consumed
        counts = self._counts_at(n)
        p = self._main_planner
        assert p is not None
        version, alpha = self._sched.at(n)
        avail = counts < p.budgets
        from grape_stream.mixing.quotas import effective_weights

        eff = effective_weights(alpha, avail) if avail.any() else np.zeros(self.K)
        doms = []
        for k, d in enumerate(self.domains):
            o = self._orders[k]
            doms.append({
                "name": d.name,
                "samples_drawn": int(counts[k]),
                "epochs_completed": int(counts[k] // o.epoch_len),
                "epoch_progress": float(counts[k] / o.epoch_len),
                "samples_per_epoch": int(o.epoch_len),
                "num_samples": int(o.num_samples),
                "max_epochs": d.max_epochs,
                "spent": bool(not avail[k]),
                "weight": float(alpha[k]),
                "effective_weight": float(eff[k]),
            })
        return {
            "batches": n,
            "samples": n * self.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
            "weights_version": version,
            "latest_weights_version": self.weights_version,
            "exhausted_at": p.exhausted_at,
            "domains": doms,
        }

    # ================================================================================================
    # Composer's dataset-state protocol
    # ================================================================================================
    def state_dict(self, num_samples: int | None = None, from_beginning: bool = True) -> dict[str, Any]:
        """The data position as plain Python types (rank-independent: save it from rank 0).

        ``num_samples`` counts samples over all ranks, as Composer and streaming do: since the start of
        the stream (``from_beginning=True``, what Composer passes) or since this run resumed
        (``from_beginning=False``). None uses the batches the mixer knows were consumed.
        """
        per = self.batch_size * self.world_size
        if num_samples is None:
            if not self._consumed_known():
                raise ValueError(
                    "state_dict(num_samples=None) with a plain DataLoader with workers: the mixer cannot know "
                    "how many batches were consumed; pass num_samples= (global samples) or use mixer.dataloader()"
                )
            batch = self._consumed
        else:
            if int(num_samples) != num_samples or num_samples < 0 or num_samples % per:
                raise ValueError(
                    f"num_samples={num_samples!r} is not a whole number of global batches of {per} samples "
                    f"(batch_size={self.batch_size} x world_size={self.world_size})"
                )
            batch = int(num_samples) // per + (0 if from_beginning else self._resume_batch)
        return {
            "format": STATE_FORMAT,
            "batch": batch,
            "num_samples": batch * per,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "composition": self.composition,
            "shuffle": self.shuffle,
            "shuffle_block_size": self.shuffle_block_size,
            "domains": list(self.domain_names),
            "domain_sizes": [int(o.num_samples) for o in self._orders],
            "max_epochs": list(self.max_epochs),
            "schedule": self.weight_history,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: restore the weight schedule and start the next iteration at the saved batch.

        Call before iterating (Composer does). Every domain's read position is recomputed from
        ``(seed, batch, schedule)``, so the samples from here on are exactly those of an uninterrupted run.
        """
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a WeightedStreamingMixer state (format {state.get('format')!r}, expected {STATE_FORMAT!r})")
        mine = {
            "seed": self.seed, "batch_size": self.batch_size, "world_size": self.world_size,
            "composition": self.composition, "shuffle": self.shuffle, "shuffle_block_size": self.shuffle_block_size,
            "domains": list(self.domain_names), "domain_sizes": [int(o.num_samples) for o in self._orders],
            "max_epochs": list(self.max_epochs),
        }
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            detail = "; ".join(f"{k}: checkpoint {a!r} vs this mixer {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"the checkpoint's data position does not fit this mixer ({detail})")
        schedule = state.get("schedule") or []
        if not schedule or [e["version"] for e in schedule] != list(range(len(schedule))):
            raise ValueError("the checkpoint's weight schedule is empty or its versions are not 0, 1, 2, ...")
        batch = int(state["batch"])
        self._history = []
        self._sched = EffectiveSchedule()
        self._table.reset()
        for e in schedule:
            alpha = _validate_weights(e["alpha"], self.K)
            version = len(self._history)
            self._history.append((version, int(e["from_batch"]), alpha))
            self._sched.add(version, int(e["from_batch"]), alpha)
        first = max(0, len(self._history) - (3 * self._table.C) // 4)
        if self._sched.at(batch)[0] < first:
            raise ScheduleOverflow(
                f"{len(self._history) - self._sched.at(batch)[0]} weight changes are pending after batch {batch}; "
                f"raise schedule_capacity (now {self._table.C})"
            )
        for v, f, a in self._history[first:]:
            self._table.publish(v, v, f, a)
        self._main_planner = None
        self.seek(batch)
        self._resume_batch = batch

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
        if isinstance(domain_index, bool) or not isinstance(domain_index, (int, np.integer)) \
                or not 0 <= domain_index < self.K:
            raise IndexError(f"domain_index must be in [0, {self.K}), got {domain_index!r}")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size (or neither)")
        ws = 1 if world_size is None else int(world_size)
        r = 0 if rank is None else int(rank)
        if not 0 <= r < ws:
            raise ValueError(f"rank {r} is not in [0, {ws})")
        k = int(domain_index)
        total_samples = self._orders[k].num_samples
        if n * ws > total_samples:
            raise ValueError(
                f"domain {self.domain_names[k]!r} has {total_samples} samples; cannot probe {n} x {ws} ranks "
                "without repeats"
            )
        kk = _key_to_int(key)
        s = self.seed & 0xFFFFFFFFFFFFFFFF
        rng = np.random.default_rng([s & 0xFFFFFFFF, s >> 32, kk & 0xFFFFFFFF, kk >> 32, k, TAG_PROBE])
        ids = rng.choice(total_samples, size=n * ws, replace=False)[r * n:(r + 1) * n]
        if self._main_readers is None:
            self._main_readers = [DomainReader(d.name, ds) for d, ds in zip(self.domains, self._datasets)]
        rows = self._main_readers[k].read(ids)
        out = []
        for row, sid in zip(rows, ids.tolist()):
            sample = {key_: (np.array(v) if isinstance(v, np.ndarray) else v) for key_, v in row.items()}
            sample["domain"] = k
            sample["sample_index"] = int(sid)
            out.append(sample)
        return out

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
        return [int(ds._shm_prefix_int) for ds in self._datasets]

    def __repr__(self) -> str:
        return (f"WeightedStreamingMixer(domains={self.domain_names}, batch_size={self.batch_size}, seed={self.seed}, "
                f"rank={self.rank}/{self.world_size}, weights_version={self.weights_version})")
