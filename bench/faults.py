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

  object store  what a big cluster's store adds, for both: sustained 503 SlowDown on one domain's prefix
             (must say so in exactly one line for the whole job, workers included) and credentials rotated
             mid-run (a credential_process whose key changes while the proxy starts refusing the old one:
             the next requests must use the new key, with credentials looked up about once per process).

Converter rows run with 2 workers: 20% injected 500s, resets, outages of 10 s and 30 s starting mid-run
(after the first uploads), an outage past the deadline, SlowDown, rotation.

Columns: runs, survived (no error, or for "past deadline": one clear error then a clean resume; for
SlowDown also exactly one warning line, for rotation also a bounded number of credential lookups),
identical (same batches / same objects), lost and duplicated samples or documents.

    .venv/bin/python bench/faults.py [--runs 2] [--quick] [--only mixer,store,converter] [--out ...]
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import boto3
import numpy as np
from common import REPO as ROOT
from common import parser, write_json

sys.path.insert(0, str(ROOT / "tests"))

from _mds_fixtures import batch_identities, write_domains  # noqa: E402  (small real MDS writer)
from grape_stream.mixing import DomainStream, WeightedStreamingMixer  # noqa: E402
from grape_stream.testing import FaultProxy  # noqa: E402
from grape_stream.testing.credentials import RotatingCredentials  # noqa: E402

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
                workers_list: list[int]) -> tuple[list[dict[str, Any]], list[str], list[Any]]:
    data = write_domains(os.path.join(tmp, "src"), SIZES, seq_len=SEQ, samples_per_shard=8)
    remotes = [_upload_dir(client, bucket, d, f"mix/d{k}") for k, d in enumerate(data)]
    with WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(data)],
                                weights=[0.6, 0.4], batch_size=B, seed=5) as m:
        ref = [batch_identities(b) for _, b in zip(range(N_BATCHES), m.dataloader())]
    rows = []
    for fault in faults:
        for workers in workers_list:
            row = _row("mixer", f"{fault}, {workers} workers")
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
    return rows, remotes, ref


# ---------------------------------------------------------------------------------- object store
_MIXER_JOB = """
import json, sys
sys.path.insert(0, {tests!r})
from _mds_fixtures import batch_identities
from grape_stream.mixing import DomainStream, WeightedStreamingMixer
remotes, caches = json.loads(sys.argv[1]), json.loads(sys.argv[2])
doms = [DomainStream(f"d{{k}}", remote=r, local=c) for k, (r, c) in enumerate(zip(remotes, caches))]
got = []
with WeightedStreamingMixer(doms, weights=[0.6, 0.4], batch_size={b}, seed=5, download_retry=1) as m:
    for batch in m.dataloader(num_workers=2, batches_per_message=1):
        got.append(batch_identities(batch))
        if len(got) == {n}:
            break
print(json.dumps(got))
""".format(tests=str(ROOT / "tests"), b=B, n=N_BATCHES)
SAID = "is throttling requests"


def _rotate_after(px: FaultProxy, creds: RotatingCredentials, requests: int) -> Callable[[], None]:
    """Start a thread that rotates the key once `requests` were signed with the first one; returns stop()."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set() and px.stats.keys[creds.key] < requests:
            time.sleep(0.01)
        if stop.is_set():
            return
        old, new = creds.key, creds.key + "-NEXT"
        px.accept_keys({old, new})  # a provider's rotation: the new key works first,
        creds.rotate(new)  # then lookups hand it out,
        px.accept_keys({new})  # then the old key is refused

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lambda: (stop.set(), t.join())  # type: ignore[func-returns-value]


def _setup_store_fault(px: FaultProxy, kind: str, prefix: str, tmp: str) -> tuple[dict[str, Any], Any]:
    """(environment for the job, credentials or None) with the object-store fault `kind` armed."""
    if kind == "slowdown":
        px.slow_down(prefix, rate=0.6)
        return {}, None
    creds = RotatingCredentials(os.path.join(tmp, f"creds-{time.time_ns()}"), key=f"KEY-{time.time_ns()}")
    px.accept_keys({creds.key})
    return dict(creds.env()), creds


def _store_verdict(kind: str, stderr: str, creds: Any, processes: int, row: dict[str, Any]) -> bool:
    """The scenario's own condition: one warning line (SlowDown), or a rotation used with few lookups."""
    if kind == "slowdown":
        said = sum(SAID in line for line in stderr.splitlines())
        row["notes"].append(f"warning lines: {said}")
        return said == 1
    lookups = creds.lookups()
    row["notes"].append(f"credential lookups: {len(lookups)} by {len({p for p, _ in lookups})} processes")
    return len({k for _, k in lookups}) == 2 and len(lookups) <= 2 * processes + 2


