"""Small real MDS domain datasets (streaming's MDSWriter), for tests and bench/faults.py.

Every sample is a packed sequence of ``seq_len`` uint16 tokens (the converter's ``tokens`` column) whose
first three tokens identify it: ``[domain_id, index % 65536, index // 65536, ...]``. Tests read the
identity from the data itself, independently of the metadata the mixer attaches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

SEQ_LEN = 16


def write_domain(out: str | os.PathLike[str], domain_id: int, num_samples: int, *, seq_len: int = SEQ_LEN,
                 samples_per_shard: int = 50, compression: str | None = "zstd", seed: int = 0) -> str:
    """Write one domain as MDS shards of about ``samples_per_shard`` samples; return the directory."""
    from streaming import MDSWriter

    out = os.fspath(out)
    rng = np.random.default_rng([seed, domain_id])
    # size_limit is in bytes: one sample is 2 * seq_len bytes of payload plus a little framing.
    size_limit = max(64, samples_per_shard * (2 * seq_len + 8))
    with MDSWriter(out=out, columns={"tokens": "ndarray:uint16"}, compression=compression,
                   size_limit=size_limit) as writer:
        for i in range(num_samples):
            tokens = rng.integers(0, 50000, size=seq_len, dtype=np.uint16)
            tokens[0] = domain_id
            tokens[1] = i % 65536
            tokens[2] = i // 65536
            writer.write({"tokens": tokens})
    return out


def write_domains(root: str | os.PathLike[str], sizes: Sequence[int], **kwargs) -> list[str]:
    """One directory per domain, ``root/d<k>``."""
    return [write_domain(Path(root) / f"d{k}", k, n, **kwargs) for k, n in enumerate(sizes)]


def identity(sample) -> tuple[int, int]:
    """(domain id, sample index) read from a sample's tokens (tensor or array)."""
    t = np.asarray(sample["tokens"])
    return int(t[0]), int(t[1]) + 65536 * int(t[2])


def batch_identities(batch) -> list[tuple[int, int]]:
    """(domain id, sample index) of each row of a collated batch."""
    t = np.asarray(batch["tokens"])
    return [(int(r[0]), int(r[1]) + 65536 * int(r[2])) for r in t]
