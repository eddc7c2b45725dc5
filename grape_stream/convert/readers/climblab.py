"""ClimbLab and ClimbMix readers: already GPT-2 token ids, so the converter only packs them.

ClimbLab: `cluster_{k}/cluster_{k}_{NNN}.tokenized.parquet` with `tokens` (list<int64>) and
`token_count`; there is no cluster column, the directory name IS the domain.
ClimbMix: `part_N.tokenized.jsonl` lines `{"cluster_id", "tokens", "token_count"}`; the domain is
`cluster_{cluster_id}` (the same names ClimbLab's directories use).

Published token lists are per document and carry no end-of-text id; the converter appends GPT-2's
`<|endoftext|>` (50256) after each document unless it already ends with it (see docs/converters.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from grape_stream.convert.formats import iter_jsonl, iter_parquet_batches
from grape_stream.convert.inputs import check_domain_name
from grape_stream.convert.tokenization import GPT2_VOCAB_SIZE

from .base import DOMAIN, BadInput, Reader, Record, as_token_array, register

__all__ = ["ClimbLabReader", "ClimbMixReader"]

GPT2_VOCAB = GPT2_VOCAB_SIZE  # the id range pre-tokenized records are checked against


def _count_check(idx: int, unit: str, arr: np.ndarray, count: Any, rec: Record) -> BadInput | None:
    if count is None:
        return None
    try:
        ok = int(count) == arr.size
    except (TypeError, ValueError):
        ok = False
    if ok:
        return None
    return BadInput("token_count_mismatch", idx, unit, f"token_count {count!r} but {arr.size} tokens; kept the tokens",
                    keep=rec)


@register
@dataclass
class ClimbLabReader(Reader):
    """domain: override the directory-derived domain (all files go to this one)."""

    domain: str | None = None
    vocab_size: int = GPT2_VOCAB
    source = "climblab"
    pretokenized = True
    patterns = (".parquet",)
    options = (DOMAIN,)

    def path_domain(self, path: str) -> str:
        return self.domain or os.path.basename(os.path.dirname(os.path.abspath(path)))

    def describe(self) -> dict[str, Any]:
        return {"domain": self.domain}

    def read(self, path: str) -> Iterator[Record | BadInput]:
        domain = self.path_domain(path)
        why = check_domain_name(domain)
        if why:
            yield BadInput("bad_field", None, "row", f"directory name as domain: {why}", fatal=True)
            return
        for item in iter_parquet_batches(path, ["tokens"], optional=["token_count"], batch_size=4096):
            if isinstance(item, BadInput):
                yield item
            else:
                yield from self._batch_records(*item, domain)

    def _batch_records(self, start: int, batch: Any, domain: str) -> Iterator[Record | BadInput]:
        """Columnar fast path: one flat numpy array and offsets instead of a Python list per row."""
        import pyarrow as pa

        col = batch.column("tokens")
        counts = batch.column("token_count").to_pylist() if "token_count" in batch.schema.names else None
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
            lost = f"batch of {batch.num_rows} rows lost"
            yield BadInput("bad_tokens", start, "row", f"'tokens' column is {col.type}, not a list of ints; {lost}")
            return
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy(zero_copy_only=False) if len(col.values) else np.zeros(0, np.int64)
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        if values.size and values.dtype.kind not in "iu":
            lost = f"batch of {batch.num_rows} rows lost"
            yield BadInput("bad_tokens", start, "row", f"'tokens' holds {col.values.type}, not integers; {lost}")
            return
        bad_range = bool(values.size) and (int(values.min()) < 0 or int(values.max()) >= self.vocab_size)
        for i in range(batch.num_rows):
            idx = start + i
            if not valid[i]:
                yield BadInput("missing_field", idx, "row", "'tokens' is null")
                continue
            arr = values[offsets[i]:offsets[i + 1]]  # offsets index into values even for sliced arrays
            if bad_range:
                checked, why = as_token_array(arr, self.vocab_size)
                if checked is None:
                    yield BadInput("bad_tokens", idx, "row", str(why))
                    continue
                arr = checked
            rec = Record(idx, "row", domain, tokens=arr.astype(np.uint32, copy=False))
            warn = _count_check(idx, "row", arr, counts[i] if counts else None, rec)
            yield warn if warn else rec


@register
@dataclass
class ClimbMixReader(Reader):
    vocab_size: int = GPT2_VOCAB
    source = "climbmix"
    pretokenized = True
    patterns = (".jsonl", ".jsonl.zst", ".jsonl.gz")

    def read(self, path: str) -> Iterator[Record | BadInput]:
        for item in iter_jsonl(path):
            if isinstance(item, BadInput):
                yield item
                continue
            idx, obj = item
            if obj.get("cluster_id") is None:
                yield BadInput("missing_field", idx, "line", "no 'cluster_id'")
                continue
            if obj.get("tokens") is None:
                yield BadInput("missing_field", idx, "line", "no 'tokens'")
                continue
            cid = obj["cluster_id"]
            if isinstance(cid, bool) or not isinstance(cid, (int, str)) or not str(cid).isdigit():
                yield BadInput("bad_field", idx, "line", f"cluster_id {cid!r} is not a non-negative integer")
                continue
            domain = f"cluster_{int(cid)}"
            arr, why = as_token_array(obj["tokens"], self.vocab_size)
            if arr is None:
                yield BadInput("bad_tokens", idx, "line", str(why))
                continue
            rec = Record(idx, "line", domain, tokens=arr)
            warn = _count_check(idx, "line", arr, obj.get("token_count"), rec)
            yield warn if warn else rec
