"""The mixer's domains: how one is declared, checked, and opened as one StreamingDataset each.

Opening is where streaming's traps bite (stale shared memory, a stale local index, S3 without
credentials, different ``local`` directories across ranks, racing registrations), so the order of the
steps here matters: every workaround in :mod:`grape_stream.streaming_compat` runs before streaming sees
the directory, and a failure half-way releases what was already registered.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch.distributed as dist

from grape_stream.config import MixerConfig, streaming_fields
from grape_stream.mixing.compose import RESERVED_KEYS
from grape_stream.mixing.counter_rng import hash64
from grape_stream.streaming_compat.local_index import (
    DomainUnavailableError,
    RemoteMismatchError,
    UnsafeIndexError,
    check_s3_credentials,
    check_same_locals_across_ranks,
    default_local_for,
    sync_local_index,
)
from grape_stream.streaming_compat.patches import install_streaming_patches
from grape_stream.streaming_compat.registration import create_registered
from grape_stream.streaming_compat.shard_state import check_dataset, require_supported_streaming
from grape_stream.streaming_compat.shm import (
    cleanup_stale_streaming_shm,
    describe_local_users,
    detach_scanner_attachments,
    release_streaming_dataset,
)
from grape_stream.world import dist_active, process_world

logger = logging.getLogger(__name__)

__all__ = [
    "PASSTHROUGH",
    "PLANNED_BY_MIXER",
    "DomainStream",
    "as_domains",
    "check_streaming_kwargs",
    "domain_dirs",
    "name_seed",
    "open_datasets",
    "prepare_locals",
    "release_all",
]

#: Streaming arguments passed through to every domain's StreamingDataset (MixerConfig's fields marked so).
PASSTHROUGH = streaming_fields()
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
        retry_deadline: seconds a failing shard download of this domain is retried (exponential backoff
            with jitter) before the read fails with one error; default: the mixer's ``retry_deadline``.
    """

    name: str
    remote: str | None = None
    local: str | None = None
    split: str | None = None
    max_epochs: float | None = None
    cache_limit: int | str | None = None
    retry_deadline: float | None = None

    def __post_init__(self) -> None:
        """Wrong types fail here, naming the field (not as an AttributeError when the mixer opens the domain)."""
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"DomainStream: name must be a non-empty str, got {self.name!r} "
                            f"({type(self.name).__name__}); e.g. DomainStream('en', local='data/en')")
        for attr in ("remote", "local"):
            value = getattr(self, attr)
            if isinstance(value, os.PathLike):
                setattr(self, attr, os.fspath(value))
            elif value is not None and not isinstance(value, str):
                raise TypeError(f"DomainStream {self.name!r}: {attr} must be a str (a path or URL) or None, "
                                f"got {value!r} ({type(value).__name__})")
        if self.split is not None and not isinstance(self.split, str):
            raise TypeError(f"DomainStream {self.name!r}: split must be a str or None, got {self.split!r} "
                            f"({type(self.split).__name__})")
        if self.max_epochs is not None and (isinstance(self.max_epochs, bool)
                                            or not isinstance(self.max_epochs, (int, float))):
            raise TypeError(f"DomainStream {self.name!r}: max_epochs must be a number or None, got {self.max_epochs!r}")
        if self.cache_limit is not None and (isinstance(self.cache_limit, bool)
                                             or not isinstance(self.cache_limit, (int, str))):
            raise TypeError(f"DomainStream {self.name!r}: cache_limit must be bytes (int), a size such as '10gb', "
                            f"or None, got {self.cache_limit!r}")

    def own_or(self, name: str, mixer_value: Any) -> Any:
        """This domain's setting ``name`` (``retry_deadline``, ``cache_limit``) when it sets one, else the
        mixer's: the one rule by which a domain overrides the mixer."""
        own = getattr(self, name)
        return mixer_value if own is None else own

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
    raise TypeError(f"domains must be DomainStream objects, dicts or streaming Streams, got {type(d).__name__}")


#: Folder names that name a split, not a domain (``grape-stream convert`` writes ``<domain>/<split>``).
SPLIT_FOLDERS = frozenset({"train", "validation", "val", "valid", "dev", "test", "probe", "eval"})


def _stream_name(s: Any) -> str:
    """A streaming Stream's domain name: the last part of its remote (or local) path, e.g. ``s3://b/en`` -> en,
    skipping a split folder: ``.../en/train`` -> en (``Stream(local=out/en/train)`` was named ``train``, and two
    such streams ``train_1``, ``train_2``)."""
    parts = [p for p in str(s.remote or s._local or "").rstrip("/").split("/") if p]
    while len(parts) > 1 and parts[-1] in SPLIT_FOLDERS | ({s.split} if s.split else set()):
        parts.pop()
    return parts[-1] if parts else "stream"


