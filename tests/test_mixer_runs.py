"""Runs of consecutive batches composed at once (a worker's message, the main process's look-ahead) hold
exactly the samples of batch-by-batch composing: checked against an independent per-sample computation,
across weight switches, budgets running out and plans that do not continue one another; and the main
process's look-ahead never lets a set_weights call miss the next batch."""

from __future__ import annotations

import numpy as np
import pytest

from _mds_fixtures import batch_identities, identity, write_domains
from grape_stream.mixing import compose
from grape_stream.mixing.batch_read import BatchReader
from grape_stream.mixing.counter_rng import slot_permutation
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from grape_stream.mixing.topology import RankBatch

B = 12


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("mdsr"), [90, 50, 30, 17], samples_per_shard=7)


def _mixer(dirs, max_epochs=None, **kw):
    kw.setdefault("batch_size", B)
    return WeightedStreamingMixer([DomainStream(f"d{k}", local=d, max_epochs=max_epochs) for k, d in enumerate(dirs)],
                                  **kw)


def _reference(composer, readers, rb):
    """Loader batch ``rb`` the slow way: its global batch's positions -> ids per domain (sample_ids), grouped
    by domain, the whole batch permuted by slot_permutation, the rank's slots cut out, every sample decoded
    on its own by streaming's per-sample path."""
    plan = rb.plan
    doms, ids, epochs = [], [], []
    for k in range(len(plan.quota)):
        q = int(plan.quota[k])
        if q:
            i, e = composer.orders[k].sample_ids(int(plan.start[k]), q)
            doms += [k] * q
            ids += i.tolist()
            epochs += e.tolist()
    perm = slot_permutation(composer.seed, plan.batch, len(ids))
    rows = []
    for j in perm[rb.first_slot:rb.first_slot + composer.batch_size].tolist():
        sample = readers[doms[j]].read(np.array([ids[j]]))[0]
        rows.append((doms[j], ids[j], epochs[j], identity(sample)))
    return rows


def _rows(packed):
    meta = dict(zip(packed.meta_keys, packed.meta))
    toks = packed.data["tokens"]
    return [(int(meta["domain"][r]), int(meta["sample_index"][r]), int(meta["epoch"][r]), identity({"tokens": toks[r]}))
            for r in range(len(toks))]


def _rank_batches(m, n):
    """Loader batches 0 .. n - 1 of mixer ``m``'s rank (each with its global batch's plan), or fewer where the
    stream ends."""
    planner, topo, out = m._composer.planner(), m.topology, []
    for j in range(n):
        plan = planner.plan(topo.global_batch(j), m._schedule.effective.segments)
        if plan is None:
            break
        out.append(RankBatch(j, plan, topo.first_slot(j), topo.ends_global_batch(j)))
    return out


@pytest.mark.parametrize("micro", [1, 3])
def test_a_run_holds_each_batch_exactly_as_the_slow_reference(dirs, micro):
    # Weights with a zero, a switch mid-way and small domains crossing epochs: runs of 1, 5 and 40 batches;
    # with micro=3 each loader batch is a third of a global batch.
    with _mixer(dirs, seed=3, weights=[0.5, 0.0, 0.3, 0.2], global_batch_size=micro * B) as m:
        m.set_weights([0.1, 0.6, 0.0, 0.3], at_batch=17)
        composer = m._composer
        plans = _rank_batches(m, 60)
        readers = composer.readers()
        want = [row for p in plans for row in _reference(composer, readers, p)]
        assert {e for _, _, e, _ in want} != {0}  # the small domains wrapped into a new epoch
        for size in (1, 5, 40):
            got = []
            for a in range(0, len(plans), size):
                run = composer.gather_run(plans[a:a + size], readers, BatchReader(readers))
                assert run.batches == len(plans[a:a + size])
                assert run.meta[run.meta_keys.index("batch_index")].tolist() == [
                    p.batch for p in plans[a:a + size] for _ in range(B)]
                got += _rows(run)
            assert got == want, size
        # Plans that do not continue one another (batches 3, 9, 4) are read one by one, same rows.
        odd = [plans[3], plans[9], plans[4]]
        assert _rows(composer.gather_run(odd, readers, BatchReader(readers))) == [
            r for p in odd for r in _reference(composer, readers, p)]
        for r in readers:
            r.close()


def test_a_run_through_a_spent_budget_matches_the_reference(dirs):
    # max_epochs=1: domains run out one after another; the planner re-draws their slots.
    with _mixer(dirs, seed=8, weights=[0.1, 0.2, 0.3, 0.4], max_epochs=1) as m:
        composer = m._composer
        plans = _rank_batches(m, 1000)
        assert 5 < len(plans) < 1000
        readers = composer.readers()
        run = composer.gather_run(plans, readers, BatchReader(readers))
        assert _rows(run) == [r for p in plans for r in _reference(composer, readers, p)]
        for r in readers:
            r.close()


def _consume(dirs, switches, n=40, **kw):
    """No workers, lag 0: set_weights right after batch ``c`` for c in ``switches``; per batch
    (identities, weights version)."""
    out = []
    with _mixer(dirs, seed=5, **kw) as m:
        loader = m.dataloader(num_workers=0)
        rng = np.random.default_rng(0)
        for batch in loader:
            i = int(batch["batch_index"][0])
            out.append((batch_identities(batch), int(batch["weights_version"][0])))
            assert m._schedule.table.max_claimed() == i  # nothing beyond the batch handed out is claimed
            if i + 1 in switches:
                assert m.set_weights(rng.dirichlet(np.ones(4))) == i + 1  # lag 0: the very next batch
            if i + 1 == n:
                break
    return out


def test_main_process_runs_give_the_batch_by_batch_samples_and_switch_points(dirs, monkeypatch):
    switches = {1, 2, 3, 7, 8, 20, 33}
    got = _consume(dirs, switches)
    versions = [v for _, v in got]
    assert versions == [sum(s <= i for s in switches) for i in range(40)]
    monkeypatch.setattr(compose, "SAMPLES_PER_RUN", 1)  # runs of one batch: composed as it is asked for
    assert _consume(dirs, switches) == got


def test_a_checkpoint_taken_mid_run_resumes_at_the_next_batch(dirs):
    with _mixer(dirs, seed=9) as m:
        loader = iter(m.dataloader(num_workers=0))
        for _ in range(5):  # runs of 1, 2, 4 batches: the third run is composed, two of it handed out
            next(loader)
        state = m.state_dict()
        rest = [batch_identities(next(loader)) for _ in range(10)]
    assert state["batch"] == 5
    with _mixer(dirs, seed=9) as m:
        m.load_state_dict(state)
        resumed = [batch_identities(b) for _, b in zip(range(10), m.dataloader(num_workers=0))]
    assert resumed == rest


def test_closing_the_mixer_mid_run_stops_the_iteration(dirs):
    with _mixer(dirs, seed=1) as m:
        it = iter(m.dataloader(num_workers=0))
        for _ in range(4):
            next(it)  # the third run (4 batches) is composed; one of it is handed out
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
