"""Resident memory at every training step of a short value-benchmark run (issue 32 part 6).

``grape_steps`` (in-step alignments) once grew to 9 GB resident over the value benchmark's 400 steps. This
script trains the value benchmark's setting (``grape_stream/apps/demo_pool.py``) for ``--steps`` steps with
``alignments: steps`` (or the probe, ``--method grape``) and records, after every batch, the process's RSS,
the number of objects the cycle collector tracks, and (``--gc``) the same with ``gc.collect()`` after every
step: a growth that ``gc.collect()`` removes is memory held by reference cycles.

    .venv/bin/python bench/instep_memory.py                       # grape_steps, 96 steps, no gc
    .venv/bin/python bench/instep_memory.py --gc                  # the same with gc.collect() every step
    .venv/bin/python bench/instep_memory.py --method grape        # the probe path, for comparison
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from common import REPO, parser, result_path, write_json

RESULTS = result_path("instep_memory")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--method", choices=("grape_steps", "grape"), default="grape_steps")
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--gc", action="store_true", help="gc.collect() after every step")
    p.add_argument("--out", default=str(REPO / "runs" / "bench_value"), help="where the value benchmark's "
                   "tokenizer and MDS shards are (made here if absent)")
    p.add_argument("--data", default=str(REPO / "data" / "demo"))
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)

    import torch
    from composer.core import Callback

    from grape_stream.apps.demo_pool import DATA, MODEL, pool_settings, prepare, update_interval
    from grape_stream.apps.demo_run import run_method

    torch.set_num_threads(1)
    rows: list[tuple[int, float, int, float]] = []

    class RSS(Callback):  # type: ignore[misc]
        def batch_end(self, state: Any, logger: Any) -> None:
            if args.gc:
                gc.collect()
            rows.append((int(state.timestamp.batch), rss_mb(), len(gc.get_objects()), time.time()))

    mds, _ = prepare(Path(args.out), Path(args.data))
    every = update_interval(args.steps)
    over = ["algorithm.alignments=steps", f"algorithm.alignment_steps={every}"] if args.method == "grape_steps" else []
    settings = pool_settings(args.steps).replace(curve_every=args.steps, curve_samples=8, final_samples=8)
    with tempfile.TemporaryDirectory() as tmp:
        run_method("grape", mds=mds, out_dir=Path(tmp) / "run", settings=settings, seed=0, progress=False,
                   extra_overrides=[*MODEL, *DATA, *over], extra_callbacks=[RSS()])
    key = f"{args.method}{'_gc' if args.gc else ''}"
    first, last = rows[min(9, len(rows) - 1)], rows[-1]
    slope = (last[1] - first[1]) / max(last[0] - first[0], 1)
    print(f"{key}: RSS {first[1]:.0f} MB at step {first[0]}, {last[1]:.0f} MB at step {last[0]} "
          f"({slope:+.1f} MB/step); peak {max(r[1] for r in rows):.0f} MB")
    path = Path(args.results)
    doc = json.loads(path.read_text()) if path.is_file() else {"bench": "instep_memory", "runs": {}}
    doc["runs"][key] = {"steps": args.steps, "update_every": every, "gc_every_step": args.gc,
                        "mb_per_step_after_step_10": slope, "peak_rss_mb": max(r[1] for r in rows),
                        "per_step": [{"step": s, "rss_mb": m, "gc_objects": o} for s, m, o, _ in rows],
                        "command": "python bench/instep_memory.py " + " ".join(sys.argv[1:])}
    write_json(path, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
