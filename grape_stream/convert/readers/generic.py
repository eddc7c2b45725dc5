"""Generic readers: any JSON-lines (.jsonl, .jsonl.zst, .jsonl.gz) or parquet corpus with a text field.

The domain of a record is, in order: the value of `domain_field` (a dotted path into the record), the
fixed `domain`, or a name derived from the file's path (`fr.jsonl` -> `fr`; a file named after a
split, like `validation-00000.parquet`, takes its directory's name). `split_field` names the split of
each record (e.g. `{"split": "probe"}` -> `OUT/<domain>/probe/`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from grape_stream.convert.formats import iter_jsonl, iter_parquet_rows
from grape_stream.convert.inputs import SPLIT_WORDS, check_domain_name, strip_suffixes

from .base import DOMAIN, DOMAIN_FIELD, SPLIT_FIELD, TEXT_FIELD, BadInput, Reader, Record, get_field, register

__all__ = ["JsonlReader", "ParquetReader", "domain_from_path", "RecordFields"]


def domain_from_path(path: str) -> str:
    """`data/fr.jsonl.zst` -> `fr`; `ai2_arc/ARC-Easy/validation-00000-of-00001.parquet` -> `ARC-Easy`."""
    stem = strip_suffixes(path)
    head = stem.split("-")[0].split(".")[0]
    if head in SPLIT_WORDS or not stem:
        return os.path.basename(os.path.dirname(os.path.abspath(path)))
    return stem


@dataclass
class RecordFields:
    """Where domain and split come from (shared by the generic and task readers)."""

    domain_field: str | None = None
    domain: str | None = None
    split_field: str | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "RecordFields":
        """Take `domain`, `domain_field`, `split_field` out of a reader's options (the rest is left)."""
        return cls(
            domain_field=options.pop("domain_field", None),
            domain=options.pop("domain", None),
            split_field=options.pop("split_field", None),
        )

    def fixed_domain(self, path: str) -> str | None:
        if self.domain_field:
            return None
        return self.domain or domain_from_path(path)

    def domain_and_split(self, obj: dict, idx: int, unit: str,
                         path_domain: str | None) -> tuple[str, str | None] | BadInput:
        if self.domain_field:
            try:
                domain = get_field(obj, self.domain_field)
            except KeyError:
                return BadInput("missing_field", idx, unit, f"no domain field {self.domain_field!r}")
            if domain is None:
                return BadInput("missing_field", idx, unit, f"domain field {self.domain_field!r} is null")
            if isinstance(domain, int) and not isinstance(domain, bool):
                domain = str(domain)
        else:
            domain = path_domain
        why = check_domain_name(domain)
        if why:
            return BadInput("bad_field", idx, unit, why)
        split = None
        if self.split_field:
            try:
                split = get_field(obj, self.split_field)
            except KeyError:
                return BadInput("missing_field", idx, unit, f"no split field {self.split_field!r}")
            why = check_domain_name(split)
            if why:
                return BadInput("bad_field", idx, unit,
                                f"split field {self.split_field!r}: {why.replace('domain', 'split')}")
        return domain, split


def iter_records(path: str, columns: list[str]) -> Iterator[tuple[int, dict] | BadInput]:
    """JSON lines or parquet rows as dicts. Parquet reads only the top-level columns it needs."""
    if path.endswith(".parquet"):
        return iter_parquet_rows(path, [c for c in dict.fromkeys(columns) if c])
    return iter_jsonl(path)


class FieldsReader(Reader):
    """A reader whose domain and split come from record fields or a fixed name (`RecordFields`):
    the --domain / --domain-field / --split-field options become its `fields`."""

    fields: RecordFields

    @classmethod
    def from_options(cls, **options: Any) -> Reader:
        fields = RecordFields.from_options(options)
        return cls(fields=fields, **options)  # type: ignore[call-arg]  # subclasses are dataclasses with `fields`

    def path_domain(self, path: str) -> str | None:
        return self.fields.fixed_domain(path)


@dataclass
class _TextReader(FieldsReader):
    text_field: str = "text"
    fields: RecordFields = field(default_factory=RecordFields)

    options = (TEXT_FIELD, DOMAIN, DOMAIN_FIELD, SPLIT_FIELD)

    def describe(self) -> dict[str, Any]:
        return {"text_field": self.text_field, **vars(self.fields)}

    def read(self, path: str) -> Iterator[Record | BadInput]:
        unit = "row" if path.endswith(".parquet") else "line"
        f = self.fields
        top = [x.split(".")[0] for x in (self.text_field, f.domain_field, f.split_field) if x]
        fixed = f.fixed_domain(path)
        for item in iter_records(path, top):
            if isinstance(item, BadInput):
                yield item
                continue
            idx, obj = item
            try:
                text = get_field(obj, self.text_field)
            except KeyError:
                yield BadInput("missing_field", idx, unit, f"no {self.text_field!r} field")
                continue
            if text is None:
                yield BadInput("missing_field", idx, unit, f"{self.text_field!r} is null")
                continue
            if not isinstance(text, str):
                yield BadInput("bad_field", idx, unit, f"{self.text_field!r} is a {type(text).__name__}, not a string")
                continue
            ds = f.domain_and_split(obj, idx, unit, fixed)
            if isinstance(ds, BadInput):
                yield ds
                continue
            yield Record(idx, unit, ds[0], text=text, split=ds[1])


@register
@dataclass
class JsonlReader(_TextReader):
    source = "jsonl"
    patterns = (".jsonl", ".jsonl.zst", ".jsonl.gz")


@register
@dataclass
class ParquetReader(_TextReader):
    source = "parquet"
    patterns = (".parquet",)
