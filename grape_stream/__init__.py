"""grape_stream: stream per-domain MDS shards and let GRAPE adapt the mixture while training runs.

The top-level names are the public API of DESIGN.md. They are imported lazily so that
`import grape_stream` stays cheap (no torch import) for converters and the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "WeightedStreamingMixer": "grape_stream.mixing.mixer",
    "DomainStream": "grape_stream.mixing.mixer",
    "build_reweighter": "grape_stream.grape.reweighting",
    "Reweighter": "grape_stream.grape.reweighting",
    "group_gram": "grape_stream.grape.gram.group_gram",
    "GrapeController": "grape_stream.grape.controller",
    "TaskStream": "grape_stream.grape.tasks",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'grape_stream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
