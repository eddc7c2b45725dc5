"""Loader throughput: the mixer with live weights vs one plain StreamingDataset vs raw shard decoding.

    python bench/loader.py [--size-mb 200] [--domains 7 20] [--workers 0 2] [--batch-sizes 32 256]
                           [--no-s3] [--seconds 12] [--repeats 2] [--quick]

Over the same MDS shards (K domains of packed ``tokens`` sequences, zstd, unequal domain sizes):

  (a) ``mixer``     WeightedStreamingMixer + mixer.dataloader(num_workers=W), new random weights every
                    ``--change-every`` batches (set_weights while the loader runs),
  (b) ``streaming`` one StreamingDataset over the K streams with fixed ``Stream(proportion=...)``
                    (streaming's own mixing) + torch DataLoader(num_workers=W),
  (c) ``raw``       read every shard file and zstd-decompress it, in W processes (1 if W=0): the limit,

from local disk starting from the compressed shards only (``local-cold``: (a) and (b) decompress like
(c)) and with the shards already decompressed by an earlier run (``local-warm``: the steady state of
a long run), then from a moto S3 server on 127.0.0.1 (fresh local cache per run: downloads
included). Reported:
samples/s and MB/s of token payload delivered (seq_len x 2 bytes per sample), steady state (the
first batch, which includes worker start-up, is excluded and reported separately), the best of
``--repeats`` passes for (a) and (c) (all passes are in the JSON), and per (storage,
workers, batch size) the ratios mixer/raw and mixer/streaming measured in the same run, with the issue's
goals (mixer >= raw/3 at batch 32, >= raw/1.5 at batch 256, >= streaming).

The issue asks for ~1 GB; the default is 200 MB because this repository's CI machine has 2 shared
cores. Use ``--size-mb 1000`` on a real machine. Writes bench/results/loader.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from common import parser, write_json


# ------------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------------
def make_data(root: Path, k: int, size_mb: float, seq_len: int, shard_mb: float, seed: int = 0) -> list[str]:
    """K domains whose sizes follow a geometric profile (the largest ~10x the smallest)."""
    from streaming import MDSWriter
    from tqdm import tqdm

    marker = root / f"k{k}_{size_mb}mb_{seq_len}_{shard_mb}.done"
    dirs = [str(root / f"k{k}" / f"d{i:02d}") for i in range(k)]
    if marker.exists():
        return dirs
    shutil.rmtree(root / f"k{k}", ignore_errors=True)
    rng = np.random.default_rng(seed)
    profile = np.geomspace(1.0, 0.1, k)
    sample_bytes = seq_len * 2
    total_samples = int(size_mb * 1e6 / sample_bytes)
    counts = np.maximum(1, (profile / profile.sum() * total_samples).astype(int))
    vocab = 50257
    # Zipf-like token ids: real token streams compress ~1.3-1.6x with zstd; uniform noise would not.
    ranks = np.arange(1, vocab + 1)
    p = 1.0 / ranks ** 1.07
    p /= p.sum()
    with tqdm(total=int(counts.sum()), desc=f"writing K={k}", unit="seq") as bar:
        for i, (d, n) in enumerate(zip(dirs, counts)):
            with MDSWriter(out=d, columns={"tokens": "ndarray:uint16"}, compression="zstd",
                           size_limit=int(shard_mb * (1 << 20))) as w:
                for start in range(0, n, 1024):
                    m = min(1024, n - start)
                    toks = rng.choice(vocab, size=(m, seq_len), p=p).astype(np.uint16)
                    toks[:, 0] = i
                    for row in toks:
                        w.write({"tokens": row})
                    bar.update(m)
    marker.write_text("ok")
    return dirs


def drop_raw(dirs: list[str]) -> None:
    """Back to the converter's output: only compressed shards (streaming decompresses on first use)."""
    for d in dirs:
        for p in Path(d).glob("shard.*.mds"):
            p.unlink()
        for p in Path(d).glob(".grape_stream_source.json"):
            p.unlink()


