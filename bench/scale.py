"""The mixer's planning at cluster scale, simulated: 1 to 1,024 ranks x 8 DataLoader workers, no training.

No cluster is needed to check what the mixer *decides*: the plan (quotas, which samples fill which rank's
slots, which shards they lie in) is a pure function of the seed, the weight schedule and the topology.
This script runs the mixer's own planning code (``QuotaPlanner``, ``Topology``, ``rows.emission``,
``DomainOrder``; no shard is read) for K=20 domains, global batches of 1,024 samples and weights that
change every 100 batches, and reports per world size:

  lost / dup      samples of a global batch no rank read / read twice (must be 0), over every
                  ``--check-every``-th batch with *all* ranks' slices, plus the worker split of the
                  simulated ranks (every loader batch composed once) and the global walk (every batch
                  exactly G samples, each domain's positions contiguous)
  shards/1k       distinct shards one rank touches per 1,000 global batches (mean over every
                  ``--log-every``-th window of 1,000)
  node shards/1k  the same for a node of 8 ranks (one shard cache)
  GET/s/prefix    object-store GETs per second on the busiest domain prefix, all nodes together, at
                  ``--steps-per-second`` global batches per second, each node fetching each shard it
                  touches once (vs S3's documented 5,500 GET/s per prefix)
  plan us/batch   planning CPU per global batch per rank (its 8 workers together: their plans and rows,
                  not the script's bookkeeping)
  MB/worker       peak Python/numpy memory of one worker's planning state (tracemalloc)
  read amp        bytes node 0 downloads over the whole run / bytes of the samples it consumes, its cache an
                  LRU of ``--cache-gb`` per node split evenly across the K domains (as the mixer splits
                  ``cache_limit``); exact for the canonical-node stream (node 0 reads lane 0 of every
                  domain: each access checked against the cache, accesses inside one shuffle block that
                  fit the cache collapsed first); ``read_amp_global_stream`` is the stream before canonical
                  nodes (one lane read by every node), from the 1-node run and the measured fraction of
                  the stream's shards a node touches
  cache need      the largest set of shards node 0's reads keep live at once (one shuffle block of its
                  span per domain, plus a boundary shard): what ``cache_limit`` must hold to download
                  each shard once per pass
  GET/s (reads)   the same GETs, from node 0's downloads x nodes, over the run's duration

The stream is planned for ``canonical_nodes`` = the world's node count (the default): node ``p`` reads lane
``p``'s span of every domain.

Simulated ranks (to keep the run within ~20 minutes on a shared 2-core machine): ranks 0 and R-1 over all
batches (each with its 8 workers, messages and batch split exactly as ``MixerDataLoader`` makes them),
node 0's ranks (8, or all of a smaller world) over a window of ``--node-window`` batches from the middle
of the run (the planner jumps there in closed form), and every rank's slice on the checked batches. Then
one row times a resume at batch 10^6 of a K=20 run with weights changing every 100 batches (10^4 schedule
entries), real mixer, real shards: ``load_state_dict``, the first batch and the next ``state_dict``, with 0
and 2 workers (none of them grows with the step), and the saving side's ``state_dict`` and a cold ``seek``.

    .venv/bin/python bench/scale.py [--batches 100000] [--cache-gb 32] [--quick] [--out bench/results/scale.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "scale.json"
sys.path.insert(0, str(ROOT / "tests"))

from _mds_fixtures import write_domains  # noqa: E402  (small real MDS writer)
from grape_stream.mixing import DomainStream, WeightedStreamingMixer  # noqa: E402
from grape_stream.mixing.compose import message_size  # noqa: E402
from grape_stream.mixing.epoch_order import DomainOrder  # noqa: E402
from grape_stream.mixing.loader import DEFAULT_MAX_DEPTH, SAMPLES_PER_MESSAGE  # noqa: E402
from grape_stream.mixing.planner import QuotaPlanner  # noqa: E402
from grape_stream.mixing.quotas import lane_split  # noqa: E402
from grape_stream.mixing.rows import emission  # noqa: E402
from grape_stream.mixing.schedule import EffectiveSchedule  # noqa: E402
from grape_stream.mixing.topology import RankBatch, Topology  # noqa: E402

K, G, WORKERS, SEED, RANKS_PER_NODE = 20, 1024, 8, 7, 8
S3_GET_PER_PREFIX = 5500
SAMPLE_BYTES = 4096  # 4 KB a sample: 16 MB shards of 4,096 samples


def SHARD_BYTES(args: argparse.Namespace) -> int:  # noqa: N802 - a derived constant
    return SAMPLE_BYTES * args.samples_per_shard


class Stream:
    """The simulated run: K domains of different sizes (small ones wrap into many epochs) and a schedule."""

    def __init__(self, batches: int, samples_per_shard: int, every: int) -> None:
        rng = np.random.default_rng(SEED)
        sizes = np.geomspace(2e5, 2e7, K).astype(np.int64)
        self.shards = [np.full(-(-int(n) // samples_per_shard), samples_per_shard, np.int64) for n in sizes]
        for s, n in zip(self.shards, sizes):
            s[-1] -= int(s.sum() - n)  # the last shard of a domain is partial
        self.sizes = sizes
        self.schedule = EffectiveSchedule()
        for v, start in enumerate(range(0, batches, every)):
            self.schedule.add(v, start, rng.dirichlet(np.full(K, 0.7)))
        self.batches = batches

        # every shard's first id, all domains in one sorted table (domain k's ids offset by k << 40)
        self.first_ids = np.concatenate([k * (1 << 40) + np.concatenate([[0], np.cumsum(s)[:-1]])
                                         for k, s in enumerate(self.shards)])
        self.base = np.concatenate([[0], np.cumsum([len(s) for s in self.shards])[:-1]])

    def orders(self, lanes: int = 1) -> list[DomainOrder]:  # each process builds its own (caches are per process)
        return [DomainOrder(s, 1000 + k, True, lanes=lanes) for k, s in enumerate(self.shards)]

    def planner(self, lanes: int = 1) -> QuotaPlanner:
        return QuotaPlanner(seed=SEED, batch_size=G, composition="systematic", budgets=[None] * K, lanes=lanes)


class ShardLog:
    """The (window of 1,000 batches, domain, shard) keys a rank or node touched, deduplicated as they come."""

    def __init__(self, every: int = 1) -> None:
        self.every = every  # log windows 0, every, 2 * every, ...
        self.keys = np.empty(0, np.int64)
        self.pending: list[np.ndarray] = []
        self.size = 0

    def add(self, keys: np.ndarray) -> None:
        self.pending.append(keys)
        self.size += len(keys)
        if self.size > 1 << 20:
            self.merge()

    def merge(self) -> np.ndarray:
        self.keys = np.unique(np.concatenate([self.keys, *self.pending]))
        self.pending, self.size = [], 0
        return self.keys

    def per_window(self) -> float:
        """Mean distinct shards per window."""
        _, counts = np.unique(self.merge() >> 40, return_counts=True)
        return float(counts.mean())

    def per_domain(self, windows: float) -> np.ndarray:
        """(K,) distinct shards per 1,000 batches of each domain."""
        return np.bincount((self.merge() >> 32) & 0xFF, minlength=K) / windows


def per_message(batch_size: int) -> int:
    """MixerDataLoader's default batches a worker message with 8 workers (prefetch 1, depth <= 64)."""
    return max(1, min(SAMPLES_PER_MESSAGE // batch_size, (DEFAULT_MAX_DEPTH + 1) // (WORKERS + 1)))


def simulate_rank(stream: Stream, topo: Topology, first: int, last: int, shard_log: ShardLog | None = None,
                  rows_at: set[int] | None = None) -> dict[str, Any]:
    """Rank ``topo.rank``'s 8 workers compose their messages of loader batches ``first .. last - 1`` (micro=1).

    Returns the loader batches each worker composed and the rows of the batches in ``rows_at``, and adds
    the shards touched to ``shard_log``."""
    per = per_message(topo.batch_size)
    composed: list[int] = []
    rows: dict[int, np.ndarray] = {}
    cpu = 0.0  # planning only: the plans and the rows (not this script's bookkeeping)
    for w in range(WORKERS):
        orders, planner = stream.orders(topo.lanes), stream.planner(topo.lanes)
        begin, t = first, 0
        while begin < last:
            size = min(message_size(t, per, WORKERS), last - begin)
            if t % WORKERS == w:
                t0 = time.process_time()
                run = []
                for j in range(begin, begin + size):
                    plan = planner.plan(topo.global_batch(j), stream.schedule.segments)
                    run.append(RankBatch(j, plan, topo.first_slot(j), topo.ends_global_batch(j)))
                dom, ids, _ = emission(orders, SEED, topo.batch_size, G, run)
                cpu += time.process_time() - t0
                composed += [rb.batch for rb in run]
                if shard_log is not None and (begin // 1000) % shard_log.every == 0:
                    # keys: window << 40 | domain << 32 | shard
                    shard = np.searchsorted(stream.first_ids, dom * (1 << 40) + ids, side="right") - stream.base[dom]
                    win = np.repeat(np.array([rb.batch // 1000 for rb in run], np.int64), topo.batch_size)
                    shard_log.add(np.unique((win << 40) | (dom << 32) | shard))
                if rows_at:
                    for i, rb in enumerate(run):
                        if rb.batch in rows_at:
                            b = topo.batch_size
                            rows[rb.batch] = np.stack([dom[i * b:(i + 1) * b], ids[i * b:(i + 1) * b]])
            begin += size
            t += 1
    return {"composed": composed, "rows": rows, "cpu": cpu}


def check_batches(stream: Stream, world: int, batches: list[int],
                  lanes: int) -> tuple[int, int, dict[int, list[np.ndarray]]]:
    """Every rank's slice of each checked batch (one emission call per batch, all ranks' slots): samples
    lost and duplicated against the batch's samples (each lane's share of each domain); and the slices by rank."""
    orders, planner = stream.orders(lanes), stream.planner(lanes)
    b = G // world
    lost = dup = 0
    slices: dict[int, list[np.ndarray]] = {}
    for i in batches:
        plan = planner.plan(i, stream.schedule.segments)
        run = [RankBatch(i, plan, r * b, True) for r in range(world)]
        dom, ids, _ = emission(orders, SEED, b, G, run)
        got = dom.astype(np.int64) * (1 << 40) + ids
        start, share = plan.start.reshape(lanes, K), lane_split(plan.quota, lanes)
        want = np.concatenate([k * (1 << 40) + orders[k].sample_ids(int(start[c, k]), int(share[c, k]), c)[0]
                               for c in range(lanes) for k in range(K)])
        uniq = np.unique(got)
        dup += len(got) - len(uniq)
        lost += len(np.setdiff1d(want, uniq))
        slices[i] = [np.stack([dom[r * b:(r + 1) * b], ids[r * b:(r + 1) * b]]) for r in range(world)]
    return lost, dup, slices


def global_walk(stream: Stream) -> dict[str, Any]:
    """All batches planned one by one: exact G per batch, contiguous positions; the closed form agrees."""
    lanes = 128  # the canonical nodes of 1,024 ranks: lane positions are walked too
    planner = stream.planner(lanes)
    bad = 0
    prev_end = np.zeros(K * lanes, np.int64)
    t0 = time.process_time()
    for i in range(stream.batches):
        plan = planner.plan(i, stream.schedule.segments)
        bad += int(plan.quota.sum() != G) + int((plan.start != prev_end).any())
        prev_end = plan.end()
    walk_s = time.process_time() - t0
    t0 = time.perf_counter()
    jump = stream.planner(lanes)
    jump.advance_to(stream.batches, stream.schedule.segments)
    jump_s = time.perf_counter() - t0
    bad += int((jump.position != prev_end).any())
    epochs = (prev_end.reshape(lanes, K).sum(axis=0) / stream.sizes).round(2)
    return {"bad_batches": bad, "lanes": lanes, "walk_us_per_batch": 1e6 * walk_s / stream.batches,
            "closed_form_s": jump_s,
            "epochs_per_domain_min_max": [float(epochs.min()), float(epochs.max())]}


def scale_row(stream: Stream, world: int, args: argparse.Namespace, read_stream: Stream) -> dict[str, Any]:
    b = G // world
    n = stream.batches
    nodes = max(1, world // RANKS_PER_NODE)
    lanes = nodes  # canonical_nodes' default: the physical node count

    def topo(r: int) -> Topology:
        return Topology.of(r, world, b, G, lanes=lanes, nodes=nodes)

    check = list(range(0, n, args.check_every))
    lost, dup, slices = check_batches(stream, world, check, lanes)
    sampled = sorted({0, world - 1})
    shards_per_rank, cpu, split_bad = [], [], 0
    for r in sampled:
        log = ShardLog(every=args.log_every)
        out = simulate_rank(stream, topo(r), 0, n, log, set(check))
        cpu.append(out["cpu"] / n)
        split_bad += len(out["composed"]) - len(set(out["composed"])) + (n - len(set(out["composed"])))
        for i in check:  # the workers' runs hold exactly the slices computed all at once
            split_bad += int(not np.array_equal(out["rows"][i], slices[i][r]))
        shards_per_rank.append(log.per_window())
    # node 0: its ranks over a window from the middle (for worlds of 1 .. 8 the node is the whole world)
    node = ShardLog()
    lo = (n // 2) // 1000 * 1000
    hi = min(n, lo + args.node_window)
    for r in range(min(world, RANKS_PER_NODE)):
        simulate_rank(stream, topo(r), lo, hi, node)
    per_dom = node.per_domain((hi - lo) / 1000)
    get_s = nodes * per_dom * args.steps_per_second / 1000
    reads = node_reads(read_stream, lanes, int(args.cache_gb * 2 ** 30 // SHARD_BYTES(args)))
    get_reads = nodes * reads["downloads_per_domain"] * args.steps_per_second / read_stream.batches
    # memory: one worker's planning state over a stretch of batches
    tracemalloc.start()
    simulate_rank_one_worker(stream, topo(0), lo, lo + 3000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "world_size": world, "batch_size": b, "nodes": nodes, "simulated_ranks": sampled,
        "lost": lost, "duplicated": dup, "worker_split_or_slice_errors": split_bad,
        "checked_batches": len(check),
        "shards_per_rank_per_1k": float(np.mean(shards_per_rank)),
        "shards_per_node_per_1k": float(per_dom.sum()),
        "get_per_s_busiest_prefix": float(get_s.max()), "get_per_s_all_prefixes": float(get_s.sum()),
        "plan_us_per_batch_per_rank": 1e6 * float(np.mean(cpu)),
        "peak_mb_per_worker": peak / 2 ** 20,
        "canonical_nodes": lanes,
        "read_amplification": reads["amplification"],
        "downloaded_gb_per_node": reads["downloaded_samples"] * SAMPLE_BYTES / 2 ** 30,
        "consumed_gb_per_node": reads["consumed_samples"] * SAMPLE_BYTES / 2 ** 30,
        "cache_needed_gb_per_node": reads["cache_needed_shards"] * SHARD_BYTES(args) / 2 ** 30,
        "get_per_s_busiest_prefix_reads": float(get_reads.max()),
    }


def simulate_rank_one_worker(stream: Stream, topo: Topology, first: int, last: int) -> None:
    orders, planner = stream.orders(topo.lanes), stream.planner(topo.lanes)
    per = per_message(topo.batch_size)
    for j0 in range(first, last, per * WORKERS):  # worker 0's messages (full size, steady state)
        run = [RankBatch(j, planner.plan(topo.global_batch(j), stream.schedule.segments), topo.first_slot(j), True)
               for j in range(j0, min(j0 + per, last))]
        emission(orders, SEED, topo.batch_size, G, run)


def node_reads(stream: Stream, lanes: int, cache_shards: int) -> dict[str, Any]:
    """Node 0 of ``lanes`` nodes (one lane each) reads every position of lane 0 of every domain, in order:
    its downloads through an LRU cache of ``cache_shards // K`` shards per domain.

    Exact LRU, made cheap: inside one shuffle block of the lane's span the accesses are collapsed to each
    shard's first one (the block's shards stay cached while it is read when the cache holds them all, which
    ``cache_needed_shards`` checks against the cache), then the LRU runs over that sequence."""
    orders, planner = stream.orders(lanes), stream.planner(lanes)
    planner.advance_to(stream.batches, stream.schedule.segments)
    end = planner.position.reshape(lanes, K)[0]
    cap = max(1, cache_shards // K)
    downloads = np.zeros(K, np.int64)
    downloaded = consumed = need = 0
    for k in range(K):
        o, spc = orders[k], stream.shards[k]
        n_lane, bs = int(o.lane_lens[0]), o.block_size
        cache: dict[int, None] = {}
        widest = 0
        for lo in range(0, int(end[k]), 1 << 22):
            p = np.arange(lo, min(int(end[k]), lo + (1 << 22)), dtype=np.int64)
            shard = o.shard_of(o.ids_at(p, 0)[0])
            group = (p // n_lane) * (n_lane // bs + 1) + (p % n_lane) // bs  # (lane epoch, block)
            key = group * (1 << 24) + shard
            uniq, first = np.unique(key, return_index=True)
            seq = uniq[np.argsort(first)]
            counts = np.bincount(np.unique(seq >> 24, return_inverse=True)[1])
            widest = max(widest, int(counts.max()))
            for sid in (seq & ((1 << 24) - 1)).tolist():
                if sid in cache:
                    cache.pop(sid)
                else:
                    downloads[k] += 1
                    downloaded += int(spc[sid])
                    if len(cache) >= cap:
                        cache.pop(next(iter(cache)))
                cache[sid] = None
        consumed += int(end[k])
        need += widest + 1
    return {"amplification": downloaded / consumed, "downloaded_samples": downloaded, "consumed_samples": consumed,
            "downloads_per_domain": downloads, "cache_needed_shards": need, "cache_shards_per_domain": cap}


def resume_row(at: int, every: int) -> dict[str, Any]:
    """A real mixer (K=20 small local domains) resumed at global batch ``at`` with a weight change every
    ``every`` batches before it: load_state_dict, the first batch and the next state_dict, without and with
    workers. Also the writing side: a cold ``seek(at)`` (a mixer that never walked the stream: O(weight
    pieces), the one cost that grows with the step) and ``state_dict`` where the mixer stands."""
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_domains(tmp, [500 + 37 * k for k in range(K)], samples_per_shard=64)
        doms = [DomainStream(f"d{k}", local=d) for k, d in enumerate(dirs)]
        cap = 2 * (at // every) + 16
        with WeightedStreamingMixer(doms, batch_size=G, seed=3, schedule_capacity=cap) as m:
            for f in range(every, at, every):
                m.set_weights(rng.dirichlet(np.ones(K)), at_batch=f)
            t0 = time.perf_counter()
            m.seek(at)
            t1 = time.perf_counter()
            state = m.state_dict()
            t2 = time.perf_counter()
        out: dict[str, Any] = {"at_batch": at, "schedule_entries": len(state["schedule"]),
                               "anchor_batch": state["anchor"]["batch"], "cold_seek_s": t1 - t0,
                               "state_dict_s": t2 - t1}
        for workers, lanes in ((0, 1), (2, 1), (0, 128)):
            if lanes > 1:  # the stream of 128 canonical nodes (1,024 ranks), resumed on one
                with WeightedStreamingMixer(doms, batch_size=G, seed=3, schedule_capacity=cap,
                                            canonical_nodes=lanes) as m:
                    for f in range(every, at, every):
                        m.set_weights(rng.dirichlet(np.ones(K)), at_batch=f)
                    m.seek(at)
                    state = m.state_dict()
            with WeightedStreamingMixer(doms, batch_size=G, seed=3, schedule_capacity=cap) as m:
                t0 = time.perf_counter()
                m.load_state_dict(json.loads(json.dumps(state)))
                t1 = time.perf_counter()
                batch = next(iter(m.dataloader(num_workers=workers)))
                t2 = time.perf_counter()
                assert int(batch["batch_index"][0]) == at
                later = m.state_dict()
                t3 = time.perf_counter()
                assert later["batch"] == at + 1
            name = f"workers{workers}" + (f"_canonical{lanes}" if lanes > 1 else "")
            out[name] = {"load_state_dict_s": t1 - t0, "first_batch_s": t2 - t1, "total_s": t2 - t0,
                         "next_state_dict_s": t3 - t2}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=100_000)
    ap.add_argument("--worlds", default="1,8,64,512,1024")
    ap.add_argument("--samples-per-shard", type=int, default=4096, help="4096 x 4 KB samples: 16 MB shards")
    ap.add_argument("--weights-every", type=int, default=100)
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("--node-window", type=int, default=2000)
    ap.add_argument("--log-every", type=int, default=10, help="count a rank's shards in every n-th 1k window")
    ap.add_argument("--steps-per-second", type=float, default=2.0, help="global batches trained per second")
    ap.add_argument("--resume-at", type=int, default=1_000_000)
    ap.add_argument("--before", default=None, help="results of the code before canonical nodes (default: --out)")
    ap.add_argument("--read-batches", type=int, default=None,
                    help="batches of the read-amplification run (default: --batches; it is cheap: no emission)")
    ap.add_argument("--cache-gb", type=float, default=32.0, help="cache_limit per node assumed for read amplification")
    ap.add_argument("--quick", action="store_true", help="10^4 batches, worlds 1, 8, 1024; resume at 10^5")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.worlds, args.resume_at = 10_000, "1,8,1024", 100_000
    started = time.time()
    before = previous_global_stream(Path(args.before or args.out))
    stream = Stream(args.batches, args.samples_per_shard, args.weights_every)
    read_batches = args.read_batches or args.batches
    read_stream = stream if read_batches == args.batches else Stream(read_batches, args.samples_per_shard,
                                                                     args.weights_every)
    walk = global_walk(stream)
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        t0 = time.time()
        rows.append(scale_row(stream, world, args, read_stream))
        rows[-1]["wall_s"] = time.time() - t0
        print(f"world {world}: {rows[-1]}", flush=True)
    resume = resume_row(args.resume_at, args.weights_every)
    one_node = next((r["read_amplification"] for r in rows if r["nodes"] == 1), None)
    for r in rows:  # the stream before canonical nodes: every node passes through (nearly) every shard
        b = before.get(str(r["world_size"]))
        if b is not None and one_node is not None:
            b["read_amplification"] = one_node * r["nodes"] * b["shards_per_node_per_1k"] / before["1"][
                "shards_per_node_per_1k"]
        r["global_stream_before"] = b
    result = {"config": {"K": K, "global_batch_size": G, "workers_per_rank": WORKERS, "batches": args.batches,
                         "read_batches": read_batches,
                         "samples_per_shard": args.samples_per_shard, "weights_every": args.weights_every,
                         "steps_per_second": args.steps_per_second, "ranks_per_node": RANKS_PER_NODE,
                         "cache_gb_per_node": args.cache_gb, "canonical_nodes": "the node count"},
              "claims": {"read_amplification": {str(r["world_size"]): round(r["read_amplification"], 3) for r in rows},
                         "lost": sum(r["lost"] for r in rows), "duplicated": sum(r["duplicated"] for r in rows)},
              "global_walk": walk, "worlds": rows, "resume": resume, "wall_s": time.time() - started}
    print(format_table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["lost"] == r["duplicated"] == r["worker_split_or_slice_errors"] == 0 for r in rows) \
        and walk["bad_batches"] == 0 else 1


def previous_global_stream(path: Path) -> dict[str, Any]:
    """The figures of the stream before canonical nodes, per world size: from a results file written by that
    code (no ``claims``), or carried over in a newer one (``global_stream_before``)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for r in old.get("worlds", []):
        b = r if "claims" not in old else r.get("global_stream_before")
        if b:
            out[str(r["world_size"])] = {key: b[key] for key in ("shards_per_node_per_1k", "get_per_s_busiest_prefix",
                                                                 "plan_us_per_batch_per_rank") if key in b}
    return out


def format_table(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"K={c['K']} domains, global batch {c['global_batch_size']}, {c['batches']} batches, "
             f"{c['workers_per_rank']} workers/rank, {c['samples_per_shard']} samples/shard, "
             f"{c['steps_per_second']} steps/s",
             f"read amplification with a {c['cache_gb_per_node']:g} GB cache per node; before = the global stream "
             "(every node reads a slice of every batch)",
             "| ranks | nodes | lost | dup | shards/1k rank | shards/1k node (before) | read amp (before) "
             "| cache need GB/node | GET/s busiest prefix | plan us/batch/rank (before) | MB/worker |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["worlds"]:
        b = r.get("global_stream_before") or {}
        lines.append(f"| {r['world_size']} | {r['nodes']} | {r['lost']} | {r['duplicated']} | "
                     f"{r['shards_per_rank_per_1k']:.0f} | {r['shards_per_node_per_1k']:.0f} "
                     f"({b.get('shards_per_node_per_1k', float('nan')):.0f}) | {r['read_amplification']:.2f} "
                     f"({b.get('read_amplification', float('nan')):.0f}) | {r['cache_needed_gb_per_node']:.1f} | "
                     f"{r['get_per_s_busiest_prefix_reads']:.1f} vs {S3_GET_PER_PREFIX} | "
                     f"{r['plan_us_per_batch_per_rank']:.0f} ({b.get('plan_us_per_batch_per_rank', float('nan')):.0f})"
                     f" | {r['peak_mb_per_worker']:.1f} |")
    w, res = result["global_walk"], result["resume"]
    lines.append(f"global walk: {w['bad_batches']} bad batches, {w['walk_us_per_batch']:.0f} us/batch; closed form to "
                 f"batch {c['batches']}: {w['closed_form_s'] * 1e3:.1f} ms; epochs per domain "
                 f"{w['epochs_per_domain_min_max']}")
    lines.append(f"resume at batch {res['at_batch']} ({res['schedule_entries']} schedule entries): load_state_dict "
                 f"+ first batch {res['workers0']['total_s']:.2f} s (0 workers), {res['workers2']['total_s']:.2f} s "
                 f"(2 workers), {res['workers0_canonical128']['total_s']:.2f} s (128 canonical nodes, 0 workers); "
                 f"state_dict {res['state_dict_s']:.3f} s; a cold seek (a mixer that never walked "
                 f"the stream) {res['cold_seek_s']:.2f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
