"""WeightedStreamingMixer over real local MDS domains, in one process (no DataLoader workers)."""

from __future__ import annotations

import os
import shutil
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from _mds_fixtures import batch_identities, identity, write_domains
from grape_stream.mixing.mixer import (
    DomainStream,
    DomainUnavailableError,
    WeightedStreamingMixer,
    collate_samples,
)
from test_mixer_quotas import chi2_pvalue

SIZES = [240, 160, 80]
B = 16


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("mds"), SIZES, samples_per_shard=40)


def make(dirs, weights=None, **kw):
    doms = kw.pop("domains", None) or [DomainStream(f"d{k}", local=d) for k, d in enumerate(dirs)]
    kw.setdefault("batch_size", B)
    return WeightedStreamingMixer(doms, weights=weights, **kw)


def take(mixer, n_batches, loader=None):
    if loader is None:
        loader = DataLoader(mixer, batch_size=mixer.batch_size, num_workers=0)
    out = []
    for i, batch in enumerate(loader):
        out.append(batch)
        if i + 1 == n_batches:
            break
    return out


def test_samples_carry_truthful_metadata_and_exact_quotas(dirs):
    alpha = np.array([0.55, 0.3, 0.15])
    with make(dirs, alpha, seed=3) as m:
        batches = take(m, 40)
    for i, b in enumerate(batches):
        ids = batch_identities(b)
        assert ids == list(zip(b["domain"].tolist(), b["sample_index"].tolist()))  # metadata = content
        assert b["tokens"].dtype == torch.int64 and b["tokens"].shape == (B, 16)
        assert set(b["batch_index"].tolist()) == {i} and set(b["weights_version"].tolist()) == {0}
        counts = np.bincount(b["domain"].numpy(), minlength=3)
        assert np.all(np.abs(counts - B * alpha) < 1)  # systematic: floor or ceil of B * alpha


def test_realised_fractions_match_weights(dirs):
    alpha = np.array([0.6, 0.3, 0.1])
    for composition in ("systematic", "multinomial"):
        with make(dirs, alpha, seed=1, composition=composition) as m:
            it = iter(m)
            domains = [next(it)["domain"] for _ in range(300 * B)]
        observed = np.bincount(domains, minlength=3).astype(float)
        assert chi2_pvalue(observed, alpha * len(domains)) > 1e-3, composition
        assert chi2_pvalue(observed, np.array([0.55, 0.35, 0.1]) * len(domains)) < 1e-6, composition


def test_set_weights_applies_to_the_very_next_batch_without_workers(dirs):
    with make(dirs, seed=2) as m:
        loader = DataLoader(m, batch_size=B)
        got = []
        for i, b in enumerate(loader):
            got.append(b)
            if i == 5:
                assert m.set_weights([0.0, 0.0, 1.0]) == 6
            if i == 9:
                break
        assert m.weights_version == 1 and m.weights.tolist() == [0.0, 0.0, 1.0]
        assert m.weight_history[1]["from_batch"] == 6
    for i, b in enumerate(got):
        versions = set(b["weights_version"].tolist())
        if i <= 5:
            assert versions == {0}
            assert len(set(b["domain"].tolist())) > 1
        else:
            assert versions == {1} and set(b["domain"].tolist()) == {2}


def test_same_seed_same_samples_other_seed_differs(dirs):
    def run(seed):
        with make(dirs, [0.5, 0.25, 0.25], seed=seed) as m:
            it = iter(m)
            return [identity(next(it)) for _ in range(20 * B)]

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c


