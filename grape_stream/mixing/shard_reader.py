"""Random access to one domain's samples through its StreamingDataset, fast for MDS.

Streaming's ``dataset[i]`` opens, seeks and closes the shard file for every sample. A batch of the mixer
reads many samples of a few shards at once, so this reader groups the requested ids by shard, makes
sure the shard is local through streaming's own ``prepare_shard`` (download, decompression, cache
accounting and LRU eviction stay streaming's), memory-maps the raw MDS file once and slices samples out
of it: a shard of fixed-length array samples (packed token sequences) is one strided array per column,
read with one numpy fancy index per shard and batch (:mod:`grape_stream.mixing.shard_view`). Shards of
other formats fall back to ``dataset.get_item``.

A mapped shard that streaming evicts (deletes) stays readable until it is unmapped (shards are
immutable), but the reader drops its mapping as soon as the shard is no longer LOCAL, so evicted files
do not keep disk space beyond ``cache_limit``. Under a ``cache_limit`` the shard's access time is refreshed
on every read, as ``get_item`` does, so eviction picks the coldest shard (without one streaming never
evicts and nobody reads the access times).

A background thread per process downloads upcoming shards ahead of use (``Prefetcher``).

Streaming's private per-shard bookkeeping (shard states, access times) is reached only through
:mod:`grape_stream.streaming_compat.shard_state`, which checks the streaming version.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from grape_stream.errors import StorageError
from grape_stream.mixing.shard_view import MappedShard, uniform_layout
from grape_stream.retry import DEFAULT_RETRY, CredentialsError, RetryError, RetryPolicy, endpoint_note, storage_call
from grape_stream.streaming_compat.patches import install_streaming_patches
from grape_stream.streaming_compat.s3_session import refresh_credentials, session_generation
from grape_stream.streaming_compat.shard_state import (
    is_mds_shard,
    prepare_shard,
    shard_is_local,
    shard_is_preparing,
    touch_shard,
)

__all__ = ["DomainReader", "Prefetcher", "DomainReadError"]


class DomainReadError(StorageError, RuntimeError):
    """A sample of a domain could not be read (download failed, shard missing, corrupt)."""


class _NotYet(Exception):
    """The shard is not readable yet for a reason a retry can fix (a download failed elsewhere, eviction)."""


def _not_yet(exc: BaseException) -> bool:
    return isinstance(exc, _NotYet)


class DomainReader:
    """Reads samples of one domain by id, a batch at a time."""

    def __init__(self, name: str, dataset: Any, max_mapped: int = 32, retry: RetryPolicy = DEFAULT_RETRY,
                 max_vanished: int = 8) -> None:
        self.name = name
        self.dataset = dataset
        self.max_mapped = max(1, int(max_mapped))
        self.retry = retry
        self.max_vanished = int(max_vanished)
        self._mapped: OrderedDict[int, MappedShard] = OrderedDict()
        self._is_mds = [is_mds_shard(s) for s in dataset.shards]
        self._stream = dataset.streams[0]
        self._layouts: dict[int, Any] = {}
        self._ready: set[int] = set()  # shard id -> its uniform layout (shard_view.Column tuple) or None
        install_streaming_patches()  # also in a spawned worker, which imports streaming afresh

    # ------------------------------------------------------------------------------------------------
    def _where(self) -> str:
        s = self._stream
        return s.remote if s.remote else os.path.join(s.local, s.split or "")

    def _raw_path(self, shard_id: int) -> str:
        shard = self.dataset.shards[shard_id]
        return os.path.join(shard.dirname, shard.split or "", shard.raw_data.basename)

    def _map(self, shard_id: int) -> MappedShard:
        ds = self.dataset
        m = self._mapped.get(shard_id)
        if m is not None:
            if ds.cache_limit and not shard_is_local(ds, shard_id):
                self._mapped.pop(shard_id).close()  # evicted: let its disk space go
            else:
                self._mapped.move_to_end(shard_id)
                return m
        m = self._fetch_and_map(shard_id)
        self._mapped[shard_id] = m
        while len(self._mapped) > self.max_mapped:
            self._mapped.popitem(last=False)[1].close()
        return m

    def _fetch_and_map(self, shard_id: int) -> MappedShard:
        """Map the shard, downloading it first if needed, under the domain's retry policy.

        A failed download is retried with backoff until the policy's deadline (an outage of a minute is
        ridden out with the same samples; throttling is said once); a missing object is not retried;
        refused credentials are read again once (rotated credentials) and then fail; a shard that
        another process's cache eviction keeps deleting fails after `max_vanished` tries (cache_limit too
        small). Every failure names the domain, the shard, the remote and the endpoint.
        """
        ds = self.dataset
        basename = ds.shards[shard_id].raw_data.basename
        vanished: list[str] = []

        def attempt() -> MappedShard:
            try:
                return MappedShard(self._raw_path(shard_id))
            except FileNotFoundError:
                pass
            prepare_shard(ds, shard_id)  # waits while another process of the node downloads it
            try:
                return MappedShard(self._raw_path(shard_id))
            except FileNotFoundError as exc:
                if shard_is_preparing(ds, shard_id) or not shard_is_local(ds, shard_id):
                    raise _NotYet(f"shard {basename} is not local yet") from exc  # another process's failed download
                vanished.append(str(exc))
                if len(vanished) >= self.max_vanished:
                    raise DomainReadError(
                        f"domain {self.name!r}: shard {basename} kept disappearing from "
                        f"{os.path.dirname(self._raw_path(shard_id))} ({vanished[-1]}); cache_limit may be "
                        "too small for the shards in use"
                    ) from exc
                raise _NotYet(f"shard {basename} was evicted before it could be read") from exc

        what = f"domain {self.name!r}: cannot fetch shard {basename} from {self._where()}{endpoint_note(self._where())}"
        downloader = getattr(self._stream, "_downloader", None)
        try:
            return storage_call(attempt, policy=self.retry, what=what, url=self._where(), retryable=_not_yet,
                                refresh=lambda: refresh_credentials(session_generation(downloader)))
        except DomainReadError:
            raise
        except (RetryError, CredentialsError) as err:
            raise DomainReadError(str(err)) from err
        except Exception as err:  # a permanent failure (missing object): one clear line
            raise DomainReadError(f"{what}: {type(err).__name__}: {err}") from err

    def read(self, sample_ids: np.ndarray) -> list[dict[str, Any]]:
        """Samples for ``sample_ids`` (in that order), as streaming decodes them."""
        ds = self.dataset
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        out: list[dict[str, Any] | None] = [None] * len(sample_ids)
        if not len(sample_ids):
            return []
        shard_ids = np.searchsorted(ds.sample_offset_per_shard, sample_ids, side="right") - 1
        for sid in np.unique(shard_ids):
            sid = int(sid)
            where = np.flatnonzero(shard_ids == sid)
            local = sample_ids[where] - int(ds.sample_offset_per_shard[sid])
            shard = ds.shards[sid]
            if not self._is_mds[sid]:
                for w, _idx in zip(where, local):
                    out[w] = self._get_item(int(sample_ids[w]))
                continue
            m = self._map(sid)
            touch_shard(ds, sid)
            begins = m.offsets[local]
            ends = m.offsets[local + 1]
            mm = m.mm
            for w, b, e in zip(where, begins, ends):
                out[w] = shard.decode_sample(mm[b:e])
        return out  # type: ignore[return-value]

    # -- fast path ------------------------------------------------------------------------------------
    def uniform(self, shard_id: int) -> MappedShard | None:
        """The shard mapped with its columns as strided views, or None when its samples do not allow it.

        Whether a shard qualifies is decided once per shard (shards are immutable) and remembered across
        re-mappings.
        """
        m = self._mapped.get(shard_id)
        if m is not None and m.columns is not None and not self.dataset.cache_limit:
            self._mapped.move_to_end(shard_id)  # the hot path: mapped, uniform, nothing can evict it
            return m
        if not self._is_mds[shard_id]:
            return None
        m = self._map(shard_id)
        if self.dataset.cache_limit:
            touch_shard(self.dataset, shard_id)  # only eviction reads access times
        if m.columns is None:
            if shard_id not in self._layouts:
                self._layouts[shard_id] = uniform_layout(self.dataset.shards[shard_id], m)
            layout = self._layouts[shard_id]
            if layout is None:
                return None
            m.set_uniform(layout)
        return m

    def read_batch(self, sample_ids: np.ndarray) -> dict[str, np.ndarray] | None:
        """Columns of ``sample_ids`` as stacked arrays ``(n, ...)``, sliced straight out of the mapped shards.

        One numpy fancy index per shard touched (see :mod:`grape_stream.mixing.shard_view`). None when the
        fast path does not apply (a non-array column, samples of unequal byte lengths, a non-MDS shard,
        shards whose columns differ); the caller then uses :meth:`read`.
        """
        ds = self.dataset
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        n = len(sample_ids)
        if n == 0:
            return None
        offsets = ds.sample_offset_per_shard
        shard_ids = np.searchsorted(offsets, sample_ids, side="right") - 1
        local = sample_ids - offsets[shard_ids]
        first = int(shard_ids[0])
        if (shard_ids == first).all():
            m = self.uniform(first)
            return None if m is None else m.take(local)
        order = np.argsort(shard_ids, kind="stable")
        sorted_ids = shard_ids[order]
        bounds = [0, *(np.flatnonzero(sorted_ids[1:] != sorted_ids[:-1]) + 1).tolist(), n]
        out: dict[str, np.ndarray] | None = None
        for a, b in zip(bounds[:-1], bounds[1:]):
            m = self.uniform(int(sorted_ids[a]))
            if m is None:
                return None
            where = order[a:b]
            part = m.take(local[where])
            assert part is not None
            if out is None:
                out = {k: np.empty((n, *v.shape[1:]), v.dtype) for k, v in part.items()}
            elif part.keys() != out.keys() or any(v.dtype != out[k].dtype or v.shape[1:] != out[k].shape[1:]
                                                  for k, v in part.items()):
                return None
            for k, v in part.items():
                out[k][where] = v
        return out

    def _get_item(self, sample_id: int) -> dict[str, Any]:
        try:
            return self.dataset.get_item(sample_id)
        except Exception as err:  # noqa: BLE001
            raise DomainReadError(
                f"domain {self.name!r}: cannot read sample {sample_id} from {self._where()}: {err}"
            ) from err

    def shard_ids(self, sample_ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.dataset.sample_offset_per_shard, np.asarray(sample_ids), side="right") - 1

    def needs_prepare(self, shard_id: int) -> bool:
        """Whether the shard must still be downloaded / decompressed (remembered once ready: without a
        ``cache_limit`` streaming never evicts, so a ready shard stays ready)."""
        if shard_id in self._ready:
            return False
        needed = not shard_is_local(self.dataset, shard_id) or not os.path.isfile(self._raw_path(shard_id))
        if not needed and not self.dataset.cache_limit:
            self._ready.add(shard_id)
        return needed

    @property
    def all_ready(self) -> bool:
        """Every shard of the domain is local and stays so (no ``cache_limit``): nothing left to prefetch."""
        return not self.dataset.cache_limit and len(self._ready) == len(self._is_mds)

    def close(self) -> None:
        while self._mapped:
            self._mapped.popitem()[1].close()


class Prefetcher:
    """One daemon thread that asks streaming to prepare (download/decompress) upcoming shards.

    Requests are hints: a failure here is kept and re-raised only if the reader then cannot read the
    shard either (the reader retries itself), so a transient error in the background does not kill the
    run, while a persistent one surfaces with the domain named.
    """

    def __init__(self, readers: list[DomainReader], max_queue: int = 256) -> None:
        self.readers = readers
        self._q: queue.Queue[tuple[int, int] | None] = queue.Queue(maxsize=max_queue)
        self._pending: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="grape-stream-prefetch", daemon=True)
        self._thread.start()

    def request(self, k: int, shard_id: int) -> None:
        key = (k, int(shard_id))
        with self._lock:
            if key in self._pending:
                return
            self._pending.add(key)
        try:
            self._q.put_nowait(key)
        except queue.Full:
            with self._lock:
                self._pending.discard(key)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            k, sid = item
            try:
                reader = self.readers[k]
                if reader.needs_prepare(sid):
                    prepare_shard(reader.dataset, sid, blocking=False)
            except Exception as exc:  # noqa: BLE001 - see class docstring
                self.errors.append(exc)
            finally:
                with self._lock:
                    self._pending.discard(item)

    def stop(self) -> None:
        self._stop.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=5)
