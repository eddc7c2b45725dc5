"""WeightedStreamingMixer and its parts (docs/mixer.md, "Where the code lives").

The modules, from the bottom up: ``collate`` (samples -> tensors), ``counter_rng`` (hashes, the keyed
slot permutation), ``quotas`` (a global batch's quotas; positions in closed form), ``planner`` (every
domain's position at any global batch), ``epoch_order`` (each domain's global stream), ``topology``
(which slots a rank's loader batch holds), ``weight_table`` (the schedule ring in shared memory),
``schedule`` (the switch-batch rule), ``shard_reader`` (random access to shards), ``compose`` (the
per-process batch loop), ``domains`` (declaring and opening domains), ``position`` (checkpoint state,
stats), ``probe``, ``loader`` (the counting DataLoader) and ``mixer`` (the wiring).

The public names below are imported lazily, so that importing one numpy-only part (``quotas``,
``epoch_order``) does not import torch and streaming through this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grape_stream.lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover - for IDEs and type checkers
    from grape_stream.mixing.collate import collate_samples
    from grape_stream.mixing.domains import DomainStream
    from grape_stream.mixing.loader import BatchSource, MixerDataLoader
    from grape_stream.mixing.mixer import WeightedStreamingMixer
    from grape_stream.mixing.position import STATE_FORMAT
    from grape_stream.mixing.shard_reader import DomainReadError
    from grape_stream.mixing.weight_table import ScheduleOverflow
    from grape_stream.streaming_compat.local_index import DomainUnavailableError, RemoteMismatchError

_LAZY = {
    "STATE_FORMAT": "grape_stream.mixing.position",
    "BatchSource": "grape_stream.mixing.loader",
    "DomainReadError": "grape_stream.mixing.shard_reader",
    "DomainStream": "grape_stream.mixing.domains",
    "DomainUnavailableError": "grape_stream.streaming_compat.local_index",
    "MixerDataLoader": "grape_stream.mixing.loader",
    "RemoteMismatchError": "grape_stream.streaming_compat.local_index",
    "ScheduleOverflow": "grape_stream.mixing.weight_table",
    "WeightedStreamingMixer": "grape_stream.mixing.mixer",
    "collate_samples": "grape_stream.mixing.collate",
}

__all__ = [
    "STATE_FORMAT",
    "BatchSource",
    "DomainReadError",
    "DomainStream",
    "DomainUnavailableError",
    "MixerDataLoader",
    "RemoteMismatchError",
    "ScheduleOverflow",
    "WeightedStreamingMixer",
    "collate_samples",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
