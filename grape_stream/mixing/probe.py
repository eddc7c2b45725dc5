"""Probe samples: ``n`` samples of one domain drawn by random access, independent of the training stream.

GRAPE's probes must be the same whenever they are asked for with the same key (so that gradients of
different steps compare like with like) and must not move the training stream. They are therefore a
pure function of ``(seed, key, domain)``, drawn with their own random stream (``TAG_PROBE``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from grape_stream.mixing.counter_rng import TAG_PROBE
from grape_stream.mixing.shard_reader import DomainReader

__all__ = ["probe_ids", "probe_samples"]


def _key_to_int(key: Any) -> int:
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key) & 0xFFFFFFFFFFFFFFFF
    digest = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def probe_ids(domain_index: Any, n: Any, key: Any, *, seed: int, domain_names: list[str],
              domain_sizes: list[int], rank: int | None = None, world_size: int | None = None) -> np.ndarray:
    """Sample ids of a probe (checked arguments; disjoint across ranks when rank/world_size are given)."""
    num_domains = len(domain_names)
    if isinstance(domain_index, bool) or not isinstance(domain_index, (int, np.integer)) \
            or not 0 <= domain_index < num_domains:
        raise IndexError(f"domain_index must be in [0, {num_domains}), got {domain_index!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size (or neither)")
    ws = 1 if world_size is None else int(world_size)
    r = 0 if rank is None else int(rank)
    if not 0 <= r < ws:
        raise ValueError(f"rank {r} is not in [0, {ws})")
    k = int(domain_index)
    num_samples = int(domain_sizes[k])
    if n * ws > num_samples:
        raise ValueError(
            f"domain {domain_names[k]!r} has {num_samples} samples; cannot probe {n} x {ws} ranks "
            "without repeats"
        )
    kk = _key_to_int(key)
    s = seed & 0xFFFFFFFFFFFFFFFF
    rng = np.random.default_rng([s & 0xFFFFFFFF, s >> 32, kk & 0xFFFFFFFF, kk >> 32, k, TAG_PROBE])
    return rng.choice(num_samples, size=n * ws, replace=False)[r * n:(r + 1) * n]


def probe_samples(reader: DomainReader, ids: np.ndarray, domain_index: int) -> list[dict[str, Any]]:
    """The samples as dicts of the dataset's columns (numpy arrays), plus ``domain`` and ``sample_index``."""
    rows = reader.read(ids)
    out = []
    for row, sid in zip(rows, ids.tolist()):
        sample = {key_: (np.array(v) if isinstance(v, np.ndarray) else v) for key_, v in row.items()}
        sample["domain"] = int(domain_index)
        sample["sample_index"] = int(sid)
        out.append(sample)
    return out
