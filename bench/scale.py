"""The mixer's planning at cluster scale, simulated: 1 to 1,024 ranks, 8 a node, no training.

No cluster is needed to check what the mixer *decides*: which samples fill which rank's slots and which
shards they lie in is a pure function of the seed, the weight schedule, the canonical node count and the
topology. This script runs the mixer's own planning code (``QuotaPlanner``, ``Topology``, ``rows.emission``,
``DomainOrder``; no shard is read) for K=20 domains, global batches of 1,024 samples and weights that change
every 100 batches, over ``--batches`` (10^5) global batches, and reports per world size, for the stream
*after* canonical nodes (``canonical_nodes`` = the node count, the default) and *before* them (``C = 1``:
byte for byte the stream of the code before canonical nodes, every node reading a slice of every batch):

  lost / dup      samples of a global batch no rank read / read twice (must be 0), over every
                  ``--check-every``-th batch with *all* ranks' slices; plus node 0's rows (below) against
                  its ranks' slices, and 8 workers' split of ranks 0 and R-1 over ``--split-batches``
                  (every loader batch composed once, the rows those of the slices)
  read amp        bytes node 0 downloads over the whole run / bytes of the samples it consumes: its rows
                  of every batch (``scale_reads.node_pass``) through an exact LRU cache of ``--cache-gb`` per
                  node split evenly across the K domains (as the mixer splits ``cache_limit``)
  shards/1k       distinct shards node 0 (one shard cache) and one of its ranks touch per 1,000 batches
  cache need      the shards the node's reads keep live at once (one shuffle block per domain + 1): what
                  ``cache_limit`` must hold to download each shard once per pass (``scale_reads.lane_walk``;
                  the stream before canonical nodes: its one global lane, which every node walks through)
  GET/s           object-store GETs a second on the busiest domain prefix, all nodes together (node 0's
                  downloads x nodes), at ``--steps-per-second`` global batches a second (S3: 5,500)
  MB/worker       peak Python/numpy memory of one worker's planning state (tracemalloc)

Then planning CPU per batch per rank and resume time at batch 10^6 (``bench/scale_plan.py``), run in fresh
processes for this tree and, with ``--base-tree``, for a checkout of the code before canonical nodes, or
read from their JSON (``--plan`` / ``--plan-before``; several files: the least of each figure).

    .venv/bin/python bench/scale.py [--batches 100000] [--cache-gb 32] [--base-tree /tmp/base] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from scale_plan import RANKS_PER_NODE, SEED, WORKERS, G, K, Stream, topology, worker_runs
from scale_reads import lane_walk, node_pass

from grape_stream.mixing.rows import emission
from grape_stream.mixing.topology import RankBatch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "scale.json"
S3_GET_PER_PREFIX = 5500
SAMPLE_BYTES = 4096  # 4 KB a sample: 16 MB shards of 4,096 samples


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
        start, share = plan.start.reshape(lanes, K), plan.split()
        want = np.concatenate([k * (1 << 40) + orders[k].sample_ids(int(start[c, k]), int(share[c, k]), c)[0]
                               for c in range(lanes) for k in range(K)])
        uniq = np.unique(got)
        dup += len(got) - len(uniq)
        lost += len(np.setdiff1d(want, uniq))
        slices[i] = [np.stack([dom[r * b:(r + 1) * b], ids[r * b:(r + 1) * b]]) for r in range(world)]
    return lost, dup, slices


def split_errors(stream: Stream, world: int, lanes: int, batches: int, slices: dict[int, list[np.ndarray]]) -> int:
    """Ranks 0 and R-1's 8 workers over loader batches ``[0, batches)`` as ``MixerDataLoader`` splits them:
    batches composed twice or never, and checked batches whose rows differ from the slice."""
    bad = 0
    for r in sorted({0, world - 1}):
        topo = topology(r, world, lanes)
        state = {w: (stream.orders(lanes), stream.planner(lanes)) for w in range(WORKERS)}
        composed: list[int] = []
        for w, js in worker_runs(topo, 0, batches):
            orders, planner = state[w]
            run = [RankBatch(j, planner.plan(j, stream.schedule.segments), topo.first_slot(j), True) for j in js]
            dom, ids, _ = emission(orders, SEED, topo.batch_size, G, run)
            composed += js
            for n, j in enumerate(js):
                if j in slices:
                    rows = slice(n * topo.batch_size, (n + 1) * topo.batch_size)
                    bad += int(not np.array_equal(np.stack([dom[rows], ids[rows]]), slices[j][r]))
        bad += len(composed) - len(set(composed)) + (batches - len(set(composed)))
    return bad


def worker_memory_mb(stream: Stream, world: int, lanes: int, first: int, last: int) -> float:
    """Peak traced memory of worker 0 of rank 0 planning its messages of ``[first, last)``."""
    topo = topology(0, world, lanes)
    orders, planner = stream.orders(lanes), stream.planner(lanes)
    tracemalloc.start()
    for w, js in worker_runs(topo, first, last):
        if w == 0:
            emission(orders, SEED, topo.batch_size, G,
                     [RankBatch(j, planner.plan(j, stream.schedule.segments), topo.first_slot(j), True) for j in js])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2 ** 20


def reads(stream: Stream, world: int, lanes: int, args: argparse.Namespace, keep: frozenset[int],
          memo: dict[Any, Any]) -> dict[str, Any]:
    """Node 0's downloads and shards for the stream of ``lanes`` canonical nodes (memoised: the worlds of 1
    and 8 ranks are the same one node, its pass computed once for both rank sizes)."""
    nodes = max(1, world // RANKS_PER_NODE)
    cache_shards = int(args.cache_gb * 2 ** 30 // (SAMPLE_BYTES * args.samples_per_shard))
    if (nodes, lanes) not in memo:
        sizes = tuple(G // w for w in args.world_list if max(1, w // RANKS_PER_NODE) == nodes)
        t0 = time.process_time()
        memo[nodes, lanes] = node_pass(stream, nodes, lanes, cache_shards, sizes, keep_rows=keep)
        memo[nodes, lanes]["cpu_s"] = time.process_time() - t0
    out = memo[nodes, lanes]
    if ("lane", lanes) not in memo:
        memo["lane", lanes] = lane_walk(stream, lanes, cache_shards)
    walk = memo["lane", lanes]
    get_s = nodes * np.array(out["downloads_per_domain"]) * args.steps_per_second / stream.batches
    shard_gb = SAMPLE_BYTES * args.samples_per_shard / 2 ** 30
    return {"read_amplification": out["amplification"],
            "read_amplification_lane_walk": walk["amplification"] if lanes == nodes else None,
            "downloaded_gb_per_node": out["downloaded_samples"] * SAMPLE_BYTES / 2 ** 30,
            "consumed_gb_per_node": out["consumed_samples"] * SAMPLE_BYTES / 2 ** 30,
            "cache_needed_gb_per_node": walk["cache_needed_shards"] * shard_gb,
            "shards_per_node_per_1k": out["shards_per_node_per_1k"],
            "shards_per_rank_per_1k": out["shards_per_rank_per_1k"][G // world],
            "get_per_s_busiest_prefix": float(get_s.max()), "get_per_s_all_prefixes": float(get_s.sum()),
            "downloads_per_domain": list(out["downloads_per_domain"]), "node_pass_cpu_s": out["cpu_s"],
            "node_rows": out["node_rows"]}


def scale_row(stream: Stream, world: int, args: argparse.Namespace, memo: dict[Any, Any]) -> dict[str, Any]:
    n, b = stream.batches, G // world
    nodes = max(1, world // RANKS_PER_NODE)
    check = list(range(0, n, args.check_every))
    lost, dup, slices = check_batches(stream, world, check, nodes)
    split_bad = split_errors(stream, world, nodes, min(n, args.split_batches), slices)
    after = reads(stream, world, nodes, args, frozenset(check), memo)
    before = after if nodes == 1 else reads(stream, world, 1, args, frozenset(), memo)
    per_node = min(world, RANKS_PER_NODE)
    node_bad = sum(int(not np.array_equal(after["node_rows"][i], np.concatenate(slices[i][:per_node], axis=1)))
                   for i in check)  # node 0's rows as one rank of G / nodes slots = its ranks' slices
    lo = (n // 2) // 1000 * 1000
    row = {"world_size": world, "batch_size": b, "nodes": nodes, "canonical_nodes": nodes,
           "lost": lost, "duplicated": dup, "checked_batches": len(check),
           "worker_split_or_slice_errors": split_bad, "node_rows_errors": node_bad,
           "peak_mb_per_worker": worker_memory_mb(stream, world, nodes, lo, min(n, lo + 3000))}
    drop = ("node_rows",)
    row.update({k: v for k, v in after.items() if k not in drop})
    row["before"] = {k: v for k, v in before.items() if k not in drop + ("read_amplification_lane_walk",)}
    return row


def global_walk(stream: Stream, lanes: int) -> dict[str, Any]:
    """All batches planned one by one: exact G per batch, contiguous positions; the closed form agrees."""
    planner = stream.planner(lanes)
    bad = 0
    prev_end = np.zeros(K * lanes, np.int64)
    t0 = time.process_time()
    for i in range(stream.batches):
        plan = planner.plan(i, stream.schedule.segments)
        bad += int(plan.quota.sum() != G) + int((plan.start != prev_end).any())
        prev_end = plan.end()
    walk_s = time.process_time() - t0
    t0 = time.process_time()
    jump = stream.planner(lanes)
    jump.advance_to(stream.batches, stream.schedule.segments)
    jump_s = time.process_time() - t0
    bad += int((jump.position != prev_end).any())
    epochs = (prev_end.reshape(lanes, K).sum(axis=0) / stream.sizes).round(2)
    return {"bad_batches": bad, "lanes": lanes, "walk_us_per_batch": 1e6 * walk_s / stream.batches,
            "closed_form_s": jump_s, "epochs_per_domain_min_max": [float(epochs.min()), float(epochs.max())]}


def lane_drift(batches: int, args: argparse.Namespace) -> dict[str, Any]:
    """How far apart the canonical nodes are in each domain after ``batches`` batches, in epochs of a node's
    span (max - min over the nodes), and domain 0's epochs on nodes 0 and C-1. Dealt from node 0 every batch
    (``grape_stream.mixer/3``), the low-numbered nodes took a small first domain's samples every batch and ran
    tens of epochs ahead; the rotating deal keeps them within a fraction of an epoch (what is left: each
    weight piece's last partial block of offsets, a random walk over the pieces)."""
    stream = Stream(batches, args.samples_per_shard, args.weights_every)
    out: dict[str, Any] = {}
    for lanes in (8, 64, 128):
        planner = stream.planner(lanes)
        planner.advance_to(batches, stream.schedule.segments)
        epochs = planner.position.reshape(lanes, K) / (stream.sizes[None, :] / lanes)
        out[f"C{lanes}"] = {"epoch_spread_per_domain": np.round(epochs.max(0) - epochs.min(0), 2).tolist(),
                            "domain0_epochs_first_last_node": [round(float(epochs[0, 0]), 2),
                                                               round(float(epochs[-1, 0]), 2)]}
    return out


def planning(args: argparse.Namespace) -> dict[str, Any]:
    """Planning CPU and resume time, after (this tree) and before (``--base-tree``) canonical nodes."""
    def run(tree: Path, canonical: str) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "plan.json"
            env = {**os.environ, "PYTHONPATH": str(tree)}
            cmd = [sys.executable, str(HERE / "scale_plan.py"), "--canonical", canonical, "--out", str(out)]
            subprocess.run(cmd + (["--batches", "2000", "--resume-at", "100000"] if args.quick else []), env=env,
                           check=True)
            return json.loads(out.read_text())

    def least(files: str | None, tree: Path | None, canonical: str) -> dict[str, Any] | None:
        got = [json.loads(Path(f).read_text()) for f in files.split(",")] if files else (
            [run(tree, canonical)] if tree else [])
        if not got:
            return None
        plan = {k: min(g["plan_us_per_batch_per_rank"][k] for g in got) for k in got[0]["plan_us_per_batch_per_rank"]}
        resume = {c: {k: min(g["resume"][c][k] for g in got) for k in v} if isinstance(v, dict) else v
                  for c, v in got[0]["resume"].items() if c != "rank"}
        if all("rank" in g["resume"] for g in got):  # one rank of a job of each world size
            resume["rank"] = {w: {k: min(g["resume"]["rank"][w][k] for g in got) for k in v}
                              for w, v in got[0]["resume"]["rank"].items()}
        return {"plan_us_per_batch_per_rank": plan, "resume": resume, "runs": len(got),
                "planning_window": [got[0]["at"], got[0]["at"] + got[0]["batches"]]}

    return {"after": least(args.plan, HERE.parent, "1,8,128"),
            "before": least(args.plan_before, Path(args.base_tree) if args.base_tree else None, "1")}


def whole_process(plan: dict[str, Any]) -> dict[str, float]:
    """Resume CPU of one process reading every canonical node's share, by ``C``."""
    return {c: round(v["total_cpu_s"], 3) for c, v in plan["resume"].items() if c.startswith("C")}


def one_rank(plan: dict[str, Any]) -> dict[str, float]:
    """Resume CPU of one rank of a job of each world size (its node's share), ``ranks<R>_C<C>``."""
    return {f"ranks{w[len('world'):]}_C{v['canonical_nodes']}": round(v["total_cpu_s"], 3)
            for w, v in plan["resume"]["rank"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=100_000)
    ap.add_argument("--worlds", default="1,8,64,512,1024")
    ap.add_argument("--samples-per-shard", type=int, default=4096, help="4096 x 4 KB samples: 16 MB shards")
    ap.add_argument("--weights-every", type=int, default=100)
    ap.add_argument("--check-every", type=int, default=500)
    ap.add_argument("--split-batches", type=int, default=2000, help="loader batches of the worker-split check")
    ap.add_argument("--steps-per-second", type=float, default=2.0, help="global batches trained per second")
    ap.add_argument("--cache-gb", type=float, default=32.0, help="cache_limit per node assumed for read amplification")
    ap.add_argument("--base-tree", default=None, help="a checkout of the code before canonical nodes (87f3c63)")
    ap.add_argument("--plan", default=None, help="scale_plan.py JSON of this tree (comma-separated: the least)")
    ap.add_argument("--plan-before", default=None, help="scale_plan.py JSON of the code before canonical nodes")
    ap.add_argument("--no-planning", action="store_true", help="skip the planning CPU and resume figures")
    ap.add_argument("--reads-from", default=None,
                    help="take the worlds and walks from this earlier output (run with --no-planning) and add the "
                         "planning figures: the two parts can run side by side")
    ap.add_argument("--note", default="", help="how and where it ran (kept in the JSON)")
    ap.add_argument("--quick", action="store_true", help="10^4 batches, worlds 1, 8, 1024")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.worlds = 10_000, "1,8,1024"
    args.world_list = [int(w) for w in args.worlds.split(",")]
    started = time.time()
    earlier = json.loads(Path(args.reads_from).read_text()) if args.reads_from else None
    if earlier:
        walks, rows, args.batches = earlier["global_walk"], earlier["worlds"], earlier["config"]["batches"]
        started -= earlier["wall_s"]
    else:
        stream = Stream(args.batches, args.samples_per_shard, args.weights_every)
        walks = [global_walk(stream, 1), global_walk(stream, 128)]
        rows, memo = [], {}
        for world in args.world_list:
            t0 = time.time()
            rows.append(scale_row(stream, world, args, memo))
            rows[-1]["wall_s"] = time.time() - t0
            print(f"world {world}: {rows[-1]}", flush=True)
    plan = {"after": None, "before": None} if args.no_planning else planning(args)
    after, before = plan["after"], plan["before"]
    claims: dict[str, Any] = {
        "read_amplification": {str(r["world_size"]): round(r["read_amplification"], 3) for r in rows},
        "lost": sum(r["lost"] for r in rows), "duplicated": sum(r["duplicated"] for r in rows),
        "read_amplification_before": {str(r["world_size"]): round(r["before"]["read_amplification"], 3)
                                      for r in rows}}
    if after:
        claims["plan_us_per_batch_per_rank"] = {"after": {k: round(v) for k, v in
                                                          after["plan_us_per_batch_per_rank"].items()}}
        claims["resume_cpu_s_at_1e6"] = {"after": whole_process(after)}
        if "rank" in after["resume"]:
            claims["resume_cpu_s_at_1e6_one_rank"] = {"after": one_rank(after)}
        if before:
            claims["plan_us_per_batch_per_rank"]["before"] = {k: round(v) for k, v in
                                                              before["plan_us_per_batch_per_rank"].items()}
            claims["resume_cpu_s_at_1e6"]["before"] = whole_process(before)
            if "rank" in before["resume"] and "rank" in after["resume"]:
                claims["resume_cpu_s_at_1e6_one_rank"]["before"] = one_rank(before)
    command = "python bench/scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command if not earlier else f"{earlier['command']}; then {command}", "note": args.note,
              "config": {"K": K, "global_batch_size": G, "workers_per_rank": WORKERS, "batches": args.batches,
                         "samples_per_shard": args.samples_per_shard, "weights_every": args.weights_every,
                         "steps_per_second": args.steps_per_second, "ranks_per_node": RANKS_PER_NODE,
                         "cache_gb_per_node": args.cache_gb,
                         "canonical_nodes": "after: the node count; before: 1 (the stream before canonical nodes)"},
              "claims": claims, "global_walk": walks, "worlds": rows, "planning": plan,
              "lane_drift": lane_drift(args.batches, args),
              "load_average_at_end": os.getloadavg()[0], "wall_s": time.time() - started}
    print(format_table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    ok = all(r["lost"] == r["duplicated"] == r["worker_split_or_slice_errors"] == r["node_rows_errors"] == 0
             for r in rows)
    return 0 if ok and all(w["bad_batches"] == 0 for w in walks) else 1


def format_table(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"K={c['K']} domains, global batch {c['global_batch_size']}, {c['batches']} batches, "
             f"{c['samples_per_shard']} samples/shard, {c['steps_per_second']} steps/s; read amplification with "
             f"a {c['cache_gb_per_node']:g} GB cache per node; before -> after (C = 1 -> C = nodes)",
             "| ranks | nodes | lost | dup | read amp | shards/1k node | shards/1k rank | cache need GB/node "
             "| GET/s busiest prefix | MB/worker |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["worlds"]:
        b = r["before"]
        lines.append(f"| {r['world_size']} | {r['nodes']} | {r['lost']} | {r['duplicated']} | "
                     f"{b['read_amplification']:.2f} -> {r['read_amplification']:.2f} | "
                     f"{b['shards_per_node_per_1k']:.0f} -> {r['shards_per_node_per_1k']:.0f} | "
                     f"{b['shards_per_rank_per_1k']:.0f} -> {r['shards_per_rank_per_1k']:.0f} | "
                     f"{b['cache_needed_gb_per_node']:.1f} -> {r['cache_needed_gb_per_node']:.1f} | "
                     f"{b['get_per_s_busiest_prefix']:.2f} -> {r['get_per_s_busiest_prefix']:.2f} | "
                     f"{r['peak_mb_per_worker']:.1f} |")
    for w in result["global_walk"]:
        lines.append(f"global walk, {w['lanes']} lanes: {w['bad_batches']} bad batches, {w['walk_us_per_batch']:.0f} "
                     f"us/batch; closed form to batch {c['batches']}: {w['closed_form_s'] * 1e3:.1f} ms CPU")
    plan = result["planning"]
    if plan["after"]:
        cols = [("before", plan["before"], "C1")] if plan["before"] else []
        cols += [(f"C={n}", plan["after"], f"C{n}") for n in (1, 8, 128)]
        lines += ["planning CPU us/batch/rank (8 workers): | ranks | " + " | ".join(n for n, _, _ in cols) + " |"]
        for key in plan["after"]["plan_us_per_batch_per_rank"]:
            if key.endswith("_C1"):
                world = key[len("world"):-len("_C1")]
                vals = [src["plan_us_per_batch_per_rank"].get(f"world{world}_{cc}") for _, src, cc in cols]
                lines.append(f"| {world} | " + " | ".join("-" if v is None else f"{v:.0f}" for v in vals) + " |")
        lines.append("resume at 10^6, load_state_dict + first batch, CPU s, one process of all C nodes' shares: "
                     + ", ".join(f"{n} {src['resume'][cc]['total_cpu_s']:.3f}" for n, src, cc in cols))
        for name, src in (("before", plan["before"]), ("after", plan["after"])):
            if src and "rank" in src["resume"]:
                lines.append(f"resume at 10^6, one rank of a job, CPU s, {name}: " + ", ".join(
                    f"{w[len('world'):]} ranks (C = {v['canonical_nodes']}) {v['total_cpu_s']:.3f}"
                    for w, v in src["resume"]["rank"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
