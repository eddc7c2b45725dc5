"""Read documents of a corpus laid out as ``<dir>/<split>/<domain>.jsonl[.zst]`` (the bundled corpora's
layout): the raw text CRISP embeds and the multiple-choice items the accuracy metric scores."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from grape_stream.errors import DataError

__all__ = ["read_docs", "sample_texts"]


def read_docs(data: str | Path, split: str, domain: str) -> list[dict[str, Any]]:
    """Every JSON object of ``<data>/<split>/<domain>.jsonl.zst`` (or ``.jsonl``), in file order."""
    base = Path(data) / split
    for name, zst in ((f"{domain}.jsonl.zst", True), (f"{domain}.jsonl", False)):
        path = base / name
        if path.is_file():
            raw = path.read_bytes()
            if zst:
                import zstandard

                raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 31)
            return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
    raise DataError(f"no {base / domain}.jsonl.zst or .jsonl (expected <data>/<split>/<domain>.jsonl[.zst])")


def sample_texts(data: str | Path, split: str, domain: str, n: int, seed: int, *, max_chars: int = 2000) -> list[str]:
    """Up to ``n`` texts drawn without replacement (seeded); long documents are cut to a window of
    ``max_chars`` at a seeded offset, since the embedder reads only its first 256 tokens anyway."""
    docs = [d["text"] for d in read_docs(data, split, domain) if d.get("text")]
    rng = random.Random(f"{seed}/{split}/{domain}")
    pick = rng.sample(docs, min(n, len(docs)))
    out = []
    for t in pick:
        start = rng.randrange(0, max(1, len(t) - max_chars)) if len(t) > max_chars else 0
        out.append(t[start:start + max_chars])
    return out
