"""The mixer under DataLoader workers: live weights, lag, W-independence, spawn, kill-and-resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from _mds_fixtures import batch_identities, write_domains
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

B = 8
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("mdsw"), [120, 80, 40], samples_per_shard=20)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    # Tiny domains: every worker crosses epoch boundaries of every domain many times, at different batches.
    return write_domains(tmp_path_factory.mktemp("mdst"), [30, 20, 10], samples_per_shard=5)


def make(dirs, **kw):
    kw.setdefault("batch_size", B)
    return WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(dirs)], **kw)


def run(mixer, n_batches, *, num_workers=0, changes=None, at_batch=True, loader=None, **dl_kwargs):
    """Iterate; ``changes`` maps a consumed-batch count to new weights (set at_batch=that count + lag)."""
    changes = changes or {}
    if loader is None:
        loader = mixer.dataloader(num_workers=num_workers, **dl_kwargs)
    ids, versions, effective = [], [], {}
    for batch in loader:
        i = int(batch["batch_index"][0])
        assert i == len(ids)
        # No worker has started a batch that a set_weights call now could still change.
        assert mixer._schedule.table.max_claimed(workers_only=True) < i + 1 + mixer.lag
        ids.append(batch_identities(batch))
        vs = set(batch["weights_version"].tolist())
        assert len(vs) == 1
        versions.append(vs.pop())
        consumed = i + 1
        if consumed in changes:
            if at_batch:
                effective[consumed] = mixer.set_weights(changes[consumed], at_batch=consumed + 6)
            else:
                effective[consumed] = mixer.set_weights(changes[consumed])
        if consumed == n_batches:
            break
    return ids, versions, effective


CHANGES = {5: [0.0, 0.2, 0.8], 11: [0.7, 0.3, 0.0], 23: [1 / 3, 1 / 3, 1 / 3]}


def test_samples_do_not_depend_on_the_number_of_workers(dirs):
    results = []
    for workers in (0, 2, 3):
        with make(dirs, seed=21) as m:
            results.append(run(m, 40, num_workers=workers, changes=CHANGES, batches_per_message=1))
            hist = m.weight_history
        assert [h["from_batch"] for h in hist] == [0, 11, 17, 29]
    for other in results[1:]:
        assert other[0] == results[0][0]
        assert other[1] == results[0][1]


def test_samples_do_not_depend_on_batches_per_message(dirs):
    """Several batches to a worker message: the same samples and the same switch batches as one batch a
    message and as no workers, once lag covers the deepest loader (here 11 batches)."""
    results = []
    for workers, per, expected_per in ((0, None, 1), (2, 1, 1), (2, 4, 4), (3, 2, 2), (1, 5, 5), (2, None, 4)):
        with make(dirs, seed=21, lag=11) as m:
            loader = m.dataloader(num_workers=workers, batches_per_message=per)
            assert loader.batches_per_message == expected_per  # None: as many as lag allows (here 4)
            results.append(run(m, 40, changes=CHANGES, loader=loader))
            assert [h["from_batch"] for h in m.weight_history] == [0, 16, 22, 34]
    for other in results[1:]:
        assert other[0] == results[0][0]
        assert other[1] == results[0][1]


@pytest.mark.parametrize("workers,pf,per,depth", [
    (2, 2, 1, 4), (2, 3, 1, 6), (1, 1, 1, 1),  # one batch a message: torch's num_workers x prefetch_factor
    (2, None, 3, 8), (1, 2, 2, 5), (2, 1, 4, 11),  # (W x pf + 1) x per - 1
])
def test_live_weights_take_effect_exactly_after_the_prefetch_depth(dirs, workers, pf, per, depth):
    kw = {} if pf is None else {"prefetch_factor": pf}
    with make(dirs, seed=2) as m:
        loader = m.dataloader(num_workers=workers, batches_per_message=per, **kw)
        assert loader.prefetch_depth == depth
        ids, versions, eff = run(m, 30, loader=loader, at_batch=False,
                                 changes={6: [0.0, 0.0, 1.0], 14: [1.0, 0.0, 0.0]})
        assert m.lag == depth
        assert eff == {6: 6 + depth, 14: 14 + depth}
    for i, (v, batch_ids) in enumerate(zip(versions, ids)):
        expected = 0 if i < 6 + depth else (1 if i < 14 + depth else 2)
        assert v == expected, (workers, pf, i)
        if expected == 1:
            assert {d for d, _ in batch_ids} == {2}
        if expected == 2:
            assert {d for d, _ in batch_ids} == {0}


def test_default_batches_per_message_follow_the_batch_size(dirs):
    from grape_stream.mixing.compose import message_size

    # The first messages ramp up (the first batch waits for one batch's composing, not 16).
    assert [message_size(t, 16, 2) for t in range(11)] == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 16]
    assert [message_size(t, 3, 1) for t in range(4)] == [1, 2, 3, 3]
    # 512 samples a message, but a depth of at most 64 batches (batch 8: 21 a message, depth 62)
    for batch_size, per in ((8, 21), (64, 8), (256, 2), (600, 1)):
        with make(dirs, batch_size=batch_size) as m:
            loader = m.dataloader(num_workers=2)
            assert (loader.batches_per_message, loader.prefetch_factor) == (per, 1 if per > 1 else 2)
            assert loader.prefetch_depth == (2 * loader.prefetch_factor + 1) * per - 1 <= 64
            assert m.dataloader(num_workers=0).prefetch_depth == 0
    with make(dirs, batch_size=8) as m:  # many workers: fewer batches a message, the depth stays bounded
        loader = m.dataloader(num_workers=8)
        assert loader.batches_per_message == 7 and loader.prefetch_depth == 62
    with make(dirs, lag=10) as m:
        with pytest.raises(ValueError, match="batches_per_message=4 needs lag >= 11"):
            m.dataloader(num_workers=2, batches_per_message=4)
        with pytest.raises(ValueError, match="positive integer"):
            m.dataloader(num_workers=2, batches_per_message=0)


def test_a_new_iteration_continues_mid_message(dirs):
    with make(dirs, seed=9) as m:
        ref = [batch_identities(b) for _, b in zip(range(23), m.dataloader())]
    with make(dirs, seed=9) as m:
        loader = m.dataloader(num_workers=2, batches_per_message=4)
        got = [batch_identities(b) for _, b in zip(range(7), loader)]  # stops inside the second message
        assert m.consumed_batches == 7
        got += [batch_identities(b) for _, b in zip(range(16), loader)]
    assert got == ref


def test_pinned_messages_are_split_into_pinned_batches(dirs):
    import torch

    with make(dirs, seed=10) as m:
        ref = [batch_identities(b) for _, b in zip(range(9), m.dataloader())]
    with make(dirs, seed=10) as m:
        # Without an accelerator torch warns and does not pin; with one, its pin-memory thread splits.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = m.dataloader(num_workers=2, batches_per_message=3, pin_memory=True)
            batches = [b for _, b in zip(range(9), loader)]
    assert [batch_identities(b) for b in batches] == ref
    assert all(b["tokens"].dtype == torch.int64 and b["tokens"].shape[0] == B for b in batches)
    if torch.cuda.is_available():
        assert all(t.is_pinned() for b in batches for t in b.values() if isinstance(t, torch.Tensor))


def test_weights_set_before_the_loader_starts_apply_from_the_first_batch(dirs):
    with make(dirs, seed=6) as m:
        loader = m.dataloader(num_workers=2)
        assert m.set_weights([0.0, 1.0, 0.0]) == 0  # nothing is in flight yet
        batches = [b for _, b in zip(range(6), loader)]
        # now up to (2 workers x prefetch 1 + 1) x 64 batches a message - 1 may be
        assert m.set_weights([1.0, 0.0, 0.0]) == 6 + loader.prefetch_depth == 6 + 62  # depth capped at 64
    assert all(set(b["domain"].tolist()) == {1} and set(b["weights_version"].tolist()) == {1} for b in batches)


def test_a_lag_below_the_prefetch_depth_is_refused(dirs):
    with make(dirs, lag=2) as m:
        with pytest.raises(ValueError, match="prefetch depth 4"):
            m.dataloader(num_workers=2)
        m.dataloader(num_workers=1)  # depth 2: fine


def test_plain_dataloader_with_workers(dirs):
    # With lag= set, a plain DataLoader plus consumed= gives exact, timing-independent switch points.
    with make(dirs, seed=3, lag=4) as m:
        loader = DataLoader(m, batch_size=B, num_workers=2)
        versions = []
        for i, batch in enumerate(loader):
            versions.append(int(batch["weights_version"][0]))
            if i + 1 == 5:
                assert m.set_weights([0.0, 1.0, 0.0], consumed=5) == 9
            if i + 1 == 15:
                break
    assert versions == [0] * 9 + [1] * 6
    # Without any hint the mixer goes by what the workers composed, warns, and records the truth.
    with make(dirs, seed=3) as m:
        loader = DataLoader(m, batch_size=B, num_workers=2)
        got = []
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for i, batch in enumerate(loader):
                got.append((int(batch["batch_index"][0]), int(batch["weights_version"][0])))
                if i == 3:
                    m.set_weights([0.0, 0.0, 1.0])
                if i == 20:
                    break
        assert any("worker timing" in str(x.message) for x in w)
        for batch_index, version in got:
            assert version == m.weights_at(batch_index)[0]  # every sample says which weights composed it


def test_spawned_workers_see_live_weights(dirs):
    with make(dirs, seed=4) as m:
        ref = run(m, 14, changes={3: [0.0, 0.0, 1.0]})
    with make(dirs, seed=4) as m:
        got = run(m, 14, num_workers=1, multiprocessing_context="spawn", changes={3: [0.0, 0.0, 1.0]},
                  batches_per_message=2)  # lag (1 + 1) x 2 - 1 = 3 <= at_batch's 6
    assert got[0] == ref[0] and got[1] == ref[1]
    assert got[1][9] == 1 and got[1][8] == 0


@pytest.mark.timeout(180)
def test_workers_cross_epochs_independently_without_deadlock(tiny_dirs):
    """Streaming's __iter__ starts each epoch with a barrier across the node's workers; the mixer reads by
    random access, so workers that finish a domain's epoch at different batches never wait for each other."""
    with make(tiny_dirs, seed=5, weights=[0.2, 0.3, 0.5]) as m:
        ref_ids, _, _ = run(m, 150)
        st = m.stats()
    assert st["domains"][2]["epochs_completed"] >= 40
    with make(tiny_dirs, seed=5, weights=[0.2, 0.3, 0.5]) as m:
        ids, _, _ = run(m, 150, num_workers=3, persistent_workers=True)
    assert ids == ref_ids
    with make(tiny_dirs, seed=5, weights=[0.2, 0.3, 0.5]) as m:
        it = iter(m)
        samples = [next(it) for _ in range(150 * B)]
    assert [(s["domain"], s["sample_index"]) for s in samples] == [x for batch in ref_ids for x in batch]
    for k, size in enumerate((30, 20, 10)):  # every epoch of every domain is one full pass
        by_epoch: dict[int, list[int]] = {}
        for s in samples:
            if s["domain"] == k:
                by_epoch.setdefault(s["epoch"], []).append(s["sample_index"])
        complete = sorted(by_epoch)[:-1]
        assert len(complete) >= 5
        for e in complete:
            assert sorted(by_epoch[e]) == list(range(size)), (k, e)


