"""SlimPajama reader: `{"text", "meta": {"redpajama_set_name"}}` records; the set name is the domain.

Reads the published layout (`train/chunk*/example_train_*.jsonl.zst`, `validation|test/chunk*/
example_holdout_*.jsonl.zst`) and the parquet variants (SlimPajama-6B and friends), whose `meta` is a
struct in some copies and a JSON string in others: both are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

from grape_stream.convert.formats import iter_jsonl, iter_parquet_rows
from grape_stream.convert.inputs import check_domain_name, split_from_path

from .base import SPLIT_FROM_PATH, BadInput, Reader, Record, register

__all__ = ["SlimPajamaReader", "SLIMPAJAMA_DOMAINS"]

SLIMPAJAMA_DOMAINS = (
    "RedPajamaCommonCrawl",
    "RedPajamaC4",
    "RedPajamaGithub",
    "RedPajamaBook",
    "RedPajamaArXiv",
    "RedPajamaWikipedia",
    "RedPajamaStackExchange",
)


@register
@dataclass
class SlimPajamaReader(Reader):
    """split_from_path: put each file's records in the split its path names (train/validation/test)."""

    split_from_path: bool = False
    source = "slimpajama"
    patterns = (".jsonl.zst", ".jsonl", ".parquet")
    options = (SPLIT_FROM_PATH,)

    def describe(self) -> dict[str, Any]:
        return {"split_from_path": self.split_from_path}

    def read(self, path: str) -> Iterator[Record | BadInput]:
        split = split_from_path(path) if self.split_from_path else None
        if self.split_from_path and split is None:
            yield BadInput("bad_field", None, "line", f"--split-from-path: no train/validation/test in path {path}",
                           fatal=True)
            return
        if path.endswith(".parquet"):
            items: Iterator[Any] = iter_parquet_rows(path, ["text", "meta"])
            unit = "row"
        else:
            items = iter_jsonl(path)
            unit = "line"
        for item in items:
            if isinstance(item, BadInput):
                yield item
                continue
            idx, obj = item
            text = obj.get("text")
            if text is None:
                yield BadInput("missing_field", idx, unit, "no 'text' field")
                continue
            if not isinstance(text, str):
                yield BadInput("bad_field", idx, unit, f"'text' is a {type(text).__name__}, not a string")
                continue
            meta = obj.get("meta")
            if isinstance(meta, (str, bytes)):
                try:
                    meta = json.loads(meta)
                except ValueError as e:
                    yield BadInput("bad_field", idx, unit, f"'meta' is a string but not JSON ({e})")
                    continue
            if not isinstance(meta, dict) or meta.get("redpajama_set_name") is None:
                yield BadInput("missing_field", idx, unit, "no 'meta.redpajama_set_name'")
                continue
            domain = meta["redpajama_set_name"]
            why = check_domain_name(domain)
            if why:
                yield BadInput("bad_field", idx, unit, f"meta.redpajama_set_name: {why}")
                continue
            yield Record(idx, unit, domain, text=text, split=split)
