"""An index.json from a bucket or a cache is untrusted: its file names never leave the cache, its counts fit
its shards (issue 29). Hand-made bad indexes on a local remote, a local domain, a stale cache and S3."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import boto3
import pytest

from _mds_fixtures import batch_identities, write_domain
from grape_stream.errors import DataError
from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer
from grape_stream.streaming_compat.index_check import UnsafeIndexError, check_index, inside
from grape_stream.streaming_compat.local_index import MARKER_NAME, sync_local_index

SEQ = 32


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    return write_domain(tmp_path_factory.mktemp("good") / "d", 3, 40, seq_len=SEQ, samples_per_shard=8)


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _with_index(src: str, dest: Path, edit) -> str:
    shutil.copytree(src, dest)
    index = json.loads((dest / "index.json").read_text())
    edit(index["shards"])
    (dest / "index.json").write_text(json.dumps(index))
    return str(dest)


def _set(key: str, name: str, n: int = 0):
    def edit(shards):
        shards[n][key] = dict(shards[n].get(key) or {"bytes": 10, "hashes": {}}, basename=name)
    return edit


@pytest.mark.parametrize("key,name", [
    ("zip_data", "../../escaped/shard.00000.mds.zstd"),
    ("raw_data", "../escaped.mds"),
    ("raw_data", "/tmp/grape_escaped_abs.mds"),
    ("raw_meta", "a/../../b.json"),
    ("zip_meta", "link/x.mds"),  # a symlink inside the cache that resolves outside it
])
def test_an_escaping_remote_index_is_refused_before_anything_is_written(good, tmp_path, key, name):
    remote = _with_index(good, tmp_path / "remote", _set(key, name))
    cache = tmp_path / "run" / "cache"
    cache.mkdir(parents=True)
    (cache / "link").symlink_to(tmp_path)
    before = _tree(tmp_path)
    with pytest.raises(UnsafeIndexError) as info:
        sync_local_index("web", remote, str(cache))
    msg = str(info.value)
    assert "\n" not in msg and "'web'" in msg and repr(name) in msg and key in msg
    assert isinstance(info.value, DataError)
    assert _tree(tmp_path) == before  # no index installed, no marker, nothing outside
    assert not os.path.exists("/tmp/grape_escaped_abs.mds")


def test_the_mixer_refuses_an_escaping_index_on_a_local_remote(good, tmp_path):
    remote = _with_index(good, tmp_path / "remote", _set("zip_data", "../../escaped/shard.00000.mds.zstd"))
    cache = tmp_path / "a" / "b" / "cache"
    with pytest.raises(UnsafeIndexError, match=r"'web'.*'\.\./\.\./escaped/shard\.00000\.mds\.zstd'"):
        WeightedStreamingMixer([DomainStream("web", remote=remote, local=str(cache))], batch_size=4)
    assert not (tmp_path / "a" / "escaped").exists() and not (tmp_path / "escaped").exists()
    # the good remote through the same path reads its samples
    with WeightedStreamingMixer([DomainStream("web", remote=good, local=str(tmp_path / "ok"))],
                                batch_size=4, seed=1) as m:
        assert {d for d, _ in batch_identities(next(iter(m.dataloader())))} == {3}


def test_an_outdated_cached_index_deletes_nothing_outside_the_cache(good, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    cache = tmp_path / "cache"
    cache.mkdir()
    old = json.loads((Path(good) / "index.json").read_text())
    old["shards"][0]["raw_data"]["basename"] = str(victim)  # an absolute name: planted in the cache
    (cache / "index.json").write_text(json.dumps(old))
    (cache / MARKER_NAME).write_text(json.dumps({"remote": good, "index_sha256": "0"}))
    with pytest.raises(UnsafeIndexError, match=rf"refusing raw_data basename '{victim}'"):
        sync_local_index("web", good, str(cache))
    assert victim.read_text() == "keep me"
    # a relative escape too
    old["shards"][0]["raw_data"]["basename"] = "../victim.txt"
    (cache / "index.json").write_text(json.dumps(old))
    with pytest.raises(UnsafeIndexError, match=r"'\.\./victim\.txt'"):
        sync_local_index("web", good, str(cache))
    assert victim.read_text() == "keep me"


def test_a_changed_remote_still_replaces_the_stale_cached_shards(good, tmp_path):
    remote, cache = tmp_path / "remote", tmp_path / "cache"
    shutil.copytree(good, remote)
    sync_local_index("web", str(remote), str(cache))
    stale = json.loads((cache / "index.json").read_text())["shards"][0]["zip_data"]["basename"]
    shutil.copy(remote / stale, cache / stale)  # as streaming would have downloaded it
    shutil.rmtree(remote)
    write_domain(remote, 4, 24, seq_len=SEQ, samples_per_shard=8, seed=2)  # re-converted
    with pytest.warns(UserWarning, match="changed since"):
        sync_local_index("web", str(remote), str(cache))
    assert not (cache / stale).exists()
    assert (cache / "index.json").read_bytes() == (remote / "index.json").read_bytes()


def test_a_lying_sample_count_is_refused_in_one_line(good, tmp_path):
    def lie(shards):
        shards[0]["samples"] = 10**9
    local = _with_index(good, tmp_path / "liar", lie)
    with pytest.raises(UnsafeIndexError, match=r"'web'.*claims 1000000000 samples in a \d+-byte MDS shard") as info:
        WeightedStreamingMixer([DomainStream("web", local=local)], batch_size=4)
    assert "\n" not in str(info.value)

    def grow(shards):  # the bytes claimed too: the shard on disk says otherwise
        shards[0]["samples"] = 10**9
        shards[0]["raw_data"]["bytes"] = 4 * 10**9 + 8
        shards[0]["zip_data"]["bytes"] += 1
    local = _with_index(good, tmp_path / "liar2", grow)
    with pytest.raises(UnsafeIndexError, match=r"is \d+ bytes on disk but the index claims"):
        check_index("web", os.path.join(local, "index.json"))
    assert check_index("web", os.path.join(good, "index.json"))["shards"]  # the honest index passes


def test_inside_keeps_names_under_the_folder(tmp_path):
    assert inside(str(tmp_path), "unit0/shard.00000.mds") == str(tmp_path / "unit0/shard.00000.mds")
    for bad in ("", "..", "../x", "a/../../x", "/etc/passwd", None, 3, "a\x00b", "."):
        assert inside(str(tmp_path), bad) is None, bad


@pytest.mark.timeout(120)
def test_an_escaping_index_in_a_bucket_is_refused(s3_server, s3_bucket, good, tmp_path):
    bad = _with_index(good, tmp_path / "bad", _set("zip_data", "../../escaped/shard.00000.mds.zstd"))
    client = boto3.client("s3", endpoint_url=s3_server)
    for path in Path(bad).rglob("*"):
        if path.is_file():
            client.upload_file(str(path), s3_bucket, f"evil/{path.relative_to(bad).as_posix()}")
    client.upload_file(str(Path(bad) / os.listdir(bad)[0]), s3_bucket, "escaped/shard.00000.mds.zstd")
    root = tmp_path / "node"
    cache = root / "x" / "y" / "cache"
    with pytest.raises(UnsafeIndexError, match=r"'web'.*'\.\./\.\./escaped/shard\.00000\.mds\.zstd'"):
        WeightedStreamingMixer([DomainStream("web", remote=f"s3://{s3_bucket}/evil", local=str(cache))],
                               batch_size=4, download_retry=0)
    assert _tree(root) <= {"x", "x/y", "x/y/cache"}  # nothing written outside the (empty) cache
