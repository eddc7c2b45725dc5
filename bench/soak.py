"""Soak: one mixer for 10^5 batches through a failing object store, killed and resumed half-way.

What a long pretraining run does to the data path, in one command:

  * K=3 domains in S3 (a real moto_server) behind grape_stream.testing.FaultProxy: random 500s and
    connection resets all run long, and two outages (``--outage`` seconds each, at 1/4 and 3/4);
  * one WeightedStreamingMixer (2 DataLoader workers, a cache_limit of about a third of the data, so
    shards are evicted and downloaded again all run long) with new weights every 100 batches;
  * the job is SIGKILLed (its whole process group, as a preempted node) half-way and started again from
    its last checkpoint (the mixer's state_dict every ``--checkpoint-every`` batches).

Reported (and written to bench/results/soak.json):

  * samples lost / duplicated: every batch compared with an uninterrupted, fault-free run of the same
    mixer over the local copy (same seed, same weight switches): both 0, and the batches identical;
  * RSS and open file descriptors of the job (main process and workers) over time, and their slope
    (a leak shows as a slope; flat means within noise of 0);
  * shared-memory segments and temp files before and after (the job's TMPDIR is its own folder);
  * the realised domain fractions against the schedule (per 100-batch segment and overall).

    .venv/bin/python bench/soak.py                      # 10^5 batches (about 10-15 min on 2 shared cores)
    .venv/bin/python bench/soak.py --batches 3000 --outage 3 --out /tmp/soak.json   # the CI test's size
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import REPO as ROOT
from common import parser, write_json

SIZES, SEQ, B, PER_SHARD = [6000, 4000, 3000], 64, 8, 100
BLOCK = 3 * PER_SHARD  # a shuffle block's shards fit in a domain's share of the cache (docs/mixer.md)


def schedule_weights(j: int, seed: int = 0) -> list[float]:
    """The weights of the j-th 100-batch segment: a Dirichlet draw keyed by (seed, j), floored at 0.05."""
    a = np.random.default_rng([seed, j]).dirichlet(np.ones(len(SIZES)))
    a = np.maximum(a, 0.05)
    return (a / a.sum()).tolist()


# ------------------------------------------------------------------------------------------ the job
def _rss_kb(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def job(cfg: dict[str, Any]) -> int:
    """Long because it is the whole training-loop stand-in: build, resume, iterate, switch, checkpoint, log."""
    from grape_stream.mixing import DomainStream, WeightedStreamingMixer

    doms = [DomainStream(f"d{k}", remote=r, local=c) for k, (r, c) in enumerate(zip(cfg["remotes"], cfg["caches"]))]
    mixer = WeightedStreamingMixer(doms, weights=schedule_weights(0), batch_size=B, seed=cfg["seed"],
                                   cache_limit=cfg["cache_limit"], retry_deadline=cfg["retry_deadline"],
                                   download_retry=1, shuffle_block_size=BLOCK)
    start = 0
    if os.path.exists(cfg["state"]):
        state = json.loads(Path(cfg["state"]).read_text())
        mixer.load_state_dict(state["mixer"])
        start = int(state["consumed"])
    inodes = []  # the segments this job created, as its owner records list them: what must not be left behind
    for p in mixer.shm_prefixes:
        try:
            inodes += json.loads(Path(f"/dev/shm/grape_stream_owner.{p:06}").read_text())["inodes"].values()
        except (OSError, ValueError, KeyError):
            pass
    print(json.dumps({"prefixes": mixer.shm_prefixes, "pid": os.getpid(), "start": start, "inodes": inodes}),
          flush=True)
    log_dir = Path(cfg["log_dir"])
    metrics = open(log_dir / "resources.jsonl", "a")
    chunk: list[np.ndarray] = []
    chunk_start, last_sample, t0 = start, 0.0, time.time()
    for batch in mixer.dataloader(num_workers=cfg["workers"]):
        i = int(batch["batch_index"][0])
        tok = np.asarray(batch["tokens"])
        chunk.append((tok[:, 0].astype(np.int64) << 32) | (tok[:, 1].astype(np.int64) + 65536 * tok[:, 2]))
        consumed = i + 1
        if consumed % cfg["change_every"] == 0:
            mixer.set_weights(schedule_weights(consumed // cfg["change_every"]))
        if consumed % cfg["checkpoint_every"] == 0 or consumed == cfg["batches"]:
            np.save(log_dir / f"ids_{chunk_start:09d}.npy", np.stack(chunk))  # the batches since the last checkpoint
            chunk, chunk_start = [], consumed
            tmp = cfg["state"] + ".tmp"
            Path(tmp).write_text(json.dumps({"mixer": mixer.state_dict(), "consumed": consumed}))
            os.replace(tmp, cfg["state"])
            print(f"PROGRESS {consumed}", flush=True)
        now = time.time()
        if now - last_sample >= 1.0:
            pids = [os.getpid(), *_children(os.getpid())]
            metrics.write(json.dumps({"t": now - t0, "batch": consumed, "pid": os.getpid(),
                                      "rss_kb": {str(p): _rss_kb(p) for p in pids},
                                      "fds": {str(p): _fds(p) for p in pids}}) + "\n")
            metrics.flush()
            last_sample = now
        if consumed >= cfg["batches"]:
            break
    Path(log_dir / "schedule.json").write_text(json.dumps(mixer.weight_history))
    metrics.close()
    mixer.close()
    return 0


# ------------------------------------------------------------------------------------------ the bench
def _run_job(cfg_path: Path, env: dict[str, str], on_progress: Any) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--job", str(cfg_path)], stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("PROGRESS"):
                on_progress(proc, int(line.split()[1]))
            elif line.startswith("{"):
                on_progress(proc, json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.reader = reader  # type: ignore[attr-defined]  # joined after the job ends: every line it printed is seen
    return proc


def _tmp_entries(job_tmp: Path) -> list[str]:
    """What the job left in its temp folder. grape_stream's own per-user folder there (``grape_stream-<uid>``:
    the default remote cache, kept across runs by design) counts by what it holds beyond that, so a killed
    run's litter inside it still shows."""
    out = []
    for name in sorted(os.listdir(job_tmp)):
        if name == f"grape_stream-{os.getuid()}":
            kept = {"cache"}
            out += [f"{name}/{inner}" for inner in sorted(os.listdir(job_tmp / name)) if inner not in kept]
        else:
            out.append(name)
    return out


