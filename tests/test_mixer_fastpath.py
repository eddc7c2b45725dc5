"""The mixer's one-pass batch read (BatchReader, shard_view) gives exactly the samples of the per-sample
path, refuses shards it cannot read as strided arrays, and the worker transport (PackedBatch) collates
to the same batch as the main process does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from streaming import MDSWriter
from torch.utils.data._utils.collate import default_convert

from _mds_fixtures import batch_identities, write_domains
from grape_stream.mixing.batch_read import BatchReader
from grape_stream.mixing.collate import PackedBatch
from grape_stream.mixing.compose import batch_tensors, packed_batch
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from grape_stream.mixing.shard_view import MappedShard, uniform_layout

SIZES = [90, 50, 30]
B = 12


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("mds"), SIZES, samples_per_shard=16)


def _plans(mixer, n):
    from grape_stream.mixing.topology import RankBatch

    composer, topo = mixer._composer, mixer.topology
    sched = mixer._schedule.effective
    planner = composer.planner()
    plans = [planner.plan(topo.global_batch(j), sched.segments) for j in range(n)]
    return composer, [RankBatch(j, p, topo.first_slot(j), topo.ends_global_batch(j)) for j, p in enumerate(plans)]


def test_one_pass_read_equals_the_per_domain_read(dirs):
    doms = [DomainStream(f"d{k}", local=d) for k, d in enumerate(dirs)]
    with WeightedStreamingMixer(doms, weights=[0.5, 0.3, 0.2], batch_size=B, seed=11) as m:
        composer, plans = _plans(m, 30)
        readers = composer.readers()
        fast = BatchReader(readers)
        for plan in plans:
            a = composer.gather(plan, readers, fast)
            b = composer.gather(plan, readers, None)  # domain by domain, concatenated, permuted
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)
            tensors = batch_tensors(a)
            assert batch_identities(tensors) == list(zip(a["domain"].tolist(), a["sample_index"].tolist()))
        assert fast.enabled  # the fixture's shards are uniform: the fast path served every batch
        for r in readers:
            r.close()


def _write(out, rows, columns):
    with MDSWriter(out=str(out), columns=columns, size_limit=1 << 20) as w:
        for row in rows:
            w.write(row)


def _layout(ds_dir):
    from streaming import StreamingDataset

    from grape_stream.streaming_compat.registration import create_registered
    from grape_stream.streaming_compat.shm import release_streaming_dataset

    # under the registration lock: a multi-rank job on the other xdist worker must not pick this prefix meanwhile
    ds = create_registered(lambda: StreamingDataset(local=str(ds_dir), batch_size=1))
    try:
        shard = ds.shards[0]
        m = MappedShard(f"{ds_dir}/{shard.raw_data.basename}")
        try:
            return uniform_layout(shard, m), m.offsets
        finally:
            m.close()
    finally:
        release_streaming_dataset(ds)


def test_uniform_layout_checks_every_samples_headers(tmp_path):
    same = [{"x": np.arange(8, dtype=np.int32).reshape(2, 4) + i} for i in range(5)]
    layout, _ = _layout(_write_and(tmp_path / "same", same))
    assert layout is not None and [(c.name, c.shape, c.dtype) for c in layout] == [("x", (2, 4), np.dtype(np.int32))]
    # Same byte length, but one sample's shape header differs: the shard must not be read as one array.
    mixed = same[:3] + [{"x": np.arange(8, dtype=np.int32).reshape(4, 2)}] + same[3:]
    layout, offsets = _layout(_write_and(tmp_path / "mixed", mixed))
    assert len(set(np.diff(offsets).tolist())) == 1 and layout is None
    # Different lengths, or a column that is not an array: not uniform either.
    ragged = [{"x": np.arange(4 + i, dtype=np.int32)} for i in range(4)]
    assert _layout(_write_and(tmp_path / "ragged", ragged))[0] is None


def _write_and(out, rows):
    _write(out, rows, {"x": "ndarray"})
    return out


def test_non_uniform_domains_fall_back_with_identical_samples(tmp_path):
    rng = np.random.default_rng(0)
    dirs = []
    for k in range(2):
        d = tmp_path / f"v{k}"
        _write(d, [{"tokens": rng.integers(0, 99, 3 + i % 4).astype(np.int32), "text": f"{k}:{i}"} for i in range(40)],
               {"tokens": "ndarray:int32", "text": "str"})
        dirs.append(str(d))
    doms = [DomainStream(f"v{k}", local=d) for k, d in enumerate(dirs)]
    with WeightedStreamingMixer(doms, weights=[0.6, 0.4], batch_size=8, seed=4) as m:
        composer, plans = _plans(m, 6)
        readers = composer.readers()
        fast = BatchReader(readers)
        for plan in plans:
            got = composer.gather(plan, readers, fast)
            want = composer.gather(plan, readers, None)
            assert got["text"] == want["text"] and all(f"{d}:" in t for d, t in zip(got["domain"], got["text"]))
        assert not fast.enabled
        for r in readers:
            r.close()


def test_packed_batch_collates_like_the_main_process(dirs):
    doms = [DomainStream(f"d{k}", local=d) for k, d in enumerate(dirs)]
    with WeightedStreamingMixer(doms, weights=[0.2, 0.3, 0.5], batch_size=B, seed=5) as m:
        composer, plans = _plans(m, 3)
        readers = composer.readers()
        cols = composer.gather(plans[2], readers, BatchReader(readers))
        packed = packed_batch(cols)
        assert default_convert(packed) is packed  # torch's worker-side convert passes it as is
        assert packed.data["tokens"].dtype != np.int64  # sent at its stored width
        got, want = packed.tensors(), batch_tensors(cols)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]) and got[key].dtype == want[key].dtype, key
        assert isinstance(packed, PackedBatch)
        for r in readers:
            r.close()


def test_messages_of_several_batches_carry_list_columns(tmp_path):
    """A string column (per-sample path, a list per batch) survives several batches to a worker message."""
    rng = np.random.default_rng(1)
    dirs = []
    for k in range(2):
        d = tmp_path / f"s{k}"
        _write(d, [{"tokens": rng.integers(0, 99, 5).astype(np.uint16), "text": f"{k}:{i}"} for i in range(40)],
               {"tokens": "ndarray:uint16", "text": "str"})
        dirs.append(str(d))
    runs = []
    for workers, per in ((0, None), (2, 3)):
        doms = [DomainStream(f"s{k}", local=d) for k, d in enumerate(dirs)]
        with WeightedStreamingMixer(doms, weights=[0.6, 0.4], batch_size=4, seed=4) as m:
            runs.append([b for _, b in zip(range(10), m.dataloader(num_workers=workers, batches_per_message=per))])
    for a, b in zip(*runs):
        assert a["text"] == b["text"] and len(a["text"]) == 4
        assert torch.equal(a["tokens"], b["tokens"]) and b["tokens"].dtype == torch.int64
        assert torch.equal(a["batch_index"], b["batch_index"])


def test_ring_messages_round_trip_and_fall_back_in_band_when_the_slot_is_busy():
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from grape_stream.mixing.compose import RESERVED_KEYS
    from grape_stream.mixing.ring import MessageRing, RingOwner

    def batch(seed, rows=6):
        rng = np.random.default_rng(seed)
        meta = rng.integers(0, 9, (len(RESERVED_KEYS), rows))
        return PackedBatch({"tokens": rng.integers(0, 60000, (rows, 5)).astype(np.uint16),
                            "mask": rng.integers(0, 2, (rows, 5)).astype(np.uint8)}, meta, RESERVED_KEYS, batches=2)

    class Loader:  # stands in for the loader's dataset: the ring entries live as long as it does
        pass

    owner = Loader()
    rings = RingOwner(owner)
    ring = MessageRing(rings.token, worker=0, rows=6, slots=1)
    first, second = batch(1), batch(2)
    sent = ring.pack(first)
    assert not isinstance(sent, PackedBatch)  # columns in the ring, shapes in the message
    assert ring.pack(second) is second  # the only slot is still in use: in-band this once
    got = pickle.loads(ForkingPickler.dumps(sent))  # what the main process unpickles: the batch itself
    assert isinstance(got, PackedBatch) and got.batches == 2
    for key in first.data:
        assert np.array_equal(got.data[key], first.data[key]) and got.data[key].dtype == first.data[key].dtype
    assert np.array_equal(got.meta, first.meta)
    third = batch(3, rows=3)  # a smaller (ramp-up) message reuses the freed slot
    got3 = pickle.loads(ForkingPickler.dumps(ring.pack(third)))
    assert np.array_equal(got3.data["tokens"], third.data["tokens"])
    assert ring.pack(batch(4, rows=12)).meta.shape[1] == 12  # too big for a slot: in-band
    del owner
    import grape_stream.mixing.ring as ring_module

    assert rings.token not in ring_module._RINGS
