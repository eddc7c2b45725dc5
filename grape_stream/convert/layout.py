"""Where a conversion puts things under OUT, and the version stamped on what it writes.

    OUT/manifest.json, OUT/report.json
    OUT/<domain>[/<split>]/index.json, OUT/<domain>[/<split>]/<unit>/shard.*.mds.zstd
    OUT/.grape_convert/{plan.json, units/<unit>.json, domains/<domain>.json}   (resume state)

Shared by the single-machine pipeline and the Spark path, so both write the same layout.
"""

from __future__ import annotations

import os

__all__ = ["STATE_DIR", "CONVERTER_VERSION", "MANIFEST_FORMAT", "dataset_dir", "remote_dir"]

STATE_DIR = ".grape_convert"
CONVERTER_VERSION = 1
MANIFEST_FORMAT = "grape_stream.convert"  # manifest.json "format": a data contract, unchanged by the re-layout


def dataset_dir(root: str, domain: str, split: str | None) -> str:
    """Local directory of one (domain, split) dataset."""
    return os.path.join(root, domain, split) if split else os.path.join(root, domain)


def remote_dir(root: str, domain: str, split: str | None) -> str:
    """Remote URL of one (domain, split) dataset (always "/"-joined)."""
    return "/".join([root.rstrip("/"), domain] + ([split] if split else []))
