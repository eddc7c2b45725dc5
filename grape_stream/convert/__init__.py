"""Corpus -> per-domain MDS shards: readers, tokenization, packing, parallel resumable units, upload.

    from grape_stream.convert import convert
    result = convert("jsonl", ["corpus/*.jsonl.zst"], "out/", domain_field="lang")

The names below are loaded on first use, so `import grape_stream.convert` (and the CLI's --help) stays
light; none of this package imports torch at module import (mosaicml-streaming, which does, is imported
inside the functions that write or merge shards).

Modules: pipeline (the sequence), plan (checks, plan.json, units), runner + unit (running units),
finalise (merged indexes, report, manifest), result, remote (object storage), progress, layout (OUT's
layout), errors, inputs (files and names), formats (jsonl/zstd/gzip/parquet iteration), records,
packing, tokenization, spark (the same on Spark), cli, readers/ (the registry of corpus readers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grape_stream.streaming_compat  # noqa: F401  # streaming's dataset zoo deferred before a writer imports streaming
from grape_stream.lazy import lazy_exports

if TYPE_CHECKING:
    from grape_stream.convert.errors import ConvertInputError, ConvertStateError
    from grape_stream.convert.layout import CONVERTER_VERSION
    from grape_stream.convert.pipeline import convert
    from grape_stream.convert.result import ConvertResult
    from grape_stream.convert.spark import convert_dataframe

_LAZY = {
    "convert": "grape_stream.convert.pipeline",
    "ConvertResult": "grape_stream.convert.result",
    "ConvertInputError": "grape_stream.convert.errors",
    "ConvertStateError": "grape_stream.convert.errors",
    "CONVERTER_VERSION": "grape_stream.convert.layout",
    "convert_dataframe": "grape_stream.convert.spark",
}

__all__ = [
    "convert", "ConvertResult", "ConvertInputError", "ConvertStateError", "CONVERTER_VERSION", "convert_dataframe",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
