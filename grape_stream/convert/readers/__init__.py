"""Dataset-specific readers (SlimPajama, ClimbLab/ClimbMix, wiki40b, target tasks, generic jsonl/parquet).

Readers only read: they turn files into `Record`s (text or token ids, with a domain and maybe a split)
and `BadInput`s. Tokenizing, packing and writing MDS shards all live in `grape_stream.convert.pipeline`.
"""

from __future__ import annotations

from typing import Any

from .climblab import ClimbLabReader, ClimbMixReader
from .common import BAD_KINDS, BadInput, Reader, Record
from .generic import JsonlReader, ParquetReader, RecordFields
from .slimpajama import SLIMPAJAMA_DOMAINS, SlimPajamaReader
from .tasks import TASK_LAYOUTS, TaskReader
from .wiki40b import Wiki40bReader

__all__ = [
    "SOURCES",
    "build_reader",
    "Reader",
    "Record",
    "BadInput",
    "BAD_KINDS",
    "SLIMPAJAMA_DOMAINS",
    "TASK_LAYOUTS",
]

SOURCES = ("slimpajama", "climblab", "climbmix", "wiki40b", "jsonl", "parquet", "task")

# Which options each source understands; anything else given is an error, not silently ignored.
_ACCEPTS: dict[str, set[str]] = {
    "slimpajama": {"split_from_path"},
    "climblab": {"domain"},
    "climbmix": set(),
    "wiki40b": {"markers", "domain", "split_from_path"},
    "jsonl": {"text_field", "domain", "domain_field", "split_field"},
    "parquet": {"text_field", "domain", "domain_field", "split_field"},
    "task": {"layout", "domain", "domain_field", "split_field"},
}

_FLAG = {
    "split_from_path": "--split-from-path",
    "domain": "--domain",
    "domain_field": "--domain-field",
    "split_field": "--split-field",
    "text_field": "--text-field",
    "markers": "--markers",
    "layout": "--layout",
}


def build_reader(source: str, **options: Any) -> Reader:
    """The reader for `source`; options left at None/False are unset. Unsupported options raise."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    given = {k: v for k, v in options.items() if v not in (None, False)}
    unknown = sorted(set(given) - set(_FLAG))
    if unknown:
        raise TypeError(f"unknown reader option(s) {unknown}")
    extra = sorted(set(given) - _ACCEPTS[source])
    if extra:
        flags = ", ".join(_FLAG[k] for k in extra)
        raise ValueError(f"{flags} does not apply to source {source!r}")
    if given.get("domain") and given.get("domain_field"):
        raise ValueError("--domain and --domain-field are exclusive: a fixed domain, or one per record")
    if source == "slimpajama":
        return SlimPajamaReader(split_from_path=bool(given.get("split_from_path")))
    if source == "climblab":
        return ClimbLabReader(domain=given.get("domain"))
    if source == "climbmix":
        return ClimbMixReader()
    if source == "wiki40b":
        return Wiki40bReader(
            markers=given.get("markers", "strip"), domain=given.get("domain"),
            split_from_path=bool(given.get("split_from_path")),
        )
    fields = RecordFields(given.get("domain_field"), given.get("domain"), given.get("split_field"))
    if source == "task":
        return TaskReader(layout=given.get("layout", "auto"), fields=fields)
    cls = JsonlReader if source == "jsonl" else ParquetReader
    return cls(text_field=given.get("text_field", "text"), fields=fields)
