"""Planning CPU and resume time of whatever ``grape_stream`` is importable: this tree, or an older checkout.

``bench/scale.py`` runs this file in a fresh process per code version (``PYTHONPATH`` = the tree to measure)
so that the code before canonical nodes is measured by the same script, on the same machine, in the same
minutes as the code after them: the "before" figures are runs, not estimates. It uses only the API both
have (``lanes=`` / ``canonical_nodes=`` are passed only when the canonical node count ``C`` is above 1, and
the code before canonical nodes is asked for ``C = 1`` only).

Both figures are CPU seconds of the process (``time.process_time``): the machine these runs share is loaded,
and CPU time is what load does not inflate much (wall seconds are recorded beside them). Each figure is the
least of ``--repeats`` runs.

  plan us/batch/rank  a rank's 8 DataLoader workers composing loader batches ``[--at, --at + --batches)``
                      of the K=20 simulated run (weights every 100 batches), as ``MixerDataLoader`` splits
                      them into messages: each worker's plans (``QuotaPlanner.plan``, which jumps to the
                      worker's first batch in closed form) and the rows (``rows.emission``), divided by the
                      batches; ranks 0 and R-1, averaged
  resume s            a real mixer (K=20 small local domains, MDS shards) resumed at global batch
                      ``--resume-at`` with a weight change every 100 batches before it (10^4 schedule
                      entries): ``load_state_dict`` + the first batch (0 workers, 1 rank: the one process
                      reads all ``C`` canonical nodes' shares, the most a rank can) of a checkpoint written
                      with ``C`` canonical nodes; and the writer's cold ``seek`` to that batch
  rank resume s       the same checkpoint resumed by one rank of a real job of ``--rank-worlds`` ranks (8 a
                      node; the mixer is told its rank and world size where it reads them, as
                      tests/test_mixer_elastic.py does): ``load_state_dict`` + its first loader batch of
                      ``G / R`` samples, at the default ``C`` (the node count: 1, 8, 128 for 8, 64, 1,024
                      ranks; the code before canonical nodes has one stream), the first rank of the first
                      and of the last node (the least over ``--repeats`` of each, the two averaged)

    PYTHONPATH=<tree> .venv/bin/python bench/scale_plan.py --out plan.json [--batches 5000] [--canonical 1,8,128]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

import grape_stream
from grape_stream.mixing import DomainStream, WeightedStreamingMixer
from grape_stream.mixing import mixer as mixer_module
from grape_stream.mixing.compose import message_size
from grape_stream.mixing.epoch_order import DomainOrder
from grape_stream.mixing.loader import DEFAULT_MAX_DEPTH, SAMPLES_PER_MESSAGE
from grape_stream.mixing.planner import QuotaPlanner
from grape_stream.mixing.rows import emission
from grape_stream.mixing.schedule import EffectiveSchedule
from grape_stream.mixing.topology import RankBatch, Topology
from grape_stream.world import World

K, G, WORKERS, SEED, RANKS_PER_NODE = 20, 1024, 8, 7, 8


def _lanes(lanes: int) -> dict[str, int]:
    """Keyword arguments of ``lanes`` canonical nodes: none for one (the API before canonical nodes)."""
    return {} if lanes == 1 else {"lanes": lanes}


class Stream:
    """The simulated run: K domains of different sizes (small ones wrap into many epochs) and a schedule."""

    def __init__(self, batches: int, samples_per_shard: int = 4096, every: int = 100) -> None:
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

    def orders(self, lanes: int = 1) -> list[DomainOrder]:  # each process builds its own (caches are per process)
        return [DomainOrder(s, 1000 + k, True, **_lanes(lanes)) for k, s in enumerate(self.shards)]

    def planner(self, lanes: int = 1) -> QuotaPlanner:
        return QuotaPlanner(seed=SEED, batch_size=G, composition="systematic", budgets=[None] * K, **_lanes(lanes))


def topology(rank: int, world: int, lanes: int) -> Topology:
    """Rank ``rank`` of ``world`` ranks (8 a node) reading the stream of ``lanes`` canonical nodes."""
    nodes = max(1, world // RANKS_PER_NODE)
    extra = {} if lanes == 1 else {"lanes": lanes, "nodes": nodes}
    return Topology.of(rank, world, G // world, G, **extra)


def per_message(batch_size: int) -> int:
    """MixerDataLoader's default batches a worker message with 8 workers (prefetch 1, depth <= 64)."""
    return max(1, min(SAMPLES_PER_MESSAGE // batch_size, (DEFAULT_MAX_DEPTH + 1) // (WORKERS + 1)))


def worker_runs(topo: Topology, first: int, last: int) -> Iterator[tuple[int, list[int]]]:
    """(worker, loader batches of one message) in the order ``MixerDataLoader`` hands them out."""
    per = per_message(topo.batch_size)
    begin, t = first, 0
    while begin < last:
        size = min(message_size(t, per, WORKERS), last - begin)
        yield t % WORKERS, list(range(begin, begin + size))
        begin += size
        t += 1


def rank_cpu(stream: Stream, topo: Topology, first: int, last: int) -> float:
    """CPU seconds rank ``topo.rank``'s 8 workers spend planning loader batches ``[first, last)`` (micro=1)."""
    cpu = 0.0
    lanes = getattr(topo, "lanes", 1)  # the code before canonical nodes has none
    state = {w: (stream.orders(lanes), stream.planner(lanes)) for w in range(WORKERS)}
    for w, batches in worker_runs(topo, first, last):
        orders, planner = state[w]
        t0 = time.process_time()
        run = [RankBatch(j, planner.plan(topo.global_batch(j), stream.schedule.segments), topo.first_slot(j),
                         topo.ends_global_batch(j)) for j in batches]
        emission(orders, SEED, topo.batch_size, G, run)
        cpu += time.process_time() - t0
    return cpu


def planning(stream: Stream, worlds: list[int], lanes_list: list[int], at: int, batches: int) -> dict[str, Any]:
    """us per batch per rank for each (world, C); a rank that reads ``L > 1`` canonical nodes' shares (fewer
    nodes than ``C``: ``ceil(C / R)`` of them) is timed over ``max(1000, batches / L)`` batches."""
    out: dict[str, Any] = {}
    for world in worlds:
        for lanes in lanes_list:
            n = max(1000, batches // -(-lanes // world))
            cpu = [rank_cpu(stream, topology(r, world, lanes), at, at + n) for r in sorted({0, world - 1})]
            out[f"world{world}_C{lanes}"] = 1e6 * float(np.mean(cpu)) / n
            print(f"plan world {world} C {lanes}: {out[f'world{world}_C{lanes}']:.0f} us/batch/rank over {n}",
                  flush=True)
    return out


def has_canonical_nodes() -> bool:
    """Whether the measured tree plans for canonical nodes (the code before them has one stream)."""
    return "nodes" in dir(World)


def rank_world(rank: int, world: int) -> World:
    """Rank ``rank`` of ``world`` ranks, 8 a node, in the measured tree's ``World`` (the code before
    canonical nodes has no ``local_size``)."""
    local = min(world, RANKS_PER_NODE)
    return World(rank, world, rank % local, local) if has_canonical_nodes() else World(rank, world, rank % local)


def timed_resume(doms: list[DomainStream], state: str, cap: int, at: int, batch_size: int,
                 repeats: int) -> dict[str, float]:
    """The least CPU of ``repeats`` resumes of ``state``: ``load_state_dict`` + the first loader batch."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        with WeightedStreamingMixer(doms, batch_size=batch_size, global_batch_size=G, seed=3,
                                    schedule_capacity=cap) as m:
            c0, w0 = time.process_time(), time.perf_counter()
            m.load_state_dict(json.loads(state))
            c1 = time.process_time()
            batch = next(iter(m.dataloader(num_workers=0)))
            c2, w2 = time.process_time(), time.perf_counter()
            assert int(batch["batch_index"][0]) == at and len(batch["batch_index"]) == batch_size
        got = {"load_state_dict_cpu_s": c1 - c0, "first_batch_cpu_s": c2 - c1, "total_cpu_s": c2 - c0,
               "total_wall_s": w2 - w0}
        best = {k: min(v, best.get(k, v)) for k, v in got.items()}
    return best


def resume(at: int, every: int, lanes_list: list[int], repeats: int, rank_worlds: list[int]) -> dict[str, Any]:
    """``load_state_dict`` + first batch at global batch ``at`` of checkpoints written with each ``C``: in
    one process of one rank, and by one rank of each of ``rank_worlds``."""
    sys.path.insert(0, str(Path(grape_stream.__file__).resolve().parents[1] / "tests"))
    from _mds_fixtures import write_domains  # the measured tree's small real MDS writer

    rng = np.random.default_rng(1)
    schedule = [(f, rng.dirichlet(np.ones(K))) for f in range(every, at, every)]
    cap = 2 * (at // every) + 16
    canon = has_canonical_nodes()
    rank_lanes = {w: max(1, w // RANKS_PER_NODE) if canon else 1 for w in rank_worlds}
    out: dict[str, Any] = {"at_batch": at, "schedule_entries": len(schedule) + 1}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_domains(tmp, [500 + 37 * k for k in range(K)], samples_per_shard=64)
        doms = [DomainStream(f"d{k}", local=d) for k, d in enumerate(dirs)]
        states: dict[int, str] = {}
        for lanes in sorted(set(lanes_list) | set(rank_lanes.values())):
            extra = {} if lanes == 1 else {"canonical_nodes": lanes}
            with WeightedStreamingMixer(doms, batch_size=G, seed=3, schedule_capacity=cap, **extra) as m:
                for f, w in schedule:
                    m.set_weights(w, at_batch=f)
                t0 = time.process_time()
                m.seek(at)
                seek_s = time.process_time() - t0
                states[lanes] = json.dumps(m.state_dict())
            if lanes in lanes_list:
                out[f"C{lanes}"] = {**timed_resume(doms, states[lanes], cap, at, G, repeats),
                                    "cold_seek_cpu_s": seek_s}
                print(f"resume C {lanes}: {out[f'C{lanes}']}", flush=True)
        ranks: dict[str, Any] = {}
        real_world = mixer_module.streaming_world
        try:
            for world in rank_worlds:
                got = []
                for rank in sorted({0, world - min(world, RANKS_PER_NODE)}):  # local rank 0 of nodes 0, last
                    mixer_module.streaming_world = lambda r=rank, w=world: rank_world(r, w)  # type: ignore
                    got.append(timed_resume(doms, states[rank_lanes[world]], cap, at, G // world, repeats))
                ranks[f"world{world}"] = {**{k: float(np.mean([g[k] for g in got])) for k in got[0]},
                                          "canonical_nodes": rank_lanes[world], "ranks_timed": len(got)}
                print(f"rank resume world {world}: {ranks[f'world{world}']}", flush=True)
        finally:
            mixer_module.streaming_world = real_world
        out["rank"] = ranks
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,8,64,1024")
    ap.add_argument("--canonical", default="1,8,128", help="canonical node counts C (the old code: 1 only)")
    ap.add_argument("--at", type=int, default=0, help="first loader batch of the planning window")
    ap.add_argument("--batches", type=int, default=10_000, help="loader batches of the planning window")
    ap.add_argument("--resume-at", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3, help="resume runs (the least is kept)")
    ap.add_argument("--rank-worlds", default="8,64,1024", help="world sizes of the one-rank resume")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    lanes_list = [int(c) for c in args.canonical.split(",")]
    stream = Stream(args.at + args.batches)
    result = {"code": str(Path(grape_stream.__file__).resolve().parents[1]), "at": args.at, "batches": args.batches,
              "plan_us_per_batch_per_rank": planning(stream, [int(w) for w in args.worlds.split(",")], lanes_list,
                                                     args.at, args.batches),
              "resume": resume(args.resume_at, 100, lanes_list, args.repeats,
                                [int(w) for w in args.rank_worlds.split(",") if w])}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
