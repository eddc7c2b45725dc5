"""Resuming costs the same at any step: a checkpoint's anchor, the check over its tail, older states.

A checkpoint stores, besides every domain's position at its batch, an ``anchor``: the positions at the start of
the 8th-last weight piece. A resume checks that the schedule leads from the anchor to the positions (a walk over
a few pieces, not over the whole run); a state without an anchor (written before it existed) is checked from the
origin. Positions here are counted from the samples the loader actually handed out (an independent computation:
no planner involved).
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from _mds_fixtures import write_domains
from grape_stream.mixing.mixer import DomainStream, MixerStateError, WeightedStreamingMixer
from grape_stream.mixing.position import TAIL_PIECES

SIZES = [48, 40, 24]
B = 8
EVERY = 3  # a weight change every 3 batches: many pieces
ALPHAS = np.random.default_rng(7).dirichlet(np.ones(len(SIZES)), size=64)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("mdsr"), SIZES, samples_per_shard=8)


def make(dirs, max_epochs=None, **kw):
    doms = [DomainStream(f"d{k}", local=d, max_epochs=max_epochs if k == 2 else None) for k, d in enumerate(dirs)]
    kw.setdefault("schedule_capacity", 256)
    m = WeightedStreamingMixer(doms, batch_size=B, seed=5, **kw)
    for i, f in enumerate(range(EVERY, 60 * EVERY, EVERY)):  # the whole schedule up front: pieces [f, f + 3)
        m.set_weights(ALPHAS[i], at_batch=f)
    return m


def take(m, n):
    """The next ``n`` batches as (domain, sample index, epoch) rows, and per-batch domain counts."""
    rows, counts = [], []
    loader = m.dataloader()
    for batch in loader:
        rows.append(list(zip(batch["domain"].tolist(), batch["sample_index"].tolist(), batch["epoch"].tolist())))
        counts.append(np.bincount(batch["domain"].numpy(), minlength=len(SIZES)))
        if len(rows) == n:
            break
    return rows, np.array(counts)


def test_the_anchor_is_where_the_stream_stood_at_the_start_of_the_8th_last_piece(dirs):
    with make(dirs) as m:
        _, counts = take(m, 40)
        sd = m.state_dict()
    # pieces start at 0, 3, ..., 39: the 8th last piece before batch 40 starts at 39 - 7 * 3 = 18
    assert TAIL_PIECES == 8 and sd["anchor"]["batch"] == 39 - (TAIL_PIECES - 1) * EVERY == 18
    assert sd["anchor"]["positions"] == counts[:18].sum(axis=0).tolist()  # samples handed out before batch 18
    assert sd["positions"] == counts.sum(axis=0).tolist()
    with make(dirs) as m:  # a mixer that only seeks there writes the same state
        m.seek(40)
        assert m.state_dict() == sd


def test_positions_edited_in_the_tail_are_refused_with_one_line(dirs):
    with make(dirs) as m:
        take(m, 40)
        sd = json.loads(json.dumps(m.state_dict()))
    moved = list(sd["positions"])
    moved[0] -= 1
    moved[1] += 1  # one sample moved between domains: the total is still right
    anchor = dict(sd["anchor"], positions=[sd["anchor"]["positions"][0] + 1, *sd["anchor"]["positions"][1:]])
    cases = {
        "not where its weight schedule leads from batch 18": {**sd, "positions": moved},
        "not where its weight schedule leads from batch 18 ": {**sd, "anchor": anchor},
        "does not lie between its origin": {**sd, "anchor": {**sd["anchor"], "batch": 41}},
        "anchor is not": {**sd, "anchor": {"batch": 18}},
    }
    for match, state in cases.items():
        with make(dirs) as m:
            with pytest.raises(MixerStateError, match=match.strip()) as err:
                m.load_state_dict(state)
            assert "\n" not in str(err.value)
            assert m.weight_history == make_history(dirs)  # a refused state changes nothing


def make_history(dirs):
    with make(dirs) as m:
        return m.weight_history


def test_a_state_without_an_anchor_still_loads_and_is_checked_from_the_origin(dirs):
    with make(dirs) as m:
        full, _ = take(m, 50)
    with make(dirs) as m:
        take(m, 40)
        sd = json.loads(json.dumps(m.state_dict()))
    old = {k: v for k, v in sd.items() if k != "anchor"}  # what grape_stream wrote before the anchor
    with make(dirs) as m:
        m.load_state_dict(old)
        rest, _ = take(m, 10)
        again = m.state_dict()
    assert rest == full[40:]
    assert "anchor" in again and again["batch"] == 50
    # Checked over every piece: positions edited before the anchor's batch are found too.
    early = {**old, "origin": {**old["origin"], "positions": [1, 0, 0]}}
    with make(dirs) as m:
        with pytest.raises(MixerStateError, match="from batch 0"):
            m.load_state_dict(early)


def test_resumed_weights_are_bit_for_bit_the_stored_ones_and_a_bad_entry_is_named(dirs):
    with make(dirs) as m:
        take(m, 40)
        sd = json.loads(json.dumps(m.state_dict()))
    with make(dirs) as m:
        m.load_state_dict(sd)
        for e in sd["schedule"]:
            assert m.weights_at(max(e["from_batch"], 0))[1].tolist() == e["alpha"]
    bad = json.loads(json.dumps(sd))
    bad["schedule"][5]["alpha"][1] = -0.25
    with make(dirs) as m:
        with pytest.raises(ValueError, match=r"negative entries at positions \[1\]"):
            m.load_state_dict(bad)


def test_a_budget_spent_inside_the_tail_still_resumes_exactly(dirs):
    """Domain 2 (24 samples, max_epochs=1, a small weight) runs out after ~150 batches. States written around
    that batch, by a run from the start and by a run resumed just before it, anchor at the start of the
    8th-last piece with the stream's true positions there, and resume to the uninterrupted run's batches."""
    alphas = np.column_stack([ALPHAS[:, :2] * 0.98 / ALPHAS[:, :2].sum(axis=1, keepdims=True),
                              np.full(len(ALPHAS), 0.02)])
    n = 190

    def budget_mixer():
        m = make(dirs, max_epochs=1)
        for i, f in enumerate(range(EVERY, 60 * EVERY, EVERY)):  # the same switch batches, other weights
            m.set_weights(alphas[i], at_batch=f)
        return m

    def check(sd, counts):
        b = sd["batch"]
        assert sd["anchor"]["batch"] == EVERY * ((b - 1) // EVERY) - (TAIL_PIECES - 1) * EVERY  # the tail: 8 pieces
        assert sd["anchor"]["positions"] == counts[:sd["anchor"]["batch"]].sum(axis=0).tolist()  # true positions
        with budget_mixer() as m:
            m.load_state_dict(sd)
            rest, _ = take(m, n - b)
        assert rest == full[b:], b

    with pytest.warns(RuntimeWarning, match="spent its max_epochs"):
        with budget_mixer() as m:
            full, counts = take(m, n)
    spent = int(np.flatnonzero(counts[:, 2].cumsum() == SIZES[2])[0]) + 1  # the first batch without domain 2
    assert 100 < spent < n - 10
    for at in (spent - 1, spent + 1, spent + 4):  # a run from the start
        with budget_mixer() as m:
            take(m, at)
            check(json.loads(json.dumps(m.state_dict())), counts)
    with budget_mixer() as m:  # a run resumed 5 batches before the budget ran out, saving 3 after
        take(m, spent - 5)
        sd = json.loads(json.dumps(m.state_dict()))
    with budget_mixer() as m:
        m.load_state_dict(sd)
        take(m, 8)
        check(json.loads(json.dumps(m.state_dict())), counts)


def test_the_resume_check_walks_the_tail_not_the_run(dirs):
    """Loading an anchored state of 1,500 weight pieces takes a fraction of the full check's time."""
    n = 1500
    with make(dirs, schedule_capacity=2 * n + 16) as m:
        for f in range(60 * EVERY, n):
            m.set_weights(ALPHAS[f % len(ALPHAS)], at_batch=f)
        m.seek(n)
        sd = json.loads(json.dumps(m.state_dict()))
    old = {k: v for k, v in sd.items() if k != "anchor"}

    def load_s(state):
        with make(dirs, schedule_capacity=2 * n + 16) as m:
            t0 = time.perf_counter()
            m.load_state_dict(state)
            return time.perf_counter() - t0

    full = load_s(old)
    tail = min(load_s(sd) for _ in range(3))
    assert tail < full / 5, (tail, full)