def test_epochs_reshuffle_and_cover_the_domain(dirs):
    n = SIZES[2]
    with make(dirs, [0.0, 0.0, 1.0], seed=4) as m:
        it = iter(m)
        samples = [next(it) for _ in range(2 * n)]
        m.seek(2 * n // B)
        st = m.stats()
    ep0 = [s["sample_index"] for s in samples if s["epoch"] == 0]
    ep1 = [s["sample_index"] for s in samples if s["epoch"] == 1]
    assert sorted(ep0) == list(range(n)) and sorted(ep1) == list(range(n))  # each epoch: every sample once
    assert ep0 != ep1  # reshuffled
    assert all(s["domain"] == 2 for s in samples)
    d2 = st["domains"][2]
    assert d2["samples_drawn"] == 2 * n and d2["epochs_completed"] == 2
    assert st["domains"][0]["samples_drawn"] == 0


def test_zero_weight_domain_is_never_drawn(dirs):
    with make(dirs, [0.7, 0.0, 0.3], seed=5) as m:
        it = iter(m)
        domains = Counter(next(it)["domain"] for _ in range(100 * B))
    assert domains[1] == 0 and domains[0] > 0 and domains[2] > 0


def test_max_epochs_budget_moves_weight_to_the_others(dirs):
    doms = [DomainStream("d0", local=dirs[0]), DomainStream("d1", local=dirs[1]),
            DomainStream("d2", local=dirs[2], max_epochs=1)]
    with make(dirs, [0.1, 0.1, 0.8], domains=doms, seed=6) as m:
        it = iter(m)
        with pytest.warns(RuntimeWarning, match="'d2' has spent its max_epochs"):
            samples = [next(it) for _ in range(30 * B)]
        m.seek(30)
        st = m.stats()
    d2 = [s["sample_index"] for s in samples if s["domain"] == 2]
    assert sorted(d2) == list(range(SIZES[2]))  # exactly one pass, no repeats
    tail = samples[-10 * B:]
    assert all(s["domain"] != 2 for s in tail)
    assert Counter(s["domain"] for s in tail)[0] > 3 * B  # the others took over
    assert st["domains"][2]["spent"] and st["domains"][2]["effective_weight"] == 0.0


def test_budgets_spent_everywhere_end_the_stream(dirs):
    doms = [DomainStream(f"d{k}", local=d, max_epochs=0.5) for k, d in enumerate(dirs)]
    with make(dirs, domains=doms, seed=0) as m:
        with pytest.warns(RuntimeWarning):
            batches = list(DataLoader(m, batch_size=B))
    total = sum(SIZES) // 2
    assert len(batches) == total // B
    ids = [i for b in batches for i in batch_identities(b)]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("weights, match", [
    ([0.5, 0.5], "has 2 entries but 3 are expected"),
    ([0.5, 0.7, -0.2], "negative"),
    ([0.5, float("nan"), 0.5], "non-finite"),
    ([0.0, 0.0, 0.0], "all zeros"),
])
def test_bad_weights_are_rejected(dirs, weights, match):
    with pytest.raises(ValueError, match=match):
        make(dirs, weights)
    with make(dirs) as m:
        with pytest.raises(ValueError, match=match):
            m.set_weights(weights)
        assert m.weights_version == 0


def test_missing_index_names_the_domain(dirs, tmp_path):
    (tmp_path / "train").mkdir()
    shutil.copytree(dirs[0], tmp_path / "nested" / "train")
    doms = [DomainStream("d0", local=dirs[0]), DomainStream("ghost", local=str(tmp_path / "nested"))]
    with pytest.raises(DomainUnavailableError, match=r"'ghost'.*no MDS index.*\['train'\]"):
        WeightedStreamingMixer(doms, batch_size=B)
    ok = WeightedStreamingMixer([DomainStream("d0", local=str(tmp_path / "nested"), split="train")], batch_size=B)
    ok.close()


def test_configuration_errors(dirs):
    with pytest.raises(ValueError, match="same local directory"):
        WeightedStreamingMixer([DomainStream("a", local=dirs[0]), DomainStream("b", local=dirs[0])], batch_size=B)
    with pytest.raises(ValueError, match="unique"):
        WeightedStreamingMixer([DomainStream("a", local=dirs[0]), DomainStream("a", local=dirs[1])], batch_size=B)
    with pytest.raises(TypeError, match="shuffle_algo"):
        make(dirs, shuffle_algo="py1e")
    with pytest.raises(TypeError, match="unexpected keyword"):
        make(dirs, cache_limt="1gb")
    with pytest.raises(ValueError, match="batch_size"):
        make(dirs, batch_size=0)


def test_probe_is_deterministic_and_independent_of_the_stream(dirs):
    with make(dirs, seed=9) as m:
        a = m.probe(1, 8, key=3)
        it = iter(m)
        for _ in range(50 * B):
            next(it)
        b = m.probe(1, 8, key=3)
        c = m.probe(1, 8, key=4)
        r0 = m.probe(2, 30, key="x", rank=0, world_size=2)
        r1 = m.probe(2, 30, key="x", rank=1, world_size=2)
        with pytest.raises(ValueError, match="without repeats"):
            m.probe(2, 41, key=0, rank=0, world_size=2)
        with pytest.raises(IndexError):
            m.probe(3, 1, key=0)
    ids = lambda samples: [identity(s) for s in samples]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert all(d == 1 and s["domain"] == 1 and s["sample_index"] == i for s, (d, i) in zip(a, ids(a)))
    assert isinstance(a[0]["tokens"], np.ndarray)
    assert not set(ids(r0)) & set(ids(r1))
    batch = collate_samples(a)
    assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (8, 16)


def test_state_dict_resume_replays_exactly(dirs):
    def run(mixer, n_batches, changes):
        loader = mixer.dataloader()
        out = []
        for b in loader:
            i = int(b["batch_index"][0])
            out.append(batch_identities(b))
            if i in changes:
                mixer.set_weights(changes[i])
            if len(out) == n_batches:
                break
        return out

    changes = {7: [0.1, 0.1, 0.8], 15: [0.6, 0.2, 0.2], 27: [0.0, 1.0, 0.0]}
    with make(dirs, seed=12) as m:
        full = run(m, 40, changes)
    with make(dirs, seed=12) as m:
        first = run(m, 20, changes)
        sd = m.state_dict()  # Composer passes num_samples: the same state
        assert m.state_dict(20 * B, True) == sd
        assert m.dataloader().dataset.state_dict(20 * B, True) == sd  # Composer looks at loader.dataset
    assert first == full[:20]
    assert sd["batch"] == 20 and len(sd["schedule"]) == 3
    with make(dirs, seed=12) as m2:
        m2.load_state_dict(sd)
        assert m2.state_dict(0, from_beginning=False)["batch"] == 20
        rest = run(m2, 20, {k: v for k, v in changes.items() if k >= 20})
    assert rest == full[20:]
    with make(dirs, seed=13) as m3:  # another stream: refused with one line naming the difference
        with pytest.raises(ValueError, match="seed: checkpoint 12 vs this mixer 13") as err:
            m3.load_state_dict(sd)
        assert "\n" not in str(err.value)
        edited = {**sd, "positions": [p + 1 for p in sd["positions"]]}
        with pytest.raises(ValueError, match="not where its weight schedule leads"):
            m3.load_state_dict({**edited, "seed": 13})
    with make(dirs, seed=12) as m4:
        with pytest.raises(ValueError, match="whole number of global batches"):
            m4.state_dict(B + 1, True)


def test_reiterating_continues_where_the_consumer_stopped(dirs):
    with make(dirs, seed=1) as m:
        loader = m.dataloader()
        first = take(m, 5, loader)
        second = take(m, 3, loader)
        assert [int(b["batch_index"][0]) for b in first + second] == list(range(8))
        plain = DataLoader(m, batch_size=B)
        third = take(m, 2, plain)  # without workers the mixer sees what was consumed
        assert [int(b["batch_index"][0]) for b in third] == [8, 9]
        assert m.consumed_batches == 10  # batches 0..9 were handed out


def test_other_columns_pass_through(tmp_path):
    from streaming import MDSWriter

    out = str(tmp_path / "masked")
    with MDSWriter(out=out, columns={"tokens": "ndarray:uint16", "loss_mask": "ndarray:uint8", "id": "int"}) as w:
        for i in range(20):
            w.write({"tokens": np.full(4, i, np.uint16), "loss_mask": np.array([1, 1, 0, 0], np.uint8), "id": i})
    with WeightedStreamingMixer([DomainStream("t", local=out)], batch_size=4) as m:
        b = next(iter(DataLoader(m, batch_size=4)))
        b2 = next(iter(m.dataloader()))  # whole batches composed in the mixer: same collation
    for batch in (b, b2):
        assert batch["loss_mask"].dtype == torch.uint8 and batch["loss_mask"].shape == (4, 4)
        assert (batch["tokens"][:, 0] == batch["id"]).all() and (batch["id"] == batch["sample_index"]).all()
        assert batch["tokens"].dtype == torch.int64


def test_reserved_column_is_refused(tmp_path):
    from streaming import MDSWriter

    out = str(tmp_path / "clash")
    with MDSWriter(out=out, columns={"tokens": "ndarray:uint16", "domain": "int"}) as w:
        for _ in range(4):
            w.write({"tokens": np.zeros(2, np.uint16), "domain": 0})
    with pytest.raises(ValueError, match="reserved"):
        WeightedStreamingMixer([DomainStream("t", local=out)], batch_size=2)
    assert os.path.isdir(out)


def test_streaming_streams_are_accepted_as_domains(dirs):
    """mosaicml-streaming users' `WeightedStreamingMixer([Stream(...)])` and `streams=`: each Stream a domain named
    by its path, `proportion` (normalised) the initial weight; the same batches as the DomainStream spelling."""
    from streaming import Stream

    streams = [Stream(local=d, proportion=p) for d, p in zip(dirs, (2, 1, 1))]
    a = WeightedStreamingMixer(streams, batch_size=B, seed=3)
    b = WeightedStreamingMixer(streams=streams, batch_size=B, seed=3)
    names = [os.path.basename(d) for d in dirs]
    assert a.domain_names == b.domain_names == names
    assert a.weights.tolist() == pytest.approx([0.5, 0.25, 0.25])
    got = [batch_identities(x) for x in take(a, 3)]
    assert got == [batch_identities(x) for x in take(b, 3)]
    a.close()
    b.close()
    c = WeightedStreamingMixer([DomainStream(n, local=d) for n, d in zip(names, dirs)], weights=[0.5, 0.25, 0.25],
                               batch_size=B, seed=3)
    assert [batch_identities(x) for x in take(c, 3)] == got
    c.close()
    d = WeightedStreamingMixer([Stream(local=x) for x in dirs], weights=[0.2, 0.3, 0.5], batch_size=B)
    assert d.weights.tolist() == pytest.approx([0.2, 0.3, 0.5])  # no proportions: weights= (default uniform)
    d.close()

    with pytest.raises(TypeError, match="needs domains="):
        WeightedStreamingMixer(batch_size=B)
    with pytest.raises(TypeError, match="not both"):
        WeightedStreamingMixer(streams, streams=streams, batch_size=B)
    with pytest.raises(ValueError, match="every Stream a proportion, or none"):
        WeightedStreamingMixer([Stream(local=dirs[0], proportion=1), Stream(local=dirs[1])], batch_size=B)
    with pytest.raises(ValueError, match="repeat= / choose="):
        WeightedStreamingMixer([Stream(local=dirs[0], repeat=2)], batch_size=B)
    with pytest.raises(ValueError, match="pass download_retry= to WeightedStreamingMixer"):
        WeightedStreamingMixer([Stream(local=dirs[0], download_retry=5)], batch_size=B)


def test_a_stream_of_a_split_folder_is_named_by_its_domain(caplog):
    """`Stream(local=out/en/train)` (grape-stream convert's <domain>/<split> layout) is domain `en`, not `train`
    (two such streams were `train_1`, `train_2`); names that still repeat get a suffix and a warning line."""
    from streaming import Stream

    from grape_stream.mixing.domains import _from_streams

    named, _ = _from_streams([Stream(local="/data/out/en/train"), Stream(local="/data/out/fr/train"),
                              Stream(remote="s3://b/out/de/validation", local="/cache/x"),
                              Stream(local="/data/out/nl/probe", split="probe")])
    assert [d.name for d in named] == ["en", "fr", "de", "nl"]
    assert named[0].local == "/data/out/en/train" and named[0].split is None  # the same data, only the name
    with caplog.at_level("WARNING", logger="grape_stream"):
        named, _ = _from_streams([Stream(local="/a/web"), Stream(local="/b/web")])
    assert [d.name for d in named] == ["web_1", "web_2"]
    assert sum("streams end in 'web'" in r.getMessage() for r in caplog.records) == 2