def _start(cfg: dict, path: Path) -> subprocess.Popen:
    path.write_text(json.dumps(cfg))
    return subprocess.Popen([sys.executable, str(HERE / "_mixer_run.py"), str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(240)
def test_sigkill_mid_epoch_then_resume_reproduces_the_uninterrupted_run(dirs, tmp_path):
    changes = {6: [0.1, 0.1, 0.8], 13: [0.5, 0.5, 0.0], 21: [0.2, 0.3, 0.5], 34: [0.0, 0.5, 0.5]}
    n_total = 60
    # Reference: uninterrupted, no workers, lag 8 (= (2 workers x prefetch 1 + 1) x 3 batches a message - 1 in
    # the killed run; its checkpoints, every 5 batches, fall inside messages).
    with make(dirs, seed=8, lag=8) as m:
        ref_ids, ref_versions, _ = run(m, n_total, changes=changes, at_batch=False)
    ref_ids = json.loads(json.dumps(ref_ids))  # as the subprocess logs them

    base = {"dirs": dirs, "seed": 8, "batch_size": B, "workers": 2, "batches": 10_000, "batches_per_message": 3,
            "changes": {str(k): v for k, v in changes.items()}, "every": 5}
    # The killed run must stop inside the reference's 60 batches however fast it runs: it holds after 40
    # (a quiet machine once let it race past 60 before the kill landed).
    log1, state = tmp_path / "run1.jsonl", tmp_path / "state.json"
    proc = _start({**base, "log": str(log1), "state": str(state), "hold_after": 40}, tmp_path / "cfg1.json")
    deadline = time.time() + 120
    while len(_read_log(log1)) < 27:
        if proc.poll() is not None:
            raise AssertionError(f"run 1 ended early: {proc.stderr.read()}")
        assert time.time() < deadline, "run 1 made no progress"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole process group: main, workers, resource tracker
    proc.wait()
    first = _read_log(log1)
    killed_prefixes = json.loads(proc.stdout.readline())["prefixes"]
    saved = json.loads(state.read_text())
    assert saved["batch"] % 5 == 0 and 25 <= saved["batch"] <= len(first)
    assert [r["ids"] for r in first] == ref_ids[:len(first)]

    # Resume from the last saved state with a new mixer (here, in the test process, with 2 workers): the
    # same samples and the same weights from there on. Constructing it cleans the killed run's shared
    # memory, which would otherwise make streaming refuse the local directories or leak forever.
    resumed_at = saved["batch"]
    with make(dirs, seed=8) as m:
        dead = [p for p in killed_prefixes if p not in m.shm_prefixes]  # the new mixer may reuse a prefix
        assert not (_segments_of(dead) - _live_segments())  # nothing of the dead run is left
        m.load_state_dict(saved)
        later = {k: v for k, v in changes.items() if k > resumed_at}
        loader = m.dataloader(num_workers=2, batches_per_message=3)
        assert loader.prefetch_depth == 8
        second, versions = [], []
        for batch in loader:
            i = int(batch["batch_index"][0])
            second.append(batch_identities(batch))
            versions.append(int(batch["weights_version"][0]))
            if i + 1 in later:
                m.set_weights(later[i + 1])
            if i + 1 == n_total:
                break
    assert json.loads(json.dumps(second)) == ref_ids[resumed_at:]
    assert versions == ref_versions[resumed_at:]


def _segments_of(prefixes: list[int]) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n[:6].isdigit() and int(n[:6]) in prefixes}


def _live_segments() -> set[str]:
    from grape_stream.streaming_compat.shm import segments_in_use_elsewhere

    return segments_in_use_elsewhere()
