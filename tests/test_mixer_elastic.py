"""One sample stream whatever the cluster: the global batches do not depend on the number of ranks, DataLoader
workers or micro-batches, and a checkpoint resumes on any other topology with exactly the next global batch.

The stream is planned for CANON = 4 canonical nodes (each reads its own share of every domain's shards), so
every world here is a whole number of nodes of 2 ranks (or one rank) that divides 4 or is a multiple of it.
Ranks are simulated in this process: each simulated rank is a real WeightedStreamingMixer (real shards, real
DataLoader workers) whose rank and world size are set where the mixer reads them (``streaming_world``);
streaming's own shared-memory world stays one process, because streaming would start a process group for a
world size above 1. tests/test_mixer_elastic_dist.py runs the same stream in real torch.distributed processes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from _mds_fixtures import identity, write_domains
from grape_stream.mixing import mixer as mixer_module
from grape_stream.mixing.mixer import DomainStream, MixerStateError, WeightedStreamingMixer
from grape_stream.world import World

SIZES = [40, 56, 24, 72, 32, 48, 64, 28, 36, 52]  # 10 domains; small ones wrap into new epochs
G = 32  # samples per global batch
LAG = 6  # a fixed lag (global batches): switch batches independent of workers and topology
ALPHAS = np.random.default_rng(4).dirichlet(np.ones(len(SIZES)), size=4)
CHANGES = {3: ALPHAS[0], 7: ALPHAS[1], 8: ALPHAS[2], 12: ALPHAS[3]}  # after that many global batches
CANON = 4  # canonical nodes: 1 rank is 1 node, 2 ranks 1 node, 4 ranks 2 nodes, 8 ranks 4 nodes


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("mdse"), SIZES, samples_per_shard=8)


def make(dirs, monkeypatch, rank: int, world: int, batch_size: int, global_batch_size: int = G, **kw):
    """Rank ``rank`` of ``world`` (as torchrun would tell it: nodes of 2 ranks), reading ``batch_size`` samples a
    loader batch."""
    local = min(2, world)
    monkeypatch.setattr(mixer_module, "streaming_world", lambda: World(rank, world, rank % local, local))
    kw.setdefault("canonical_nodes", CANON)
    budget = kw.pop("max_epochs", None)  # for domain 2
    doms = [DomainStream(f"d{k}", local=d, max_epochs=budget if k == 2 else None) for k, d in enumerate(dirs)]
    return WeightedStreamingMixer(doms, batch_size=batch_size, global_batch_size=global_batch_size, seed=21,
                                  lag=LAG, **kw)


def rows_of(batch, micro: int) -> list[tuple[int, int, int, int, int]]:
    """(global batch, domain, sample, epoch, weights version) of each row; domain and sample read from the tokens."""
    ids = [identity({"tokens": t}) for t in np.asarray(batch["tokens"])]
    return [(int(g) // micro, d, i, int(e), int(v)) for (d, i), g, e, v in
            zip(ids, batch["batch_index"].tolist(), batch["epoch"].tolist(), batch["weights_version"].tolist())]


def run_rank(m: WeightedStreamingMixer, until: int, *, workers: int = 0) -> list:
    """Consume this rank's loader batches up to global batch ``until``; set_weights as a controller would
    (the same call on every rank after the same number of optimizer steps = global batches)."""
    micro = m.topology.micro
    out = []
    if m.consumed_batches >= until * micro:
        return out
    for batch in m.dataloader(num_workers=workers):
        out += rows_of(batch, micro)
        consumed = m.consumed_batches
        if consumed % micro == 0 and consumed // micro in CHANGES:
            m.set_weights(CHANGES[consumed // micro])
        if consumed == until * micro:
            break
    return out


def by_batch(rows) -> dict[int, list]:
    out: dict[int, list] = {}
    for r in rows:
        out.setdefault(r[0], []).append(r)
    return out


def order_file(path, rows) -> bytes:
    path.write_text("".join(" ".join(map(str, r)) + "\n" for r in rows))
    return path.read_bytes()


N = 20


@pytest.fixture(scope="module")
def reference(dirs, tmp_path_factory):
    """One rank reads whole global batches, no workers: the stream every topology must reproduce."""
    mp = pytest.MonkeyPatch()
    try:
        with make(dirs, mp, 0, 1, G) as m:
            rows = run_rank(m, N)
    finally:
        mp.undo()
    assert {r[4] for r in rows} == {0, 1, 2, 3, 4}  # the weight changes happened
    assert max(r[3] for r in rows) >= 2  # small domains wrapped into new epochs
    return rows


def test_one_rank_is_byte_identical_to_the_concatenation_of_eight_ranks_slices(dirs, monkeypatch, tmp_path,
                                                                                reference):
    one = order_file(tmp_path / "one_rank.txt", reference)
    # 8 ranks of 4 samples, with 0, 1 or 2 workers each.
    ranks = []
    for r in range(8):
        with make(dirs, monkeypatch, r, 8, G // 8) as m:
            ranks.append(by_batch(run_rank(m, N, workers=r % 3)))
    concat = [row for i in range(N) for r in range(8) for row in ranks[r][i]]
    assert order_file(tmp_path / "eight_ranks.txt", concat) == one
    # Any micro-batch split: 2 ranks taking 4 micro-batches of 4 samples per global batch.
    ranks = []
    for r in range(2):
        with make(dirs, monkeypatch, r, 2, 4) as m:
            assert m.topology.micro == 4
            ranks.append(by_batch(run_rank(m, N, workers=1)))
    concat = [row for i in range(N) for r in range(2) for row in ranks[r][i]]
    assert order_file(tmp_path / "two_ranks_micro.txt", concat) == one


def _phase(dirs, monkeypatch, world, workers, state, until):
    """Every rank of a ``world``-rank job resumes from ``state`` and trains to global batch ``until``; rank 0's
    checkpoint at the end (all ranks write the same)."""
    rows, states = [], []
    for r in range(world):
        with make(dirs, monkeypatch, r, world, G // world) as m:
            if state is not None:
                m.load_state_dict(json.loads(json.dumps(state)))  # as it comes back from disk
            rows += run_rank(m, until, workers=workers)
            states.append(m.state_dict())
    assert all(s == states[0] for s in states[1:])
    assert states[0]["batch"] == until and states[0]["written_by"]["world_size"] == world
    return rows, states[0]


def test_save_at_8_resume_at_2_save_resume_at_8_with_workers_0_3_1(dirs, monkeypatch, reference):
    a, state = _phase(dirs, monkeypatch, 8, 0, None, 6)
    b, state = _phase(dirs, monkeypatch, 2, 3, state, 13)
    c, _ = _phase(dirs, monkeypatch, 8, 1, state, N)
    got = a + b + c
    assert len(got) == len(reference) == N * G
    assert sorted(got) == sorted(reference)  # the same samples, weights and batches: nothing repeated or skipped
    ref = by_batch(reference)
    for i, rows in by_batch(got).items():
        assert sorted(rows) == sorted(ref[i])  # every global batch holds exactly its samples


def test_a_new_global_batch_size_continues_every_domain_where_it_stopped(dirs, monkeypatch):
    with make(dirs, monkeypatch, 0, 1, G) as m:
        run_rank(m, 5)
        state = m.state_dict()
        orders = m._orders
    with make(dirs, monkeypatch, 1, 2, 24, global_batch_size=48) as m:
        m.load_state_dict(state)
        assert [d["samples_drawn"] for d in m.stats()["domains"]] == state["positions"]
        rows = run_rank(m, 9)
        later = m.state_dict()
    # Rank 1 read slices of global batches 5..8 of 48 samples: each of its samples of domain k lies at a
    # position of k's stream after the saved one (nothing repeated) and before the new one (nothing skipped).
    assert later["batch"] == 9 and later["num_samples"] == 5 * G + 4 * 48
    assert later["origin"] == {"batch": 5, "num_samples": 5 * G, "positions": state["positions"],
                               "node_positions": state["node_positions"]}
    for k in range(len(SIZES)):  # rank 1 of 2 holds canonical nodes 2 and 3
        window = set()
        for c in (2, 3):
            lo, hi = state["node_positions"][c][k], later["node_positions"][c][k]
            ids, epochs = orders[k].sample_ids(lo, hi - lo, c)
            window |= set(zip(ids.tolist(), epochs.tolist()))
        mine = [(i, e) for _, d, i, e, _ in rows if d == k]
        assert set(mine) <= window and len(set(mine)) == len(mine)
    assert sum(later["positions"]) - sum(state["positions"]) == 4 * 48


def test_state_mid_global_batch_and_old_format_are_refused_with_one_line(dirs, monkeypatch):
    with make(dirs, monkeypatch, 0, 2, 4) as m:  # 4 micro-batches a global batch
        it = iter(m.dataloader())
        for _ in range(6):
            next(it)
        with pytest.raises(MixerStateError, match="inside global batch 1") as err:
            m.state_dict()
        assert "\n" not in str(err.value)
        next(it), next(it)
        state = m.state_dict()
        assert state["batch"] == 2
        old = {**state, "format": "grape_stream.mixer/1", "world_size": 2, "batch_size": 4}
        with pytest.raises(MixerStateError, match="grape_stream.mixer/1") as err:
            m.load_state_dict(old)
        assert "\n" not in str(err.value)
        # /3 dealt each batch from canonical node 0: its node positions belong to another deal
        assert state["format"] == "grape_stream.mixer/4" and state["canonical_nodes"] == CANON
        with pytest.raises(MixerStateError, match="grape_stream.mixer/3 with canonical_nodes=4") as err:
            m.load_state_dict({**state, "format": "grape_stream.mixer/3"})
        assert "\n" not in str(err.value)


def test_a_state_of_one_canonical_node_in_format_3_resumes_exactly(dirs, monkeypatch):
    """With one canonical node the deals of /3 and /4 are the same stream: a /3 state continues exactly."""
    with make(dirs, monkeypatch, 0, 1, G, canonical_nodes=1) as m:
        ref = run_rank(m, 12)
    with make(dirs, monkeypatch, 0, 1, G, canonical_nodes=1) as m:
        head = run_rank(m, 6)
        state = m.state_dict()
    assert state["format"] == "grape_stream.mixer/4" and head == [r for r in ref if r[0] < 6]
    with make(dirs, monkeypatch, 0, 1, G, canonical_nodes=None) as m:  # the default adopts the state's one node
        m.load_state_dict(json.loads(json.dumps({**state, "format": "grape_stream.mixer/3"})))
        assert m.topology.lanes == 1
        assert run_rank(m, 12) == [r for r in ref if r[0] >= 6]


def test_a_budget_spent_on_one_topology_is_spent_on_another(dirs, monkeypatch):
    """max_epochs is a budget of the global stream: where it runs out does not depend on the ranks."""
    with make(dirs, monkeypatch, 0, 1, G, max_epochs=1) as m:
        ref = run_rank(m, 12)
    assert sum(1 for r in ref if r[1] == 2) == SIZES[2]  # domain 2 served exactly one epoch
    rows = []
    for r in range(4):
        with make(dirs, monkeypatch, r, 4, G // 4, max_epochs=1) as m:
            rows += run_rank(m, 12)
    assert sorted(rows) == sorted(ref)
