"""wiki40b reader: per-language parquet `<lang>/{train,validation,test}-*.parquet` (`wikidata_id`,
`text`, `version_id`); the language directory is the domain.

The text carries structure markers: `\\n_START_ARTICLE_\\n<title>\\n_START_SECTION_\\n<title>\\n
_START_PARAGRAPH_\\n<text>` with `_NEWLINE_` inside paragraphs. `markers="strip"` (default) turns an
article into plain text: title, section titles and paragraphs as blocks separated by a blank line,
`_NEWLINE_` as a newline. `markers="keep"` passes the text through verbatim.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator

from grape_stream.convert.formats import iter_parquet_rows
from grape_stream.convert.inputs import check_domain_name, split_from_path

from .base import DOMAIN, SPLIT_FROM_PATH, BadInput, Reader, ReaderOption, Record, register

__all__ = ["Wiki40bReader", "strip_markers"]

_MARKERS = frozenset({"_START_ARTICLE_", "_START_SECTION_", "_START_PARAGRAPH_"})


def strip_markers(text: str) -> str:
    """Plain text of a wiki40b article (see the module docstring for the exact rule)."""
    blocks = []
    for line in text.split("\n"):
        if line.strip() in _MARKERS:
            continue
        block = line.replace("_NEWLINE_", "\n").strip()
        if block:
            blocks.append(block)
    return "\n\n".join(blocks)


MARKERS = ReaderOption(
    "markers", "--markers", "wiki40b structure markers: strip (_NEWLINE_ -> newline) or keep verbatim",
    default="strip", choices=("strip", "keep"),
)


@register
@dataclass
class Wiki40bReader(Reader):
    markers: str = "strip"
    domain: str | None = None
    split_from_path: bool = False
    source = "wiki40b"
    patterns = (".parquet",)
    options = (MARKERS, DOMAIN, SPLIT_FROM_PATH)

    def __post_init__(self) -> None:
        if self.markers not in ("strip", "keep"):
            raise ValueError(f"markers must be 'strip' or 'keep', got {self.markers!r}")

    def path_domain(self, path: str) -> str:
        return self.domain or os.path.basename(os.path.dirname(os.path.abspath(path)))

    def describe(self) -> dict[str, Any]:
        return {"markers": self.markers, "domain": self.domain, "split_from_path": self.split_from_path}

    def read(self, path: str) -> Iterator[Record | BadInput]:
        domain = self.path_domain(path)
        why = check_domain_name(domain)
        if why:
            yield BadInput("bad_field", None, "row", f"language directory as domain: {why}", fatal=True)
            return
        split = split_from_path(path) if self.split_from_path else None
        if self.split_from_path and split is None:
            yield BadInput("bad_field", None, "row",
                           f"--split-from-path: file name {os.path.basename(path)} names no split", fatal=True)
            return
        for item in iter_parquet_rows(path, ["text"]):
            if isinstance(item, BadInput):
                yield item
                continue
            idx, row = item
            text = row.get("text")
            if text is None:
                yield BadInput("missing_field", idx, "row", "'text' is null")
                continue
            if isinstance(text, bytes):
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield BadInput("non_utf8", idx, "row", f"'text' is not valid UTF-8 at byte {e.start}")
                    continue
            if not isinstance(text, str):
                yield BadInput("bad_field", idx, "row", f"'text' is a {type(text).__name__}")
                continue
            if self.markers == "strip":
                text = strip_markers(text)
            yield Record(idx, "row", domain, text=text, split=split)
