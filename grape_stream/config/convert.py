"""What a conversion does: :class:`ConvertConfig`, the settings of ``grape-stream convert`` and ``convert()``.

The command line builds one (each flag's default and help read the field here), ``convert(config)`` takes
it, and each value travels to the step that uses it (plan, units, writers, upload). docs/converters.md
documents every option.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from grape_stream.config.fields import free

__all__ = ["ConvertConfig"]


@dataclass
class ConvertConfig:
    """One conversion: corpus files of one ``source`` layout -> per-domain MDS shards under ``out``."""

    source: str  # a reader: slimpajama | climblab | climbmix | wiki40b | jsonl | parquet | task
    inputs: list[str]  # files, globs or directories
    out: str  # a local directory, or a remote URL (s3://bucket/prefix; endpoint from S3_ENDPOINT_URL)
    # tokens and samples
    tokenizer: str = "gpt2"  # gpt2 (offline), bytes, a tokenizer.json path or a Hugging Face name
    eos_id: Optional[int] = None  # end-of-sequence id, when the tokenizer's cannot be guessed
    seq_len: int = 1024  # tokens per sample
    eos: str = "auto"  # EOS after each document: auto (unless it already ends with EOS) | always | none
    remainder: str = "drop"  # the last partial sequence of each work unit: drop | pad (with a loss_mask)
    per_example: Optional[bool] = None  # one padded sample per record (None: the reader's choice; task: on)
    # domains and splits
    holdout: Optional[float] = None  # carve a val split of this fraction per domain (train/val)
    split: Any = None  # hash splits: "train=0.8,probe=0.1,test=0.1" or {name: fraction}
    split_seed: int = 0  # seed of the hash split
    reader: dict[str, Any] = free()  # the reader's options (domain_field, text_field, ...: readers/ declare them)
    # output and execution
    workers: int = 1  # worker processes
    files_per_unit: int = 1  # input files per work unit
    compression: Optional[str] = "zstd"  # shard compression, e.g. zstd, zstd:7 (None: none)
    shard_size: Any = "64mb"  # uncompressed shard size limit (bytes, or a size such as "64mb")
    hashes: list[str] = field(default_factory=list)  # shard hashes, e.g. ["sha1", "xxh64"]
    local: Optional[str] = None  # staging / resume directory for a remote out (None: ~/.cache/grape_stream/...)
    keep_local: bool = False  # keep the staged shards after uploading them
    strict: bool = False  # stop at the first bad input, naming file and line
    text_policy: str = "repair"  # text with lone surrogates or control characters: repair | skip
    max_record_size: Any = "64mb"  # a larger record (JSON line, text) is skipped, counted as record_too_large
    overwrite: bool = False  # discard a previous conversion in out and start over
    max_examples: int = 5  # examples per bad-input kind and file in report.json
    progress: bool = True  # progress bars
