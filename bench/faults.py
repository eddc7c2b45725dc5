"""Storage faults, for real: what survives errors, resets, latency and outages of an S3-compatible store.

A real moto_server on 127.0.0.1 and grape_stream.testing.FaultProxy in front of it; every client (the
mixer's StreamingDatasets, the converter's uploader) talks to the proxy through S3_ENDPOINT_URL, exactly
as to MinIO, R2 or AWS. Scenarios:

  mixer      K=2 domains uploaded once, read back through the proxy (0 and 2 DataLoader workers) under
             each fault, compared batch by batch with the same mixer over the local copy;
  converter  a jsonl corpus converted straight to s3:// through the proxy under each fault; the objects
             written are compared byte for byte with a fault-free conversion. "outage past deadline"
             runs with GRAPE_STREAM_RETRY_DEADLINE=3: the converter must stop with one error line, and
             re-running the same command after the outage must finish with the same objects.

Columns: runs, survived (no error, or for "past deadline": one clear error then a clean resume),
identical (same batches / same objects), lost and duplicated samples or documents.

    .venv/bin/python bench/faults.py [--runs 2] [--quick] [--out bench/results/faults.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import boto3
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "faults.json"
sys.path.insert(0, str(ROOT / "tests"))

from _mds_fixtures import batch_identities, write_domains  # noqa: E402  (small real MDS writer)
from grape_stream.mixing import DomainStream, WeightedStreamingMixer  # noqa: E402
from grape_stream.testing import FaultProxy  # noqa: E402

SIZES, SEQ, B, N_BATCHES = [240, 200], 64, 8, 40


def _moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/", timeout=1)
            return proc, url
        except Exception:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def _upload_dir(client: Any, bucket: str, local: str, prefix: str) -> str:
    for p in Path(local).rglob("*"):
        if p.is_file() and not p.name.startswith("."):
            client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(local).as_posix()}")
    return f"s3://{bucket}/{prefix}"


# ------------------------------------------------------------------------------------------ mixer
MIXER_FAULTS: dict[str, Callable[[FaultProxy], Callable[[int], None] | None]] = {
    "none": lambda px: None,
    "errors 25%": lambda px: px.set_faults(error_rate=0.25),
    "resets 10%": lambda px: px.set_faults(reset_rate=0.10),
    "latency 50 ms": lambda px: px.set_faults(latency=0.05),
    "outage 10 s": lambda px: (lambda i: px.outage(10.0) if i == 3 else None),
    "outage 30 s": lambda px: (lambda i: px.outage(30.0) if i == 3 else None),
}


def _mixer_run(px: FaultProxy, remotes: list[str], tmp: str, workers: int, fault: str) -> list[Any]:
    px.clear()
    hook = MIXER_FAULTS[fault](px)
    doms = [DomainStream(f"d{k}", remote=r, local=os.path.join(tmp, f"cache-{fault}-{workers}-{k}-{time.time_ns()}"))
            for k, r in enumerate(remotes)]
    got = []
    with WeightedStreamingMixer(doms, weights=[0.6, 0.4], batch_size=B, seed=5, download_retry=1) as m:
        for i, b in enumerate(m.dataloader(num_workers=workers)):
            got.append(batch_identities(b))
            if callable(hook):
                hook(i)
            if len(got) == N_BATCHES:
                break
    px.clear()
    return got


def _compare(ref: list[Any], got: list[Any]) -> tuple[bool, int, int]:
    want = collections.Counter(x for b in ref for x in b)
    have = collections.Counter(x for b in got for x in b)
    lost = sum((want - have).values())
    dup = sum((have - want).values())
    return got == ref, lost, dup


def bench_mixer(px: FaultProxy, client: Any, bucket: str, tmp: str, runs: int, faults: list[str],
                workers_list: list[int]) -> list[dict[str, Any]]:
    data = write_domains(os.path.join(tmp, "src"), SIZES, seq_len=SEQ, samples_per_shard=8)
    remotes = [_upload_dir(client, bucket, d, f"mix/d{k}") for k, d in enumerate(data)]
    with WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(data)],
                                weights=[0.6, 0.4], batch_size=B, seed=5) as m:
        ref = [batch_identities(b) for _, b in zip(range(N_BATCHES), m.dataloader())]
    rows = []
    for fault in faults:
        for workers in workers_list:
            row = {"target": "mixer", "scenario": f"{fault}, {workers} workers", "runs": 0, "survived": 0,
                   "identical": 0, "lost": 0, "duplicated": 0, "seconds": 0.0, "errors": []}
            for _ in range(runs):
                t0 = time.perf_counter()
                row["runs"] += 1
                try:
                    got = _mixer_run(px, remotes, tmp, workers, fault)
                except Exception as exc:  # noqa: BLE001 - counted as not survived
                    row["errors"].append(str(exc).splitlines()[0][:300])
                    continue
                finally:
                    row["seconds"] += time.perf_counter() - t0
                same, lost, dup = _compare(ref, got)
                row["survived"] += 1
                row["identical"] += int(same)
                row["lost"] += lost
                row["duplicated"] += dup
            rows.append(row)
            _print_row(row)
    return rows


# -------------------------------------------------------------------------------------- converter
def _corpus(path: str, docs: int = 3000) -> None:
    rng = np.random.default_rng(0)
    words = ["grape", "stream", "mixture", "domain", "weights", "probe", "alignment", "batch", "token", "shard"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(docs):
            text = " ".join(rng.choice(words, size=int(rng.integers(20, 200))))
            f.write(json.dumps({"text": f"doc {i}: {text}", "domain": f"d{i % 3}"}) + "\n")


def _objects(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            key = o["Key"][len(prefix) + 1:]
            if key in ("manifest.json", "report.json"):
                continue  # they hold timestamps / paths
            out[key] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def _convert_cli(src: str, out: str, local: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "grape_stream.cli", "convert", "jsonl", "--input", src, "--out", out,
           "--local", local, "--tokenizer", "bytes", "--seq-len", "128", "--domain-field", "domain",
           "--shard-size", "16kb", "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=900)


def bench_converter(px: FaultProxy, client: Any, bucket: str, tmp: str, runs: int) -> list[dict[str, Any]]:
    src = os.path.join(tmp, "corpus.jsonl")
    _corpus(src)
    px.clear()
    res = _convert_cli(src, f"s3://{bucket}/conv-ref", os.path.join(tmp, "stage-ref"), {})
    if res.returncode != 0:
        raise RuntimeError(f"fault-free conversion failed: {res.stderr[-500:]}")
    ref = _objects(client, bucket, "conv-ref")
    rows = []
    scenarios = {
        "errors 25%": dict(error_rate=0.25),
        "resets 10%": dict(reset_rate=0.10),
        "outage 10 s": "outage",
        "outage past deadline": "dead",
    }
    for name, fault in scenarios.items():
        row = {"target": "converter", "scenario": name, "runs": 0, "survived": 0, "identical": 0,
               "lost": 0, "duplicated": 0, "seconds": 0.0, "errors": []}
        for r in range(runs):
            row["runs"] += 1
            prefix, stage = f"conv-{len(rows)}-{r}", os.path.join(tmp, f"stage-{len(rows)}-{r}")
            t0 = time.perf_counter()
            px.clear()
            env: dict[str, str] = {}
            if isinstance(fault, dict):
                px.set_faults(**fault)
            elif fault == "outage":
                px.outage(10.0)
            else:
                env = {"GRAPE_STREAM_RETRY_DEADLINE": "3"}
                px.outage(3600.0)
            res = _convert_cli(src, f"s3://{bucket}/{prefix}", stage, env)
            ok = res.returncode == 0
            if fault == "dead":
                lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
                one_line = res.returncode != 0 and len(lines) == 1 and "error:" in lines[0]
                row["errors"].append(lines[-1][:300] if lines else "")
                px.clear()
                res = _convert_cli(src, f"s3://{bucket}/{prefix}", stage, {})  # the resume
                ok = one_line and res.returncode == 0
            elif not ok:
                row["errors"].append(res.stderr.strip().splitlines()[-1][:300] if res.stderr.strip() else "")
            row["seconds"] += time.perf_counter() - t0
            px.clear()
            if not ok:
                continue
            got = _objects(client, bucket, prefix)
            row["survived"] += 1
            row["identical"] += int(got == ref)
            row["lost"] += len(set(ref) - set(got))
            row["duplicated"] += len(set(got) - set(ref))
        rows.append(row)
        _print_row(row)
    return rows


# ------------------------------------------------------------------------------------------- main
def _print_row(r: dict[str, Any]) -> None:
    print(f"| {r['target']} | {r['scenario']} | {r['runs']} | {r['survived']} | {r['identical']} | {r['lost']} "
          f"| {r['duplicated']} | {r['seconds'] / max(1, r['runs']):.1f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2, help="runs per scenario (default 2)")
    ap.add_argument("--quick", action="store_true", help="one run, no 30 s outage, one worker setting")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    runs = 1 if args.quick else args.runs
    faults = [f for f in MIXER_FAULTS if not (args.quick and f == "outage 30 s")]
    workers = [0] if args.quick else [0, 2]
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    proc, upstream = _moto()
    print("| target | scenario | runs | survived | identical | lost | duplicated | s/run |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        with FaultProxy(upstream, seed=0) as px, tempfile.TemporaryDirectory() as tmp:
            os.environ["S3_ENDPOINT_URL"] = px.url
            client = boto3.client("s3", endpoint_url=upstream)
            client.create_bucket(Bucket="bench-faults")
            rows = bench_mixer(px, client, "bench-faults", tmp, runs, faults, workers)
            rows += bench_converter(px, client, "bench-faults", tmp, runs)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs, "rows": rows}, indent=2) + "\n")
    bad = [r for r in rows if r["survived"] != r["runs"] or r["identical"] != r["runs"]]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} scenarios: every run survived with identical output; wrote {args.out}")
    for r in bad:
        print(f"  {r['target']} / {r['scenario']}: {r['errors'][:1]}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