def _shm_names() -> set[str]:
    from grape_stream.streaming_compat.shm import _OWNER_RE, _SHM_RE

    return {n for n in os.listdir("/dev/shm") if _SHM_RE.match(n) or _OWNER_RE.match(n)}


def _left_behind(runs: list[dict[str, Any]]) -> list[str]:
    """What the soak's jobs created in /dev/shm and is still there: their segments (by inode, as their owner
    records listed them: /dev/shm is machine-wide, and other jobs reuse prefix numbers) and owner records
    naming one of their pids."""
    inodes = {i for r in runs for i in r["inodes"]}
    pids = {r["pid"] for r in runs}
    left = []
    for name in sorted(_shm_names()):
        path = f"/dev/shm/{name}"
        try:
            if os.stat(path).st_ino in inodes:
                left.append(name)
            elif name.startswith("grape_stream_owner.") and json.loads(Path(path).read_text()).get("pid") in pids:
                left.append(name)
        except (OSError, ValueError):
            pass
    return left


def _slope(points: list[tuple[float, float]]) -> float:
    if len(points) < 3:
        return 0.0
    x, y = np.array(points, dtype=np.float64).T
    return float(np.polyfit(x, y, 1)[0])


def _resources(log_dir: Path, warmup: float = 0.2) -> dict[str, Any]:
    """Per run (before the kill, after the resume): RSS and fds of the job's processes summed, their first and
    last values and their slope per 10^4 batches (the first `warmup` of each run's batches left out: caches
    and pools filling up)."""
    rows = [json.loads(line) for line in open(log_dir / "resources.jsonl")]
    out: dict[str, Any] = {}
    for n, pid in enumerate(dict.fromkeys(r["pid"] for r in rows)):
        mine = [r for r in rows if r["pid"] == pid]
        b0, b1 = mine[0]["batch"], mine[-1]["batch"]
        steady = [r for r in mine if r["batch"] >= b0 + warmup * (b1 - b0)]
        rss = [(r["batch"] / 1e4, sum(r["rss_kb"].values()) / 1024) for r in steady]
        fds = [(r["batch"] / 1e4, sum(r["fds"].values())) for r in steady]
        out["before kill" if n == 0 else "after resume"] = {
            "batches": [b0, b1], "samples": len(mine),
            # batch, RSS MB (all processes), fds of the main process, fds of the workers
            "series": [[r["batch"], round(sum(r["rss_kb"].values()) / 1024, 1), r["fds"].get(str(pid), 0),
                        sum(r["fds"].values()) - r["fds"].get(str(pid), 0)] for r in mine],
            "rss_mb": [round(rss[0][1], 1), round(rss[-1][1], 1)] if rss else None,
            "rss_mb_per_1e4_batches": round(_slope(rss), 3),
            "fds": [fds[0][1], fds[-1][1]] if fds else None,
            "fds_per_1e4_batches": round(_slope(fds), 3),
        }
    return out


