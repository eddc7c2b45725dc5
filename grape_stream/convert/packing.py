"""Turn token-id documents into fixed-length training samples.

Two shapes, matching the shared data contracts:
- `SequencePacker` (domain data): documents are concatenated, each followed by EOS, and cut into rows
  of exactly `seq_len` tokens; documents flow across row boundaries. What is left at the end (fewer than
  seq_len tokens) is dropped (`remainder="drop"`, the default: every row is real text) or padded with EOS
  and masked out (`remainder="pad"`: no token lost; rows then carry a `loss_mask`).
- `ExamplePadder` (task data): one example per row, padded to `seq_len` with EOS and a `loss_mask` that
  is 1 on real tokens and 0 on padding; examples longer than `seq_len` are truncated (and counted).

EOS policy (`eos`): "auto" appends EOS after a document unless it already ends with it (pre-tokenized
corpora sometimes include it), "always" appends it unconditionally, "none" never does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

__all__ = ["PackStats", "SequencePacker", "ExamplePadder", "EOS_MODES", "REMAINDER_MODES"]

EOS_MODES = ("auto", "always", "none")
REMAINDER_MODES = ("drop", "pad")


@dataclass
class PackStats:
    """Counts for one output dataset (one domain/split, or one partition of it).

    tokens: real tokens stored in samples (document tokens plus the EOS ids added), never padding.
    """

    documents: int = 0
    tokens: int = 0
    samples: int = 0
    padding_tokens: int = 0
    dropped_tokens: int = 0  # remainder dropped at the end of a work unit (remainder="drop")
    truncated_examples: int = 0  # per-example mode: examples cut to seq_len
    truncated_tokens: int = 0

    def add(self, other: "PackStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "PackStats":
        return cls(**{f.name: int(d.get(f.name, 0)) for f in fields(cls)})


def _check(seq_len: int, eos: str, eos_id: int) -> None:
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if eos not in EOS_MODES:
        raise ValueError(f"eos must be one of {EOS_MODES}, got {eos!r}")
    if eos_id < 0:
        raise ValueError(f"eos_id must be non-negative, got {eos_id}")


def _with_eos(doc: np.ndarray, eos: str, eos_id: int) -> bool:
    if eos == "none":
        return False
    if eos == "auto" and doc.size and int(doc[-1]) == eos_id:
        return False
    return True


class SequencePacker:
    """Concatenate documents with EOS separators and emit full `seq_len` rows as they fill."""

    def __init__(self, seq_len: int, eos_id: int, dtype: np.dtype, *, eos: str = "auto",
                 remainder: str = "drop") -> None:
        _check(seq_len, eos, eos_id)
        if remainder not in REMAINDER_MODES:
            raise ValueError(f"remainder must be one of {REMAINDER_MODES}, got {remainder!r}")
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.dtype = np.dtype(dtype)
        self.eos = eos
        self.remainder = remainder
        self.with_mask = remainder == "pad"
        self._rest = np.zeros(0, dtype=self.dtype)
        self._eos = np.array([eos_id], dtype=self.dtype)
        self.stats = PackStats()

    def add(self, docs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """Append documents; returns the completed rows, shape (n, seq_len) (n may be 0), and their
        all-ones loss mask under remainder="pad" (None otherwise)."""
        parts = [self._rest]
        for d in docs:
            parts.append(d)
            if _with_eos(d, self.eos, self.eos_id):
                parts.append(self._eos)
        self.stats.documents += len(docs)
        buf = np.concatenate(parts).astype(self.dtype, copy=False) if len(parts) > 1 else self._rest
        n = buf.size // self.seq_len
        cut = n * self.seq_len
        rows = buf[:cut].reshape(n, self.seq_len)
        self._rest = buf[cut:].copy()
        self.stats.samples += n
        self.stats.tokens += cut
        return rows, (np.ones((n, self.seq_len), dtype=np.uint8) if self.with_mask else None)

    def finish(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The last partial row under remainder="pad" (with its mask), else nothing (the tokens dropped)."""
        rest, self._rest = self._rest, np.zeros(0, dtype=self.dtype)
        empty = np.zeros((0, self.seq_len), dtype=self.dtype)
        if rest.size == 0:
            return empty, (np.zeros((0, self.seq_len), np.uint8) if self.with_mask else None)
        if self.remainder == "drop":
            self.stats.dropped_tokens += int(rest.size)
            return empty, None
        row = np.full((1, self.seq_len), self.eos_id, dtype=self.dtype)
        row[0, : rest.size] = rest
        mask = np.zeros((1, self.seq_len), dtype=np.uint8)
        mask[0, : rest.size] = 1
        self.stats.samples += 1
        self.stats.tokens += int(rest.size)
        self.stats.padding_tokens += self.seq_len - int(rest.size)
        return row, mask


class ExamplePadder:
    """One example per row: tokens (+EOS) padded with EOS to seq_len, loss_mask 1 on real tokens."""

    with_mask = True

    def __init__(self, seq_len: int, eos_id: int, dtype: np.dtype, *, eos: str = "auto") -> None:
        _check(seq_len, eos, eos_id)
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.dtype = np.dtype(dtype)
        self.eos = eos
        self.stats = PackStats()

    def add(self, docs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        n = len(docs)
        rows = np.full((n, self.seq_len), self.eos_id, dtype=self.dtype)
        mask = np.zeros((n, self.seq_len), dtype=np.uint8)
        for i, d in enumerate(docs):
            length = d.size + (1 if _with_eos(d, self.eos, self.eos_id) else 0)
            keep = min(length, self.seq_len)
            if length > self.seq_len:
                self.stats.truncated_examples += 1
                self.stats.truncated_tokens += length - self.seq_len
            k = min(d.size, keep)
            rows[i, :k] = d[:k]  # positions k..keep-1 (at most one) already hold the EOS fill value
            mask[i, :keep] = 1
            self.stats.tokens += keep
            self.stats.padding_tokens += self.seq_len - keep
        self.stats.documents += n
        self.stats.samples += n
        return rows, mask
