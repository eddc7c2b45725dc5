"""Peak memory of converting one huge document (a 50 MB record, as web dumps and book corpora hold).

Each measurement runs in its own process (peak RSS = ru_maxrss of that process, minus its RSS after
imports): one jsonl file holding one document of --mb megabytes of varied text, converted by
`grape_stream.convert` with the gpt2 and the byte tokenizer. Before the text policy's chunked
tokenization a 50 MB document peaked at 6.75 GB (gpt2) and 1.48 GB (bytes), as reported in the issue that
asked for it (not re-measured here: the old code path is gone).

    .venv/bin/python bench/huge_document.py [--mb 50] [--out bench/results/huge_document.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

from common import parser, write_json


def _write_doc(path: str, mb: int) -> None:
    rng = random.Random(0)
    words = ["the", "data", "mixture", "adapts", "while", "training", "runs,", "GRAPE", "moves", "alpha",
             "toward", "domains", "that", "help", "targets", "1234", "x=y+z;", "naïve", "日本語", "\n"]
    parts, size = [], 0
    while size < mb * 1_000_000:
        w = rng.choice(words)
        parts.append(w)
        size += len(w) + 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": " ".join(parts)}) + "\n")


def _worker(src: str, out: str, tokenizer: str) -> dict:
    from grape_stream.convert import convert

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    res = convert("jsonl", [src], out, tokenizer=tokenizer, seq_len=1024, domain="web", progress=False)
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"tokenizer": tokenizer, "peak_rss_mb": round(peak), "extra_mb": round(peak - base),
            "seconds": round(secs, 1), "tokens": int(res.manifest["domains"]["web"]["tokens"])}


def main() -> int:
    ap = parser(__doc__, "huge_document")
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(*args.worker)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "huge.jsonl")
        _write_doc(src, args.mb)
        for tok in ("gpt2", "bytes"):
            cmd = [sys.executable, __file__, "--worker", src, os.path.join(tmp, f"out-{tok}"), tok]
            rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    print(f"\none {args.mb} MB document, converted (seq_len 1024)\n")
    print("| tokenizer | peak RSS (MB) | above imports (MB) | seconds | tokens |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokenizer']} | {r['peak_rss_mb']} | {r['extra_mb']} | {r['seconds']} | {r['tokens']} |")
    write_json(args.out, {"mb": args.mb, "rows": rows}, indent=2, newline=True)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
