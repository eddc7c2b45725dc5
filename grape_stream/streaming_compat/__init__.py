"""Workarounds for mosaicml-streaming 0.12 / 0.13 (>=0.12,<0.14) traps, kept in one guarded place.

``shm`` (shared memory and file locks: safe registration, release on close, cleanup after crashes, with
the liveness facts in ``processes``), ``local_index`` (a stale local ``index.json``, S3 without
credentials, different ``local`` directories across ranks) and ``shard_state`` (the private per-shard
bookkeeping the mixer's shard reader uses, behind a version check). Each module's docstring says which
trap it handles and why; docs/mixer.md lists them.

Importing this package defers streaming's dataset zoo (``zoo``), so it runs before any module here imports
streaming.
"""

from grape_stream.streaming_compat.zoo import defer_dataset_zoo

defer_dataset_zoo()
