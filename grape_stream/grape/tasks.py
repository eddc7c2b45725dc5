"""Target tasks: a validation split that GRAPE probes, and a test split that evaluation reads.

GRAPE needs, every ``z_every`` steps, a small batch of each target task *at arbitrary positions* (a probe)
and it must be able to replay exactly the same probes after a resume. A task is therefore read by
random access, never as an iterator: the probe indices are a pure function of ``(seed, key)``, where the
controller's key contains the optimizer step, so a resumed run draws the same probes as an uninterrupted
one without saving any reader position. Evaluation reads the separate test split sequentially.

Task MDS datasets (written by ``grape_stream.convert.pipeline``) hold ``tokens`` (seq_len, padded) and
``loss_mask`` (seq_len, uint8: 1 where the token is a counted prediction target). A dataset without a
``loss_mask`` column (e.g. held-out text of a target language, packed like a domain) counts every token.

Nothing here imports Composer.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from grape_stream.retry import default_policy
from grape_stream.streaming_compat.index_check import check_index
from grape_stream.streaming_compat.local_index import check_s3_credentials, default_local_for, sync_local_index
from grape_stream.streaming_compat.patches import install_streaming_patches
from grape_stream.streaming_compat.registration import create_registered
from grape_stream.streaming_compat.shard_state import fetch_shards, shards_of
from grape_stream.streaming_compat.shm import release_streaming_dataset
from grape_stream.world import dist_active, streaming_world

__all__ = ["TaskStream", "collate_task_samples", "probe_indices", "task_names"]


def _seed_sequence(seed: int, key: Any) -> list[int]:
    """Entropy for numpy's SeedSequence from a seed and an int / tuple-of-ints key (never Python's hash)."""
    words = [int(seed) & 0xFFFFFFFF]
    for part in key if isinstance(key, (tuple, list)) else (key,):
        if isinstance(part, str):
            part = int.from_bytes(hashlib.sha1(part.encode()).digest()[:8], "little")
        if isinstance(part, bool) or not isinstance(part, (int, np.integer)):
            raise TypeError(f"probe keys are ints, strings or tuples of them, got {type(part).__name__}")
        part = int(part)
        if part < 0:
            raise ValueError(f"probe key parts must be >= 0, got {part}")
        words.extend([part & 0xFFFFFFFF, (part >> 32) & 0xFFFFFFFF])
    return words


def probe_indices(
    num_samples: int, n: int, *, seed: int, key: Any, rank: int = 0, world_size: int = 1, disjoint: bool = False
) -> np.ndarray:
    """The sample indices of one probe: a function of ``(seed, key)`` only (and the rank when disjoint).

    Without ``disjoint`` every rank draws the same ``n`` indices. With it, one permutation is drawn for all
    ranks and rank r takes the r-th slice of ``n``, so the ranks' probes never overlap while the union is a
    sample of ``n * world_size`` distinct items (when the dataset has that many; beyond, further shuffled
    passes are appended, so every index is used before any repeats).
    """
    if num_samples < 1:
        raise ValueError("cannot probe an empty dataset")
    if n < 1:
        raise ValueError(f"a probe needs at least one sample, got n={n}")
    if not 0 <= rank < max(world_size, 1):
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    rng = np.random.default_rng(_seed_sequence(seed, key))
    total = n * (world_size if disjoint else 1)
    passes = -(-total // num_samples)
    order = np.concatenate([rng.permutation(num_samples) for _ in range(passes)])[:total]
    if disjoint:
        order = order[rank * n : (rank + 1) * n]
    return order.astype(np.int64)


def collate_task_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack MDS task samples into ``{"tokens": int64 (B, T), "loss_mask": uint8 (B, T)}``.

    A sample without ``loss_mask`` counts every token. Lengths must agree: a task dataset is padded to
    one seq_len by the converter, and a mismatch means two datasets were mixed up.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    tokens = [np.asarray(s["tokens"]) for s in samples]
    lengths = {t.shape for t in tokens}
    if len(lengths) != 1 or len(next(iter(lengths))) != 1:
        raise ValueError(f"task samples must be 1-D token arrays of one length, got shapes {sorted(lengths)}")
    masks = []
    for s, t in zip(samples, tokens):
        m = s.get("loss_mask")
        m = np.ones(t.shape, dtype=np.uint8) if m is None else np.asarray(m, dtype=np.uint8)
        if m.shape != t.shape:
            raise ValueError(f"loss_mask shape {m.shape} does not match tokens shape {t.shape}")
        masks.append(m)
    return {
        "tokens": torch.from_numpy(np.stack(tokens).astype(np.int64)),
        "loss_mask": torch.from_numpy(np.stack(masks)),
    }


@dataclass
class TaskStream:
    """One target task: where its MDS data lives, which split GRAPE probes and which split is evaluated.

    ``local`` is the dataset directory when ``remote`` is None, else the cache the shards download into
    (default: a temp directory derived from the remote). Splits follow the converter's layout,
    ``<root>/<split>/index.json``; ``split=None`` means ``<root>/index.json``. The probe split (paper:
    the task's standard validation set) and the test split must differ: evaluating on the data that
    steered the mixture would report an optimistic number.
    """

    name: str
    remote: str | None = None
    local: str | None = None
    split: str | None = "validation"
    test_split: str | None = "test"
    download_timeout: float = 120.0
    streaming_kwargs: dict[str, Any] = field(default_factory=dict)
    #: a task's splits are small: a remote split's shards are all fetched when it opens. False (a domain's
    #: training split read for a few samples, mixture/prior.py): none then, and :meth:`samples` fetches only
    #: the shards the samples asked for live in
    fetch_all: bool = True

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a task needs a non-empty name, got {self.name!r}")
        if self.remote is None and self.local is None:
            raise ValueError(f"task {self.name!r}: give `local` (a directory) or `remote` (e.g. s3://bucket/path)")
        if self.split is not None and self.split == self.test_split:
            raise ValueError(
                f"task {self.name!r}: the probe split and the test split are both {self.split!r}; "
                "evaluating on the probe split reports an optimistic number"
            )
        self._datasets: dict[str | None, Any] = {}

    # -- datasets -----------------------------------------------------------------------------------
    def _local_for(self, split: str | None) -> str:
        if self.remote is None:
            assert self.local is not None
            return self.local
        return self.local if self.local is not None else default_local_for(self.remote)

    def dataset(self, split: str | None = None, *, batch_size: int | None = None) -> Any:
        """The StreamingDataset of one split (default: the probe split), opened once and cached."""
        split = self.split if split is None else split
        if split in self._datasets:
            return self._datasets[split]
        from streaming import StreamingDataset

        local = self._local_for(split)
        index = os.path.join(local, split or "", "index.json")
        if self.remote is None and not os.path.exists(index):
            raise FileNotFoundError(
                f"task {self.name!r}: no MDS index at {index} (split={split!r}); convert the task with "
                "`grape-stream convert task ...` or fix `local`/`split`"
            )
        install_streaming_patches()  # per-process decompression names, one S3 session (patches.py)
        if self.remote is None:
            check_index(f"task {self.name}", index)  # names inside the folder, counts that fit the shards
        if self.remote is not None:
            # The mixer's guards against streaming's traps apply to task data too: fail early without S3
            # credentials, and never trust a cached index.json of another (or an older) remote dataset.
            check_s3_credentials([(f"task {self.name}", self.remote)])
            if streaming_world().local_rank == 0:
                sync_local_index(f"task {self.name}", self.remote, local, split,
                                 download_timeout=self.download_timeout)
            if dist_active():
                torch.distributed.barrier()
        ds = create_registered(lambda: StreamingDataset(
            remote=self.remote,
            local=local,
            split=split,
            shuffle=False,
            batch_size=batch_size,
            download_timeout=self.download_timeout,
            **self.streaming_kwargs,
        ), enabled=streaming_world().local_rank == 0)
        self._datasets[split] = ds  # cached first: close() releases it whatever happens next
        if ds.num_samples < 1:
            raise ValueError(f"task {self.name!r}: split {split!r} has no samples")
        if self.fetch_all and not self.streaming_kwargs.get("cache_limit"):
            # Probes and evaluation read through streaming's own downloads, outside the retry policy: a
            # task's splits are small, so they are fetched once here under it (an outage is ridden out,
            # refused credentials are one line) and every later read finds them local.
            self._fetch(ds, split)
        return ds

    def _fetch(self, ds: Any, split: str | None, shard_ids: Sequence[int] | None = None) -> None:
        """A remote split's shards (all, or ``shard_ids``) downloaded under the retry policy; local: nothing."""
        if self.remote is not None:
            url = "/".join(p for p in (self.remote.rstrip("/"), split) if p)
            fetch_shards(ds, what=f"task {self.name!r}", url=url, policy=default_policy(), shard_ids=shard_ids)

    def samples(self, indices: Sequence[int], split: str | None = None) -> list[dict[str, Any]]:
        """These samples of a split (default: the probe split), their shards fetched first under the retry
        policy when the split was opened without fetching them all (``fetch_all=False``)."""
        split = self.split if split is None else split
        ds = self.dataset(split)
        if not self.fetch_all:
            self._fetch(ds, split, shards_of(ds, indices))
        return [ds[int(i)] for i in indices]

    def num_samples(self, split: str | None = None) -> int:
        return int(self.dataset(split).num_samples)

    # -- probes -------------------------------------------------------------------------------------
    def probe(
        self, n: int, key: Any, *, seed: int = 0, rank: int = 0, world_size: int = 1, disjoint: bool = False
    ) -> dict[str, torch.Tensor]:
        """A batch of ``n`` probe-split samples chosen by ``(seed, key)``; see :func:`probe_indices`."""
        ds = self.dataset(self.split)
        idx = probe_indices(
            ds.num_samples, n, seed=seed, key=key, rank=rank, world_size=world_size, disjoint=disjoint
        )
        return collate_task_samples([ds[int(i)] for i in idx])

    # -- evaluation ---------------------------------------------------------------------------------
    def eval_dataloader(self, batch_size: int, *, num_workers: int = 0) -> torch.utils.data.DataLoader:
        """A DataLoader over the test split (each rank reads its own part when distributed)."""
        if self.test_split is None:
            raise ValueError(f"task {self.name!r} has no test split to evaluate on")
        ds = self.dataset(self.test_split, batch_size=batch_size)
        return torch.utils.data.DataLoader(
            ds,
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=collate_task_samples,
            persistent_workers=False,
        )

    def close(self) -> None:
        """Release streaming's shared memory and file locks of the opened splits (after their loaders)."""
        for ds in self._datasets.values():
            release_streaming_dataset(ds)
        self._datasets.clear()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "remote": self.remote, "local": self.local, "split": self.split,
                "test_split": self.test_split}


def task_names(tasks: Iterable[TaskStream]) -> list[str]:
    names = [t.name for t in tasks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"task names must be unique, repeated: {dup}")
    return names