def bench_store_mixer(px: FaultProxy, remotes: list[str], ref: list[Any], tmp: str, runs: int) -> list[dict[str, Any]]:
    rows = []
    bucket = remotes[0][len("s3://"):].split("/")[0]
    for kind, name in (("slowdown", "SlowDown 60% on d0's prefix, 2 workers"),
                       ("rotation", "credentials rotated mid-run, 2 workers")):
        row = _row("mixer", name)
        for r in range(runs):
            row["runs"] += 1
            px.clear()
            env, creds = _setup_store_fault(px, kind, f"{bucket}/mix/d0", tmp)
            stop = _rotate_after(px, creds, 40) if creds else None
            caches = [os.path.join(tmp, f"store-{kind}-{r}-{k}-{time.time_ns()}") for k in range(len(remotes))]
            t0 = time.perf_counter()
            # its own process group, as a launched job is: "said once per job" is per process group, and this
            # bench's own process has said the earlier rows' throttling (injected 503s) for the same prefixes
            res = subprocess.run([sys.executable, "-c", _MIXER_JOB, json.dumps(remotes), json.dumps(caches)],
                                 capture_output=True, text=True, timeout=900, env=_env(env), start_new_session=True)
            if stop:
                stop()
            row["seconds"] += time.perf_counter() - t0
            px.clear()
            if res.returncode != 0:
                row["errors"].append(res.stderr.strip().splitlines()[-1][:300] if res.stderr.strip() else "")
                continue
            got = [[tuple(x) for x in b] for b in json.loads(res.stdout)]
            same, lost, dup = _compare(ref, got)
            row["survived"] += int(_store_verdict(kind, res.stderr, creds, 3, row))
            row["identical"] += int(same)
            row["lost"] += lost
            row["duplicated"] += dup
        rows.append(row)
        _print_row(row)
    return rows


