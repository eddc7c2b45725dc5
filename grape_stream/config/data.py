"""The data a run reads: the mixer's settings (:class:`MixerConfig`) and the recipe's ``data`` section.

:class:`MixerConfig` is what :class:`~grape_stream.mixing.mixer.WeightedStreamingMixer` reads (``config=``
or keyword overrides of its fields): each default is stated here and nowhere else. The recipe's
``data.mixer`` is a MixerConfig, so a misspelt key there is an unknown recipe key, not a TypeError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from grape_stream.config.choices import Composition
from grape_stream.config.fields import MISSING

__all__ = ["RETRY_DEADLINE_S", "SHUFFLE_BLOCK_SIZE", "DataConfig", "MixerConfig", "streaming_fields"]

#: How long a failing remote read or write is retried before it fails with one error: rides out a 60 s
#: outage of the object store with margin (grape_stream.retry.RetryPolicy's default).
RETRY_DEADLINE_S = 180.0

#: Samples per shuffle block of a domain's epoch order (like streaming's shuffle_block_size).
SHUFFLE_BLOCK_SIZE = 1 << 18


def _streaming(default: Any) -> Any:
    """A field passed through to every domain's StreamingDataset (the default is streaming's own)."""
    return field(default=default, metadata={"streaming": True})


@dataclass
class MixerConfig:
    """WeightedStreamingMixer's settings (docs/mixer.md; the recipe's ``data.mixer``)."""

    shuffle: bool = True  # shuffle each domain's epochs (shard-aware block shuffle); False: index order
    composition: Composition = Composition.systematic
    shuffle_block_size: int = SHUFFLE_BLOCK_SIZE
    lag: Optional[int] = None  # global batches from set_weights to the first it changes (None: the loader's depth)
    # canonical nodes: each reads its own share of every domain's shards (None: the physical node count at the
    # first start, then the checkpoint's); the physical node count must divide it or be a multiple of it
    canonical_nodes: Optional[int] = None
    schedule_capacity: int = 1024  # weight changes that may be pending in shared memory at once
    overwrite_local: bool = False  # replace a local cache directory that holds another remote's data
    s3_dummy_credentials: bool = False  # placeholder AWS credentials for an S3 endpoint without authentication
    prefetch: bool = True  # download upcoming shards in a background thread
    # seconds a failing shard download is retried (per domain: DomainStream.retry_deadline); None:
    # GRAPE_STREAM_RETRY_DEADLINE, else RETRY_DEADLINE_S
    retry_deadline: Optional[float] = None
    # passed to every StreamingDataset (streaming's defaults; the mixer's index check uses the same download ones)
    cache_limit: Any = _streaming(None)  # bytes or "10gb", split evenly across the domains (per domain: DomainStream)
    predownload: Optional[int] = _streaming(None)  # samples ahead (None: 8 * batch_size)
    download_retry: int = _streaming(2)
    download_timeout: float = _streaming(60.0)
    validate_hash: Optional[str] = _streaming(None)
    keep_zip: bool = _streaming(False)
    allow_unsafe_types: bool = _streaming(False)


def streaming_fields() -> tuple[str, ...]:
    """The MixerConfig fields that are StreamingDataset arguments."""
    from dataclasses import fields

    return tuple(f.name for f in fields(MixerConfig) if f.metadata.get("streaming"))


@dataclass
class DataConfig:
    """The recipe's ``data`` section: where the converted domains and tasks are, and the mixer's settings."""

    remote: Optional[str] = None  # base URL of the converted domains: <remote>/<domain> (s3://... uses S3_ENDPOINT_URL)
    local: Optional[str] = None  # base directory: the data itself when remote is None, else the download cache
    split: Optional[str] = "train"  # domain split directory (None: <domain>/index.json)
    seq_len: Optional[int] = None  # None: from the manifest
    domains: list[Any] = MISSING  # names, or mappings {name, remote, local, split}
    tasks: list[Any] = field(default_factory=list)  # names, or mappings {name, remote, local, split, test_split}
    task_remote: Optional[str] = None  # base URL of the converted tasks (default: data.remote)
    task_local: Optional[str] = None  # base directory of the tasks (default: data.local)
    task_probe_split: str = "validation"  # what GRAPE probes (the paper: each task's validation set)
    task_test_split: str = "test"  # what evaluation reads (never the probe split)
    num_workers: int = 0  # DataLoader workers for training
    batches_per_message: Optional[int] = None  # batches a worker sends at once (None: 512 // batch size, capped)
    mixer: MixerConfig = field(default_factory=MixerConfig)
    eval_batch_size: int = 16
    eval_num_workers: int = 0
    # the tokenizer the data was converted with (a tokenizer.json path or a name): read only by alpha0: crisp
    # (None: the manifest's, when it names gpt2 or bytes; a path or hub name from the data is never opened)
    tokenizer: Optional[str] = None
