"""The streaming methods grape_stream replaces, installed together.

Each replacement (``s3_session.py``: one boto3 session per process for every S3 download; ``decompress.py``: a
per-process temporary name when several jobs decompress one shard) is process-wide, idempotent and guarded by
the method's signature (``method_patch.py``). They are installed wherever streaming may first be used in a
process: the mixer's set-up, each (possibly spawned) DataLoader worker's shard reader, and a task's dataset.
"""

from __future__ import annotations

from grape_stream.streaming_compat.decompress import install_atomic_decompress
from grape_stream.streaming_compat.s3_session import install_shared_s3_session

__all__ = ["install_streaming_patches"]


def install_streaming_patches() -> None:
    """Replace every streaming method grape_stream replaces, in this process (idempotent)."""
    install_shared_s3_session()
    install_atomic_decompress()
