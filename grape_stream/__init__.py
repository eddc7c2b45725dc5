"""grape_stream: stream per-domain MDS shards and let GRAPE adapt the mixture while training runs.

The top-level names are the public API of DESIGN.md. They are imported lazily so that
`import grape_stream` stays cheap (no torch import) for converters and the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "WeightedStreamingMixer": "grape_stream.mixer",
    "DomainStream": "grape_stream.mixer",
    "build_reweighter": "grape_stream.reweighting",
    "Reweighter": "grape_stream.reweighting",
    "group_gram": "grape_stream.alignment",
    "GrapeController": "grape_stream.controller",
    "TaskStream": "grape_stream.tasks",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'grape_stream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