def _env(extra: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _row(target: str, scenario: str) -> dict[str, Any]:
    return {"target": target, "scenario": scenario, "runs": 0, "survived": 0, "identical": 0, "lost": 0,
            "duplicated": 0, "seconds": 0.0, "errors": [], "notes": []}


# -------------------------------------------------------------------------------------- converter
def _corpus(folder: str, docs: int = 3000, files: int = 6) -> None:
    """`docs` documents of three domains in `files` jsonl files (units: both conversion workers busy)."""
    rng = np.random.default_rng(0)
    words = ["grape", "stream", "mixture", "domain", "weights", "probe", "alignment", "batch", "token", "shard"]
    os.makedirs(folder, exist_ok=True)
    outs = [open(os.path.join(folder, f"part{k}.jsonl"), "w", encoding="utf-8") for k in range(files)]
    for i in range(docs):
        text = " ".join(rng.choice(words, size=int(rng.integers(20, 200))))
        outs[i % files].write(json.dumps({"text": f"doc {i}: {text}", "domain": f"d{i % 3}"}) + "\n")
    for f in outs:
        f.close()


def _objects(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            key = o["Key"][len(prefix) + 1:]
            if key in ("manifest.json", "report.json"):
                continue  # they hold the input's path: compared by _manifest
            out[key] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def _manifest(client: Any, bucket: str, prefix: str) -> dict[str, Any] | None:
    """The conversion's manifest.json less the input's path (a run's own), or None when there is none."""
    try:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read()
    except client.exceptions.NoSuchKey:
        return None
    manifest = json.loads(body)
    manifest.pop("input_root", None)
    return manifest


def _convert_cli(src: str, out: str, local: str, env: dict[str, Any]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "grape_stream.cli", "convert", "jsonl", "--input", src, "--out", out,
           "--local", local, "--tokenizer", "bytes", "--seq-len", "128", "--domain-field", "domain",
           "--shard-size", "16kb", "--no-progress", "--workers", "2", "--files-per-unit", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(env), timeout=900,
                          start_new_session=True)  # a job of its own (see bench_store_mixer)


#: converter scenarios: proxy faults, an outage (seconds) starting after the first OUTAGE_AFTER requests
#: (the bucket check and the first units' uploads; a fault-free run makes ~320), "dead"
#: (an outage past a 3 s deadline, then the same command again), or an object-store fault (see above)
OUTAGE_AFTER = 40
CONVERTER_FAULTS: dict[str, Any] = {
    "500s 20%, 2 workers": dict(error_rate=0.20, error_status=500),
    "errors 25% (503), 2 workers": dict(error_rate=0.25),
    "resets 10%, 2 workers": dict(reset_rate=0.10),
    "outage 10 s mid-run, 2 workers": 10.0,
    "outage 30 s mid-run, 2 workers": 30.0,
    "outage past deadline": "dead",
    "SlowDown 60% on d0's prefix, 2 workers": "slowdown",
    "credentials rotated mid-run, 2 workers": "rotation",
}


def _convert_once(px: FaultProxy, src: str, bucket: str, prefix: str, stage: str, fault: Any, tmp: str,
                  row: dict[str, Any]) -> bool:
    """One conversion under `fault`; whether it survived by the scenario's own rule."""
    px.clear()
    env: dict[str, Any] = {}
    creds, stop = None, None
    # the proxy's counters run over the whole bench (the mixer's outages come first): this run's are deltas
    windows0, forwarded0 = px.stats.refused_windows, px.stats.forwarded
    if isinstance(fault, dict):
        px.set_faults(**fault)
    elif isinstance(fault, float):
        px.outage_after(OUTAGE_AFTER, fault)
    elif fault == "dead":
        env = {"GRAPE_STREAM_RETRY_DEADLINE": "3"}
        px.outage(3600.0)
    else:
        env, creds = _setup_store_fault(px, fault, f"{bucket}/{prefix}/d0", tmp)
        stop = _rotate_after(px, creds, 30) if creds else None
    res = _convert_cli(src, f"s3://{bucket}/{prefix}", stage, env)
    if stop:
        stop()
    if fault == "dead":
        lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
        one_line = res.returncode != 0 and len(lines) == 1 and "error:" in lines[0]
        row["errors"].append(lines[-1][:300] if lines else "")
        px.clear()
        res = _convert_cli(src, f"s3://{bucket}/{prefix}", stage, {})  # the resume
        return one_line and res.returncode == 0
    if res.returncode != 0:
        row["errors"].append(res.stderr.strip().splitlines()[-1][:300] if res.stderr.strip() else "")
        return False
    if isinstance(fault, float):
        # mid-run: it started after request OUTAGE_AFTER, and the conversion went on uploading after it
        windows, after = px.stats.refused_windows - windows0, px.stats.forwarded - forwarded0 - OUTAGE_AFTER
        row["notes"].append(f"outages: {windows}, requests after it started: {after}")
        if windows != 1 or after <= 0:
            return False
    if fault in ("slowdown", "rotation"):
        return _store_verdict(fault, res.stderr, creds, 3, row)
    return True


def bench_converter(px: FaultProxy, client: Any, bucket: str, tmp: str, runs: int,
                    scenarios: list[str]) -> list[dict[str, Any]]:
    src = os.path.join(tmp, "corpus")
    _corpus(src)
    px.clear()
    res = _convert_cli(src, f"s3://{bucket}/conv-ref", os.path.join(tmp, "stage-ref"), {})
    if res.returncode != 0:
        raise RuntimeError(f"fault-free conversion failed: {res.stderr[-500:]}")
    ref, ref_manifest = _objects(client, bucket, "conv-ref"), _manifest(client, bucket, "conv-ref")
    rows = []
    for name in scenarios:
        row = _row("converter", name)
        for r in range(runs):
            row["runs"] += 1
            prefix, stage = f"conv-{len(rows)}-{r}", os.path.join(tmp, f"stage-{len(rows)}-{r}")
            t0 = time.perf_counter()
            ok = _convert_once(px, src, bucket, prefix, stage, CONVERTER_FAULTS[name], tmp, row)
            row["seconds"] += time.perf_counter() - t0
            px.clear()
            if not ok:
                continue
            got, manifest = _objects(client, bucket, prefix), _manifest(client, bucket, prefix)
            if manifest != ref_manifest:
                row["notes"].append("manifest differs" if manifest else "no manifest")
            row["survived"] += 1
            row["identical"] += int(got == ref and manifest == ref_manifest)
            row["lost"] += len(set(ref) - set(got))
            row["duplicated"] += len(set(got) - set(ref))
        rows.append(row)
        _print_row(row)
    return rows


# ------------------------------------------------------------------------------------------- main
def _print_row(r: dict[str, Any]) -> None:
    print(f"| {r['target']} | {r['scenario']} | {r['runs']} | {r['survived']} | {r['identical']} | {r['lost']} "
          f"| {r['duplicated']} | {r['seconds'] / max(1, r['runs']):.1f} | {'; '.join(r['notes'])} |", flush=True)


def main() -> int:
    ap = parser(__doc__, "faults", quick="one run, no 30 s outage, one worker setting")
    ap.add_argument("--runs", type=int, default=2, help="runs per scenario (default 2)")
    ap.add_argument("--only", default="mixer,store,converter", help="row groups to run (default: all)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    runs = 1 if args.quick else args.runs
    faults = [f for f in MIXER_FAULTS if not (args.quick and f == "outage 30 s")]
    workers = [0] if args.quick else [0, 2]
    conv = [f for f in CONVERTER_FAULTS if not (args.quick and "30 s" in f)]
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    proc, upstream = _moto()
    print("| target | scenario | runs | survived | identical | lost | duplicated | s/run | notes |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        with FaultProxy(upstream, seed=0) as px, tempfile.TemporaryDirectory() as tmp:
            os.environ["S3_ENDPOINT_URL"] = px.url
            client = boto3.client("s3", endpoint_url=upstream)
            client.create_bucket(Bucket="bench-faults")
            rows, remotes, ref = bench_mixer(px, client, "bench-faults", tmp, runs,
                                             faults if "mixer" in only else ["none"], workers)
            if "store" in only:
                rows += bench_store_mixer(px, remotes, ref, tmp, runs)
            if "converter" in only:
                rows += bench_converter(px, client, "bench-faults", tmp, runs, conv)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    write_json(args.out, {"runs": runs, "rows": rows}, indent=2, newline=True)
    bad = [r for r in rows if r["survived"] != r["runs"] or r["identical"] != r["runs"]]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} scenarios: every run survived with identical output; wrote {args.out}")
    for r in bad:
        print(f"  {r['target']} / {r['scenario']}: {r['errors'][:1]}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
