"""grape_stream: stream per-domain MDS shards and let GRAPE adapt the mixture while training runs.

The names below are the public API (docs/design.md draws the map behind them). They are imported
lazily, so `import grape_stream` stays cheap for the converters and the CLI (no torch, no Composer until
a name that needs them is used); the TYPE_CHECKING block gives IDEs and mypy the real definitions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grape_stream.lazy import lazy_exports
from grape_stream.version import __version__

if TYPE_CHECKING:  # pragma: no cover - what the lazy names resolve to ("X as X": explicit re-exports)
    from grape_stream.convert import ConvertResult as ConvertResult
    from grape_stream.convert import convert as convert
    from grape_stream.grape.controller import GrapeController as GrapeController
    from grape_stream.grape.gram.group_gram import group_gram as group_gram
    from grape_stream.grape.reweighting import Reweighter as Reweighter
    from grape_stream.grape.reweighting import available_methods as available_methods
    from grape_stream.grape.reweighting import build_reweighter as build_reweighter
    from grape_stream.grape.tasks import TaskStream as TaskStream
    from grape_stream.integrations.composer import GrapeAlgorithm as GrapeAlgorithm
    from grape_stream.mixing import DomainStream as DomainStream
    from grape_stream.mixing import WeightedStreamingMixer as WeightedStreamingMixer
    from grape_stream.retry import RetryPolicy as RetryPolicy

_LAZY = {
    "WeightedStreamingMixer": "grape_stream.mixing",
    "DomainStream": "grape_stream.mixing",
    "build_reweighter": "grape_stream.grape.reweighting",
    "available_methods": "grape_stream.grape.reweighting",
    "Reweighter": "grape_stream.grape.reweighting",
    "group_gram": "grape_stream.grape.gram.group_gram",
    "GrapeController": "grape_stream.grape.controller",
    "TaskStream": "grape_stream.grape.tasks",
    "GrapeAlgorithm": "grape_stream.integrations.composer",  # needs the [composer] extra
    "convert": "grape_stream.convert",
    "ConvertResult": "grape_stream.convert",
    "RetryPolicy": "grape_stream.retry",
}

__all__ = ["__version__", *_LAZY]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