def warm_up(dirs: list[str]) -> None:
    """Decompress every shard next to its zip, as streaming leaves a local dataset after first use."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    for d in dirs:
        for z in Path(d).glob("shard.*.mds.zstd"):
            raw = z.with_suffix("")
            if not raw.exists():
                raw.write_bytes(dctx.decompress(z.read_bytes()))


def dir_samples(dirs: list[str]) -> list[int]:
    return [sum(s["samples"] for s in json.loads((Path(d) / "index.json").read_text())["shards"]) for d in dirs]


# ------------------------------------------------------------------------------------------------------
# (a) mixer, (b) streaming, (c) raw
# ------------------------------------------------------------------------------------------------------
def _time_loader(loader: Any, max_batches: int, seconds: float, on_batch=None) -> dict[str, float]:
    t0 = time.perf_counter()
    it = iter(loader)
    first = next(it)
    t1 = time.perf_counter()
    n, samples = 1, int(first["tokens"].shape[0])
    seq_len = int(first["tokens"].shape[1])
    for batch in it:
        n += 1
        samples += int(batch["tokens"].shape[0])
        if on_batch is not None:
            on_batch(n)
        if n >= max_batches or time.perf_counter() - t1 > seconds:
            break
    t2 = time.perf_counter()
    steady = samples - int(first["tokens"].shape[0])
    rate = steady / max(t2 - t1, 1e-9)
    return {"first_batch_s": t1 - t0, "batches": n, "samples": samples, "seconds": t2 - t1,
            "samples_per_s": rate, "mb_per_s": rate * seq_len * 2 / 1e6}


def run_mixer(doms: list, weights: np.ndarray, batch: int, workers: int, max_batches: int, seconds: float,
              change_every: int, seed: int, **kw) -> dict[str, float]:
    from grape_stream.mixing import WeightedStreamingMixer

    rng = np.random.default_rng(seed)
    with WeightedStreamingMixer(doms, weights=weights, batch_size=batch, seed=seed, **kw) as mixer:
        loader = mixer.dataloader(num_workers=workers, persistent_workers=False)
        changes = [0]

        def on_batch(n: int) -> None:
            if n % change_every == 0:
                mixer.set_weights(rng.dirichlet(np.ones(len(doms))))
                changes[0] += 1

        res = _time_loader(loader, max_batches, seconds, on_batch)
        res["weight_changes"] = changes[0]
        del loader
    return res


def run_streaming(streams_args: list[dict], weights: np.ndarray, batch: int, workers: int, max_batches: int,
                  seconds: float, seed: int, cache_limit: int | None = None) -> dict[str, float]:
    from streaming import Stream, StreamingDataset
    from torch.utils.data import DataLoader

    from grape_stream.streaming_compat.shm import release_streaming_dataset

    streams = [Stream(proportion=float(w), **a) for a, w in zip(streams_args, weights)]
    ds = StreamingDataset(streams=streams, batch_size=batch, shuffle=True, shuffle_seed=seed,
                          cache_limit=cache_limit)
    try:
        loader = DataLoader(ds, batch_size=batch, num_workers=workers)
        res = _time_loader(loader, max_batches, seconds)
        del loader
    finally:
        if hasattr(ds, "_iterator"):
            ds._iterator.exit()  # streaming's download threads must stop before its shm is released
        release_streaming_dataset(ds)
    return res


def _raw_worker(args: tuple[list[str], str | None, int]) -> tuple[int, int, int]:
    import zstandard

    files, endpoint, seq_len = args
    dctx = zstandard.ZstdDecompressor()
    client = None
    if endpoint:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint)
    raw_bytes = samples = 0
    for f in files:
        if client is not None:
            bucket, key = f[5:].split("/", 1)
            data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        else:
            with open(f, "rb") as fh:
                data = fh.read()
        raw = dctx.decompress(data)
        n = int(np.frombuffer(raw, np.uint32, count=1)[0])
        samples += n
        raw_bytes += len(raw)
    return samples, raw_bytes, len(files)


def run_raw(shard_files: list[str], workers: int, seq_len: int, seconds: float,
            endpoint: str | None = None) -> dict[str, float]:
    procs = max(1, workers)
    # Interleave so that each process gets a similar share; stop early on big inputs via a time budget
    # estimate from the first pass of a small prefix.
    chunks = [shard_files[i::procs] for i in range(procs)]
    t0 = time.perf_counter()
    if procs == 1:
        results = [_raw_worker((chunks[0], endpoint, seq_len))]
    else:
        with mp.get_context("fork").Pool(procs) as pool:
            results = pool.map(_raw_worker, [(c, endpoint, seq_len) for c in chunks])
    dt = time.perf_counter() - t0
    samples = sum(r[0] for r in results)
    rate = samples / dt
    return {"first_batch_s": 0.0, "batches": 0, "samples": samples, "seconds": dt, "samples_per_s": rate,
            "mb_per_s": rate * seq_len * 2 / 1e6, "shards": sum(r[2] for r in results)}


# ------------------------------------------------------------------------------------------------------
# S3 (moto)
# ------------------------------------------------------------------------------------------------------
class Moto:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1)
                break
            except Exception as exc:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from exc
                time.sleep(0.2)
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                           "AWS_DEFAULT_REGION": "us-east-1", "S3_ENDPOINT_URL": self.endpoint})

    def upload(self, bucket: str, dirs: list[str], prefix: str) -> list[str]:
        import boto3
        from tqdm import tqdm

        client = boto3.client("s3", endpoint_url=self.endpoint)
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        remotes = []
        files = [(d, p) for d in dirs for p in Path(d).iterdir() if p.is_file() and not p.name.startswith(".")
                 and not p.name.endswith(".mds")]
        for d, p in tqdm(files, desc="uploading to moto", unit="file"):
            client.upload_file(str(p), bucket, f"{prefix}/{Path(d).name}/{p.name}")
        for d in dirs:
            remotes.append(f"s3://{bucket}/{prefix}/{Path(d).name}")
        return remotes

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ------------------------------------------------------------------------------------------------------
#: The issue's goals: mixer >= raw / 3 at batch 32 and >= raw / 1.5 at batch 256; always >= streaming.
GOAL_RAW_FACTOR = {32: 3.0, 256: 1.5}


def _measure(method: str, storage: str, dirs: list[str], remotes: list[str] | None, shard_files: list[str],
             weights: np.ndarray, batch: int, w: int, k: int, args: argparse.Namespace, moto: Moto | None,
             data_root: Path) -> dict[str, float]:
    """One measurement of (a), (b) or (c) with the shards in the state ``storage`` asks for."""
    if storage == "local-warm":
        warm_up(dirs)
    else:
        drop_raw(dirs)
    total = sum(dir_samples(dirs))
    max_batches = total // max(batch, 1)  # at most one pass over the data
    cache = Path(tempfile.mkdtemp(prefix="bench_cache_", dir=data_root))
    try:
        if method == "raw":
            files = shard_files if remotes is None else [
                f"{remotes[dirs.index(str(Path(f).parent))]}/{Path(f).name}" for f in shard_files]
            return run_raw(files, w, args.seq_len, args.seconds,
                           endpoint=moto.endpoint if moto is not None and remotes is not None else None)
        if method == "mixer":
            from grape_stream.mixing import DomainStream

            doms = [DomainStream(f"d{i}", local=d) if remotes is None else
                    DomainStream(f"d{i}", remote=remotes[i], local=str(cache / f"d{i}")) for i, d in enumerate(dirs)]
            return run_mixer(doms, weights, batch, w, max_batches, args.seconds, args.change_every, seed=k)
        sargs = [{"local": d} if remotes is None else {"remote": remotes[i], "local": str(cache / f"d{i}")}
                 for i, d in enumerate(dirs)]
        return run_streaming(sargs, weights, batch, w, max_batches, args.seconds, seed=k)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Ratios per (K, storage, workers, batch): mixer/raw, mixer/streaming, and whether the goals hold."""
    print("\n| K | storage | W | batch | mixer samples/s | streaming samples/s | raw samples/s | mixer MB/s | "
          "mixer/raw | mixer/streaming | goal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    for k in args.domains:
        for storage in ("local-cold", "local-warm", "s3"):
            for w in args.workers:
                raw_storage = "local-cold" if storage == "local-warm" else storage
                raw = [r for r in rows if r["K"] == k and r["storage"] == raw_storage and r["workers"] == w
                       and r["method"] == "raw"]
                for batch in args.batch_sizes:
                    sel = {r["method"]: r for r in rows if r["K"] == k and r["storage"] == storage
                           and r["workers"] == w and r.get("batch_size") == batch}
                    if "mixer" not in sel or "streaming" not in sel or not raw:
                        continue
                    a, b, c = sel["mixer"], sel["streaming"], raw[0]
                    ab = a["samples_per_s"] / b["samples_per_s"]
                    ac = a["samples_per_s"] / c["samples_per_s"]
                    factor = GOAL_RAW_FACTOR.get(batch)
                    goal = (ab >= 1.0) and (factor is None or ac >= 1.0 / factor)
                    summary.append({"K": k, "storage": storage, "workers": w, "batch_size": batch,
                                    "mixer_over_raw": ac, "mixer_over_streaming": ab,
                                    "raw_over_mixer": 1.0 / ac, "goal_raw_factor": factor, "goal_met": goal})
                    print(f"| {k} | {storage} | {w} | {batch} | {a['samples_per_s']:.0f} | {b['samples_per_s']:.0f} | "
                          f"{c['samples_per_s']:.0f} | {a['mb_per_s']:.1f} | {ac:.2f} (1/{1 / ac:.1f}) | {ab:.2f}x | "
                          f"{'yes' if goal else 'NO'} |")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "loader",
                quick="a smoke run: 24 MB, K=7, 3 s per measurement (all storages, workers and batch sizes)")
    ap.add_argument("--size-mb", type=float, default=200.0, help="total token payload per K (default 200)")
    ap.add_argument("--domains", type=int, nargs="+", default=[7, 20])
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--shard-mb", type=float, default=4.0, help="MDS shard size limit")
    ap.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--seconds", type=float, default=12.0, help="time budget per measurement")
    ap.add_argument("--repeats", type=int, default=2,
                    help="raw and mixer: best of this many passes (default 2; streaming runs once)")
    ap.add_argument("--change-every", type=int, default=100, help="mixer: new weights every N batches")
    ap.add_argument("--no-s3", action="store_true", help="skip the moto S3 runs")
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "grape_stream_bench"))
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.domains, args.seconds = 24.0, [7], 3.0

    data_root = Path(args.data_dir)
    data_root.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    moto = None if args.no_s3 else Moto()
    try:
        for k in args.domains:
            dirs = make_data(data_root, k, args.size_mb, args.seq_len, args.shard_mb)
            weights = np.random.default_rng(k).dirichlet(np.ones(k))
            shard_files = sorted(str(p) for d in dirs for p in Path(d).glob("shard.*.mds.zstd"))
            storages: list[tuple[str, list[str] | None]] = [("local-cold", None), ("local-warm", None)]
            if moto is not None:
                storages.append(("s3", moto.upload("bench", dirs, f"k{k}")))
            for storage, remotes in storages:
                for w in args.workers:
                    runs = [("raw", 0)] if storage != "local-warm" else []  # warm raw = cold raw
                    runs += [(m, b) for b in args.batch_sizes for m in ("mixer", "streaming")]
                    for method, batch in runs:
                        # Best of --repeats for the two sides of the goal ratio (one pass is 0.2-1 s on two
                        # shared cores: a neighbour's burst moves it by tens of percent); streaming is
                        # 10x+ away from both, once is enough.
                        reps = [_measure(method, storage, dirs, remotes, shard_files, weights, batch, w, k, args,
                                         moto, data_root) for _ in range(1 if method == "streaming" else args.repeats)]
                        res = max(reps, key=lambda r: r["samples_per_s"])
                        res["repeats_samples_per_s"] = [r["samples_per_s"] for r in reps]
                        row = {"K": k, "storage": storage, "workers": w, "method": method,
                               "batch_size": batch or None, "load_avg_1m": os.getloadavg()[0], **res}
                        rows.append(row)
                        print(f"K={k:<3} {storage:<10} W={w} B={batch or '-':<4} {method:<10} "
                              f"{res['samples_per_s']:>10.0f} samples/s {res['mb_per_s']:>8.1f} MB/s  "
                              f"first batch {res['first_batch_s']:.2f}s", flush=True)
    finally:
        if moto is not None:
            moto.stop()

    summary = _summary(rows, args)
    meta = {"load_avg_at_end": os.getloadavg(), "size_mb": args.size_mb, "seq_len": args.seq_len,
            "shard_mb": args.shard_mb, "batch_sizes": args.batch_sizes, "seconds": args.seconds,
            "repeats": args.repeats,
            "change_every": args.change_every, "cpu_count": os.cpu_count(), "quick": args.quick,
            "goal_raw_factor": GOAL_RAW_FACTOR, "note": "2 shared cores; timings are pessimistic"}
    out = write_json(args.out, {"meta": meta, "rows": rows, "summary": summary}, indent=2)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
