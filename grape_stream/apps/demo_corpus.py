"""The demo's corpus: find the bundled multilingual text and convert it to MDS shards once.

The conversion is reused while the corpus files and the settings are unchanged (a fingerprint is stored
beside the output), so running the demo twice converts once.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from grape_stream.atomic import atomic_write_text
from grape_stream.convert.pipeline import CONVERTER_VERSION, convert
from grape_stream.errors import DataError

__all__ = ["CONVERT_SETTINGS_FILE", "CorpusNotFoundError", "ensure_converted", "find_corpus"]

CONVERT_SETTINGS_FILE = "grape_demo_convert.json"


class CorpusNotFoundError(DataError, FileNotFoundError):
    """The demo corpus is not where it was looked for (still a FileNotFoundError)."""


def find_corpus(path: str | None = None) -> Path:
    """The bundled corpus directory (holds corpus.json): ``path``, else ./data/demo, else the repo's."""
    candidates = [Path(path)] if path else [Path("data/demo"), Path(__file__).resolve().parents[2] / "data" / "demo"]
    for c in candidates:
        if (c / "corpus.json").is_file():
            return c
    where = ", ".join(str(c) for c in candidates)
    raise CorpusNotFoundError(
        f"no demo corpus (corpus.json) at {where}; run from the repository root or pass --data DIR "
        "(scripts/build_demo_corpus.py builds it)"
    )


def _corpus_fingerprint(corpus: Path, files: Sequence[Path], seq_len: int, tokenizer: str = "bytes",
                        domain_field: str = "lang") -> dict[str, Any]:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(corpus)).encode())
        h.update(f.read_bytes())
    out = {"inputs_sha256": h.hexdigest(), "tokenizer": tokenizer, "seq_len": int(seq_len),
           "domain_field": domain_field, "split_field": "split", "converter_version": CONVERTER_VERSION}
    if Path(tokenizer).is_file():  # a retrained tokenizer.json at the same path converts again
        out["tokenizer_sha256"] = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    return out


def ensure_converted(corpus: Path, out: Path, *, seq_len: int = 256, progress: bool = True,
                     tokenizer: str = "bytes", domain_field: str = "lang") -> tuple[dict[str, Any], bool]:
    """Convert the corpus to ``out`` (OUT/<lang>/<split>/) unless it already holds this exact conversion.

    Returns (manifest, converted_now). The check is a hash of the input files plus the settings, so an
    edited corpus or another seq_len converts again (over the old output), and a finished one is reused.
    """
    files = sorted(corpus.glob("*/*.jsonl.zst"))
    if not files:
        raise CorpusNotFoundError(f"{corpus}: no <split>/<lang>.jsonl.zst files")
    want = _corpus_fingerprint(corpus, files, seq_len, tokenizer, domain_field)
    stamp = out / CONVERT_SETTINGS_FILE
    manifest_path = out / "manifest.json"
    if stamp.is_file() and manifest_path.is_file():
        try:
            have = json.loads(stamp.read_text())
        except json.JSONDecodeError:
            have = None
        if have == want:
            return json.loads(manifest_path.read_text()), False
    overwrite = out.exists() and any(out.iterdir())
    result = convert("jsonl", [str(f) for f in files], str(out), tokenizer=tokenizer, seq_len=seq_len,
                     domain_field=domain_field, split_field="split", overwrite=overwrite, progress=progress)
    atomic_write_text(stamp, json.dumps(want, indent=2))
    return result.manifest, True
