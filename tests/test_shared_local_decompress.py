"""Jobs sharing one local dataset directory (no remote) decompress its shards at once without breaking each
other: streaming 0.13 wrote every process's decompressed shard to the same ``shard.N.mds.tmp`` and renamed it, so
one job renamed the file the other was still writing, and the other's rename failed (``FileNotFoundError:
'.../shard.00000.mds.tmp' -> '.../shard.00000.mds'``: a demo run in CI, uniform and GRAPE side by side)."""

from __future__ import annotations

import threading

import pytest

from grape_stream.streaming_compat.decompress import install_atomic_decompress
from grape_stream.streaming_compat.registration import create_registered
from grape_stream.streaming_compat.shm import release_streaming_dataset

N = 64


@pytest.fixture
def zstd_dataset(tmp_path):
    from streaming import MDSWriter

    out = tmp_path / "ds"
    with MDSWriter(out=str(out), columns={"x": "bytes"}, compression="zstd", size_limit=1 << 14) as w:
        for i in range(N):
            w.write({"x": i.to_bytes(4, "little") * 200})
    return out


def _open(local):
    from streaming import StreamingDataset

    return create_registered(lambda: StreamingDataset(local=str(local), batch_size=1, shuffle=False))


def test_another_process_s_temporary_file_is_not_ours(zstd_dataset):
    """What another job is writing at streaming's shared temporary name (here: a name that cannot be written at
    all) does not stop this one: the temporary name is this process's own."""
    assert install_atomic_decompress()
    raws = sorted(p.with_suffix("") for p in zstd_dataset.glob("shard.*.mds.zstd"))
    assert len(raws) > 1
    for raw in raws:
        raw.with_name(raw.name + ".tmp").mkdir()  # open(..., "wb") on it fails
    ds = _open(zstd_dataset)
    try:
        assert [ds[i]["x"][:4] for i in range(N)] == [i.to_bytes(4, "little") for i in range(N)]
    finally:
        release_streaming_dataset(ds)
    assert all(r.is_file() for r in raws)
    planted = sorted(r.name + ".tmp" for r in raws)
    assert sorted(p.name for p in zstd_dataset.glob("*.tmp")) == planted  # no temporary file of ours is left


def test_concurrent_decompressions_of_one_shard_all_succeed_whole(zstd_dataset):
    """Eight threads decompress the same shard at the same moment, as eight jobs would: each succeeds, the shard
    ends whole, and no temporary file is left."""
    assert install_atomic_decompress()
    ds = _open(zstd_dataset)
    try:
        stream, shard = ds.streams[0], ds.shards[0]
        raw_info, zip_info = shard.file_pairs[0]
        local = zstd_dataset / raw_info.basename
        errors: list[BaseException] = []
        start = threading.Barrier(8)

        def decompress() -> None:
            start.wait()
            try:
                stream._decompress_shard_part(zip_info, str(zstd_dataset / zip_info.basename), str(local),
                                              shard.compression)
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

        threads = [threading.Thread(target=decompress) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert local.stat().st_size == raw_info.bytes
        assert list(zstd_dataset.glob("*.tmp")) == []
    finally:
        release_streaming_dataset(ds)