def _from_streams(streams: Sequence[Any]) -> tuple[list[Any], list[float] | None]:
    """mosaicml-streaming's ``Stream`` objects as domains, and their ``proportion`` as the initial weights.

    A Stream has no name: each domain is named by the last part of its path that is not a split folder
    (``.../en/train`` -> ``en``); names still repeated get ``_1``, ``_2``, ... and a warning line naming them (pass
    DomainStream to choose names). ``repeat`` / ``choose`` (absolute epoch sizes, which the
    mixer does not plan) and per-stream download options are refused, each with what to use instead."""
    from streaming import Stream

    names = [_stream_name(s) for s in streams if isinstance(s, Stream)]
    seen: dict[str, int] = {}
    out: list[Any] = []
    props: list[float | None] = []
    for s in streams:
        if not isinstance(s, Stream):
            out.append(s)
            props.append(None)
            continue
        if s._repeat is not None or s._choose is not None:
            raise ValueError(f"Stream({s.remote or s._local!r}): repeat= / choose= set absolute epoch sizes, which the "
                             "mixer does not plan; use proportion= (the initial weight) or DomainStream(max_epochs=)")
        for attr in ("download_retry", "download_timeout", "keep_zip"):
            if getattr(s, f"_{attr}") is not None:
                raise ValueError(f"Stream({s.remote or s._local!r}): pass {attr}= to WeightedStreamingMixer "
                                 "(it applies to every domain)")
        name = _stream_name(s)
        if names.count(name) > 1:
            seen[name] = seen.get(name, 0) + 1
            logger.warning("Stream(%r) named domain %r: %d streams end in %r (give DomainStream(name, ...) to name it)",
                        s.remote or s._local, f"{name}_{seen[name]}", names.count(name), name)
            name = f"{name}_{seen[name]}"
        out.append(DomainStream(name, remote=s.remote, local=s._local, split=s.split or None))
        props.append(s._proportion)
    given = [p for p in props if p is not None]
    if not given:
        return out, None
    if len(given) != len(props):
        raise ValueError("give every Stream a proportion, or none (as streaming requires)")
    total = float(sum(given))
    if total <= 0:
        raise ValueError(f"Stream proportions must not all be 0, got {given}")
    return out, [p / total for p in given]


def as_domains(domains: Sequence[Any] | None, weights: Any = None,
               streams: Sequence[Any] | None = None) -> tuple[list[DomainStream], Any]:
    """The domains as DomainStream objects (at least one, names unique) and the initial weights.

    ``domains`` (or ``streams``, streaming's name for the same list) may hold DomainStream objects, dicts of
    their fields, or mosaicml-streaming ``Stream`` objects, whose ``proportion`` (normalised to sum to 1) is
    the initial weight unless ``weights`` is given."""
    if domains is not None and streams is not None:
        raise TypeError("WeightedStreamingMixer takes domains= or streams= (the same list), not both")
    if domains is None and streams is None:
        raise TypeError("WeightedStreamingMixer needs domains=[DomainStream(name, local=...), ...] "
                        "(or streaming's streams=[Stream(remote=..., local=..., proportion=...), ...])")
    items, proportions = _from_streams(list(domains if domains is not None else streams))  # type: ignore[arg-type]
    out = [_as_domain(d) for d in items]
    if not out:
        raise ValueError("the mixer needs at least one domain")
    names = [d.name for d in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"domain names must be unique; repeated: {dup}")
    return out, (proportions if weights is None else weights)


def check_streaming_kwargs(options: Mapping[str, Any]) -> None:
    """Refuse streaming arguments that the mixer plans itself, saying what to use instead (any other unknown
    name is refused with the closest MixerConfig field by ``config.with_overrides``)."""
    for key in options:
        if key in PLANNED_BY_MIXER:
            raise TypeError(f"WeightedStreamingMixer does not take streaming's {key!r}: {PLANNED_BY_MIXER[key]}")


def domain_dirs(domains: Sequence[DomainStream]) -> tuple[list[str], list[str]]:
    """(local directory, local directory + split) of every domain; no two domains may share one."""
    locals_ = [d.resolved_local() for d in domains]
    stream_dirs = [os.path.join(loc, d.split) if d.split else loc for loc, d in zip(locals_, domains)]
    seen: dict[str, str] = {}
    for d, sd in zip(domains, stream_dirs):
        if sd in seen:
            raise ValueError(
                f"domains {seen[sd]!r} and {d.name!r} use the same local directory {sd}; each domain needs "
                "its own (streaming keeps one cache per directory)"
            )
        seen[sd] = d.name
    return locals_, stream_dirs


