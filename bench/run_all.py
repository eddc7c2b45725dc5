"""Run every benchmark in turn (what `make bench` does): each prints its table and writes its JSON.

    .venv/bin/python bench/run_all.py            # the full runs behind docs/results.md and the closing notes
                                                 # (about 1.5 hours on 2 cores; mixture_quality is most of it)
    .venv/bin/python bench/run_all.py --quick    # a smoke run of every script (~5 minutes); JSON goes to
                                                 # runs/bench-quick/ so the committed full results stay intact
    .venv/bin/python bench/run_all.py --only loader,overhead

A failing script does not stop the others; the exit code is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Bench:
    name: str
    quick: tuple[str, ...]  # arguments of the smoke run
    out_flag: str  # the script's option naming its JSON output


BENCHES = (
    Bench("convert", ("--mb", "4", "--files", "4"), "--out"),
    Bench("loader", ("--size-mb", "16", "--domains", "7", "--workers", "0", "--seconds", "2", "--no-s3"), "--out"),
    Bench("alignment", ("--small",), "--out"),
    Bench("faults", ("--quick",), "--out"),
    Bench("huge_document", ("--mb", "5"), "--out"),
    Bench("overhead", ("--quick",), "--out"),
    Bench("fsdp", ("--quick",), "--out"),
    Bench("loss_overhead", ("--quick", "--small"), "--out"),
    Bench("hf_loss_overhead", ("--quick",), "--out"),
    Bench("memory", ("--quick",), "--out"),
    Bench("install_extras", ("--quick",), "--out"),  # needs the package registry (network)
    Bench("mixture_quality", ("--seeds", "0", "--methods", "uniform,grape", "--steps", "20", "--fresh"),
          "--results"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke-run every script; results under runs/bench-quick/")
    p.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(b.name for b in BENCHES))
    args = p.parse_args(argv)
    chosen = [b for b in BENCHES if not args.only or b.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {b.name for b in BENCHES}
    if unknown:
        p.error(f"unknown bench(es) {sorted(unknown)}")
    quick_dir = ROOT / "runs" / "bench-quick"
    failed, rows = [], []
    for b in chosen:
        cmd = [sys.executable, str(HERE / f"{b.name}.py")]
        if args.quick:
            quick_dir.mkdir(parents=True, exist_ok=True)
            cmd += [*b.quick, b.out_flag, str(quick_dir / f"{b.name}.json")]
        print(f"\n=== bench/{b.name}.py {' '.join(cmd[2:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT)
        rows.append((b.name, rc, time.perf_counter() - t0))
        if rc != 0:
            failed.append(b.name)
    print("\n| bench | exit | seconds |\n|---|---|---|")
    for name, rc, secs in rows:
        print(f"| {name} | {rc} | {secs:.0f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