def _reference(src: list[str], n: int, schedule: list[dict[str, Any]], seed: int) -> np.ndarray:
    """The same mixer over the local copy, no workers, no faults, never killed, with the job's switches."""
    from grape_stream.mixing import DomainStream, WeightedStreamingMixer

    switches = sorted((e["from_batch"], e["alpha"]) for e in schedule if e["from_batch"] > 0)
    out = np.empty((n, B), dtype=np.int64)
    with WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(src)],
                                weights=schedule_weights(0), batch_size=B, seed=seed, shuffle_block_size=BLOCK) as m:
        j = 0
        for i, batch in enumerate(m.iter_batches()):
            while j < len(switches) and switches[j][0] <= i + 64:
                assert m.set_weights(switches[j][1], at_batch=switches[j][0]) == switches[j][0]
                j += 1
            tok = np.asarray(batch["tokens"])
            out[i] = (tok[:, 0].astype(np.int64) << 32) | (tok[:, 1].astype(np.int64) + 65536 * tok[:, 2])
            if i + 1 == n:
                break
    return out


def _fractions(ids: np.ndarray, schedule: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """Realised domain fractions against the scheduled weights, per `every`-batch segment and overall."""
    n, K = len(ids), len(SIZES)
    alpha = np.empty((n, K))
    for e in sorted(schedule, key=lambda e: e["from_batch"]):
        alpha[e["from_batch"]:] = e["alpha"]
    counts = np.stack([(ids >> 32 == k).sum(axis=1) for k in range(K)], axis=1) / B
    every = max(1, min(every, n))  # --change-every past --batches: the whole run is one segment
    segs = n // every
    real = counts[: segs * every].reshape(segs, every, K).mean(axis=1)
    want = alpha[: segs * every].reshape(segs, every, K).mean(axis=1)
    tv = 0.5 * np.abs(real - want).sum(axis=1)
    return {"segments": int(segs), "tv_mean": round(float(tv.mean()), 4), "tv_max": round(float(tv.max()), 4),
            "overall_realised": np.round(counts.mean(axis=0), 4).tolist(),
            "overall_scheduled": np.round(alpha.mean(axis=0), 4).tolist(),
            "overall_tv": round(float(0.5 * np.abs(counts.mean(axis=0) - alpha.mean(axis=0)).sum()), 5)}


def main(argv: list[str] | None = None) -> int:
    """Long because it is the scenario, step by step: data, server and proxy, two job runs with faults, checks."""
    ap = parser(__doc__, "soak")
    ap.add_argument("--batches", type=int, default=100_000)
    ap.add_argument("--change-every", type=int, default=100)
    ap.add_argument("--checkpoint-every", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--error-rate", type=float, default=0.03, help="500s injected per request (default 0.03)")
    ap.add_argument("--reset-rate", type=float, default=0.01, help="connection resets per request (default 0.01)")
    ap.add_argument("--outage", type=float, default=10.0, help="seconds of each of the two outages")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        return job(json.loads(Path(args.job).read_text()))

    import boto3
    from faults import _moto, _upload_dir

    from grape_stream.testing import FaultProxy
    from grape_stream.testing.mds import write_domains

    n, t_start = args.batches, time.time()
    os.environ.update(AWS_ACCESS_KEY_ID="soak", AWS_SECRET_ACCESS_KEY="soak", AWS_DEFAULT_REGION="us-east-1")
    proc_moto, upstream = _moto()
    try:
        with FaultProxy(upstream, seed=args.seed) as px, tempfile.TemporaryDirectory() as tmp:
            src = write_domains(os.path.join(tmp, "src"), SIZES, seq_len=SEQ, samples_per_shard=PER_SHARD)
            client = boto3.client("s3", endpoint_url=upstream)
            client.create_bucket(Bucket="soak")
            remotes = [_upload_dir(client, "soak", d, f"d{k}") for k, d in enumerate(src)]
            raw = sum(s["raw_data"]["bytes"] for d in src
                      for s in json.loads(Path(d, "index.json").read_text())["shards"])
            job_tmp = Path(tmp) / "jobtmp"
            job_tmp.mkdir()
            log_dir = Path(tmp) / "log"
            log_dir.mkdir()
            cfg = {"remotes": remotes, "caches": [os.path.join(tmp, f"cache{k}") for k in range(len(src))],
                   "seed": args.seed, "cache_limit": raw // 3, "retry_deadline": 120, "workers": args.workers,
                   "batches": n, "change_every": args.change_every, "checkpoint_every": args.checkpoint_every,
                   "state": os.path.join(tmp, "state.json"), "log_dir": str(log_dir)}
            cfg_path = Path(tmp) / "job.json"
            cfg_path.write_text(json.dumps(cfg))
            env = dict(os.environ, S3_ENDPOINT_URL=px.url, TMPDIR=str(job_tmp), PYTHONPATH=str(ROOT))
            shm_before, tmp_before = _shm_names(), _tmp_entries(job_tmp)
            px.set_faults(error_rate=args.error_rate, reset_rate=args.reset_rate, error_status=500)
            events: dict[str, Any] = {"prefixes": set(), "killed_at": None, "resumed_from": None, "outages": [],
                                      "runs": [], "last_checkpoint": {}}

            def progress(proc: subprocess.Popen, what: Any) -> None:
                if isinstance(what, dict):
                    events["prefixes"].update(what["prefixes"])
                    events["runs"].append(what)
                    if what["start"]:
                        events["resumed_from"] = what["start"]
                    return
                events["last_checkpoint"][proc.pid] = what
                if not events["outages"] and what >= n // 4:
                    events["outages"].append(what)
                    px.outage(args.outage)
                elif len(events["outages"]) == 1 and what >= 3 * n // 4:
                    events["outages"].append(what)
                    px.outage(args.outage)
                if events["killed_at"] is None and what >= n // 2:
                    events["killed_at"] = what
                    time.sleep(0.3)  # past the checkpoint: the batches since are trained again after the resume
                    os.killpg(proc.pid, signal.SIGKILL)

            first = _run_job(cfg_path, env, progress)
            first.wait(timeout=7200)
            first.reader.join(timeout=60)  # type: ignore[attr-defined]
            # The checkpoint the killed job last wrote: it may have written another while the kill was on its way
            # (the harness sleeps past the one it saw first), so it is read from all that the job printed.
            events["killed_at"] = events["last_checkpoint"].get(first.pid, events["killed_at"])
            print(f"killed (SIGKILL of its process group) after checkpoint {events['killed_at']}", flush=True)
            second = _run_job(cfg_path, env, progress)
            if second.wait(timeout=7200) != 0:
                raise RuntimeError(f"the resumed job failed with exit status {second.returncode}")
            seconds = time.time() - t_start
            time.sleep(1.0)
            left = _left_behind(events["runs"])
            tmp_after = _tmp_entries(job_tmp)
            faults = {"errors": px.stats.errors, "resets": px.stats.resets, "outages": px.stats.refused_windows,
                      "forwarded": px.stats.forwarded}
            px.clear()
            ids = np.concatenate([np.load(p) for p in sorted(log_dir.glob("ids_*.npy"))])
            schedule = json.loads((log_dir / "schedule.json").read_text())
            ref = _reference(src, n, schedule, args.seed)
            want, got = np.sort(ref.ravel()), np.sort(ids.ravel())
            lost, dup = _multiset_diff(want, got)
            result = {
                "batches": int(len(ids)), "batch_size": B, "domains": SIZES, "workers": args.workers,
                "weight_changes": len([e for e in schedule if e["from_batch"] > 0]),
                "identical_batches": bool(ids.shape == ref.shape and (ids == ref).all()),
                "samples_lost": lost, "samples_duplicated": dup,
                "killed_after_checkpoint": events["killed_at"], "resumed_from": events["resumed_from"],
                "outages_at_batch": events["outages"], "outage_seconds": args.outage, "faults": faults,
                "job_runs": [{k: r[k] for k in ("pid", "start", "prefixes")} for r in events["runs"]],
                "cache_limit_bytes": raw // 3, "data_bytes": raw,
                "resources": _resources(log_dir),
                "shm_left_behind": left, "shm_names_before": len(shm_before), "shm_names_after": len(_shm_names()),
                "tmp_entries_before": tmp_before, "tmp_entries_after": tmp_after,
                "fractions": _fractions(ids, schedule, args.change_every),
                "seconds": round(seconds, 1),
            }
    finally:
        proc_moto.terminate()
        try:
            proc_moto.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc_moto.kill()
    _print(result)
    write_json(args.out, result, indent=2, newline=True)
    ok = (result["identical_batches"] and lost == 0 and dup == 0 and not left and tmp_after == tmp_before)
    if tmp_after != tmp_before:
        print(f"temp entries before: {tmp_before}; after: {tmp_after}")
    if left:
        print(f"shm left behind: {left}")
    print(f"\n{'PASS' if ok else 'FAIL'}; wrote {args.out}")
    return 0 if ok else 1


def _multiset_diff(want: np.ndarray, got: np.ndarray) -> tuple[int, int]:
    """(samples of `want` missing from `got`, samples of `got` beyond `want`), counting repeats."""
    values = np.union1d(want, got)
    a = np.searchsorted(values, want)
    b = np.searchsorted(values, got)
    cw, cg = np.bincount(a, minlength=len(values)), np.bincount(b, minlength=len(values))
    return int(np.maximum(cw - cg, 0).sum()), int(np.maximum(cg - cw, 0).sum())


def _print(r: dict[str, Any]) -> None:
    rows = [
        ("batches (x8 samples), weight changes", f"{r['batches']}, {r['weight_changes']}"),
        ("faults: 500s, resets, outages", f"{r['faults']['errors']}, {r['faults']['resets']}, {r['faults']['outages']}"
                                          f" x {r['outage_seconds']:g} s at batches {r['outages_at_batch']}"),
        ("killed after checkpoint / resumed from", f"{r['killed_after_checkpoint']} / {r['resumed_from']}"),
        ("batches identical to a fault-free run", str(r["identical_batches"])),
        ("samples lost / duplicated", f"{r['samples_lost']} / {r['samples_duplicated']}"),
    ]
    for run, v in r["resources"].items():
        rows.append((f"RSS MB {run} (first, last; slope /1e4 batches)",
                     f"{v['rss_mb']}; {v['rss_mb_per_1e4_batches']:+.3f}"))
        rows.append((f"open fds {run} (first, last; slope /1e4 batches)",
                     f"{v['fds']}; {v['fds_per_1e4_batches']:+.3f}"))
    f = r["fractions"]
    rows += [
        ("shm segments left behind", str(len(r["shm_left_behind"]))),
        ("temp files before / after", f"{len(r['tmp_entries_before'])} / {len(r['tmp_entries_after'])}"),
        ("realised vs scheduled, per 100 batches (TV mean, max)", f"{f['tv_mean']}, {f['tv_max']}"),
        ("realised vs scheduled, overall",
         f"{f['overall_realised']} vs {f['overall_scheduled']} (TV {f['overall_tv']})"),
        ("wall time (s)", str(r["seconds"])),
    ]
    width = max(len(a) for a, _ in rows)
    print(f"| {'soak'.ljust(width)} | value |")
    print(f"|{'-' * (width + 2)}|---|")
    for a, b in rows:
        print(f"| {a.ljust(width)} | {b} |")


if __name__ == "__main__":
    raise SystemExit(main())