def name_seed(seed: int, name: str) -> int:
    """A domain's shuffle seed: from the mixer seed and its name, so adding a domain reshuffles no other."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return int(hash64(seed, np.uint64(h))[0])


# --------------------------------------------------------------------------------------------------
# Before streaming: the traps
# --------------------------------------------------------------------------------------------------
def prepare_locals(domains: Sequence[DomainStream], locals_: Sequence[str], stream_dirs: Sequence[str], *,
                   local_rank: int, config: MixerConfig) -> None:
    """Run every streaming workaround that must happen before a StreamingDataset is created."""
    require_supported_streaming()
    install_streaming_patches()  # one S3 session per process; per-process decompression names (patches.py)
    cleanup_stale_streaming_shm()
    check_s3_credentials([(d.name, d.remote) for d in domains], dummy_credentials=config.s3_dummy_credentials)
    check_same_locals_across_ranks(stream_dirs)
    _sync_local_indexes(domains, locals_, local_rank=local_rank, config=config)


def _sync_local_indexes(domains: Sequence[DomainStream], locals_: Sequence[str], *, local_rank: int,
                        config: MixerConfig) -> None:
    """Local leader checks every domain's index against its remote; all ranks learn of any error."""
    error: str | None = None
    exc_type: type[BaseException] = DomainUnavailableError
    if local_rank == 0:
        try:
            for d, loc in zip(domains, locals_):
                sync_local_index(d.name, d.remote, loc, d.split, download_retry=config.download_retry,
                                 download_timeout=config.download_timeout, overwrite_local=config.overwrite_local,
                                 retry_deadline=d.own_or("retry_deadline", config.retry_deadline))
        except (DomainUnavailableError, RemoteMismatchError, UnsafeIndexError) as exc:
            if not dist_active():
                raise
            error, exc_type = str(exc), type(exc)
    if dist_active() and process_world().size > 1:
        errors: list[Any] = [None] * process_world().size
        dist.all_gather_object(errors, (error, exc_type.__name__))
        for err, name in errors:
            if err is not None:
                kinds = {c.__name__: c for c in (RemoteMismatchError, UnsafeIndexError)}
                raise kinds.get(name, DomainUnavailableError)(err)
    elif error is not None:  # pragma: no cover - single process raises above
        raise exc_type(error)


# --------------------------------------------------------------------------------------------------
# One StreamingDataset per domain
# --------------------------------------------------------------------------------------------------
def _check_columns(name: str, ds: Any) -> None:
    cols = getattr(ds.shards[0], "column_names", None) or []
    clash = [c for c in cols if c in RESERVED_KEYS]
    if clash:
        raise ValueError(
            f"domain {name!r} has column(s) {clash}, which the mixer adds to every sample "
            f"(reserved: {RESERVED_KEYS}); rename them when converting"
        )


def _open_one(d: DomainStream, local: str, limit: int | str | None, *, batch_size: int, predownload: int,
              opts: Mapping[str, Any]) -> Any:
    from streaming import StreamingDataset  # only after prepare_locals() checked the streaming version

    try:
        return StreamingDataset(
            remote=d.remote, local=local, split=d.split, batch_size=batch_size, shuffle=False,
            predownload=predownload, cache_limit=limit, **opts,
        )
    except FileExistsError:
        raise  # a shared-memory prefix race: create_registered retries it
    except Exception as exc:
        where = d.remote or local
        if "Reused local directory" in str(exc):
            raise DomainUnavailableError(
                f"domain {d.name!r}: local directory {local} is registered by another "
                f"StreamingDataset ({describe_local_users(local)}); close the other mixer "
                "(mixer.close()) or give this one its own local directory"
            ) from exc
        raise DomainUnavailableError(f"domain {d.name!r} ({where}): {type(exc).__name__}: {exc}") from exc


def open_datasets(domains: Sequence[DomainStream], locals_: Sequence[str], *, batch_size: int, predownload: int,
                  total_cache: int | None, opts: Mapping[str, Any], local_rank: int) -> list[Any]:
    """One StreamingDataset per domain, registered under the machine-wide lock and owner-recorded.

    On any failure the datasets already opened are released before the error propagates.
    """
    datasets: list[Any] = []
    try:
        for d, loc in zip(domains, locals_):
            limit = d.own_or("cache_limit", None if total_cache is None else int(total_cache) // len(domains))
            ds = create_registered(functools.partial(_open_one, d, loc, limit, batch_size=batch_size,
                                                     predownload=predownload, opts=opts),
                                   enabled=local_rank == 0)
            datasets.append(ds)
            check_dataset(ds)
            _check_columns(d.name, ds)
    except BaseException:
        release_all(datasets, os.getpid())
        raise
    try:  # streaming's prefix scan left other jobs' segments mapped here; do not keep them alive
        detach_scanner_attachments()
    except Exception as exc:  # pragma: no cover - hygiene only
        logger.debug("detaching scanned segments failed: %s", exc)
    return datasets


def release_all(datasets: list[Any], owner_pid: int) -> None:
    """Release the datasets' shared memory and locks, in the process that created them only."""
    if os.getpid() != owner_pid:
        return
    for ds in datasets:
        try:
            release_streaming_dataset(ds)
        except Exception as exc:  # pragma: no cover - best effort at exit
            logger.debug("releasing a StreamingDataset failed: %s", exc)
