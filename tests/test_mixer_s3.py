"""The mixer streaming from a real S3-compatible server (moto_server) through streaming's boto3 client."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import boto3
import pytest

from _mds_fixtures import batch_identities, write_domain, write_domains
from grape_stream.mixing.mixer import DomainStream, DomainUnavailableError, RemoteMismatchError, WeightedStreamingMixer

B = 8
SIZES = [320, 240, 200]
SEQ = 256  # 512-byte samples: shards of 8 samples are ~4 KB, so a small cache limit still holds a few


def upload(endpoint: str, bucket: str, local_dir: str, prefix: str) -> str:
    client = boto3.client("s3", endpoint_url=endpoint)
    for path in Path(local_dir).rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local_dir).as_posix()}")
    return f"s3://{bucket}/{prefix}"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("s3src")
    return write_domains(root, SIZES, seq_len=SEQ, samples_per_shard=8)


def _dir_bytes(path: str) -> int:
    total = 0
    for p in Path(path).rglob("*"):
        try:
            if p.is_file() and not p.name.startswith("."):
                total += p.stat().st_size
        except FileNotFoundError:  # a download's temporary file renamed meanwhile
            pass
    return total


def _shards_present(path: str) -> int:
    return len(list(Path(path).glob("shard.*.mds")))


@pytest.mark.timeout(300)
def test_streams_from_s3_with_a_cache_smaller_than_the_data(s3_server, s3_bucket, data, tmp_path):
    remotes = [upload(s3_server, s3_bucket, d, f"mix/d{k}") for k, d in enumerate(data)]
    per_domain = 40_000
    assert all(n * 2 * SEQ > 2 * per_domain for n in SIZES)  # each cache holds under half its domain
    kwargs = dict(weights=[0.5, 0.3, 0.2], batch_size=B, seed=31, shuffle_block_size=16)
    with WeightedStreamingMixer([DomainStream(f"d{k}", local=d) for k, d in enumerate(data)], **kwargs) as m:
        ref = [batch_identities(b) for _, b in zip(range(60), m.dataloader())]
    caches = [str(tmp_path / f"cache{k}") for k in range(3)]
    doms = [DomainStream(f"d{k}", remote=r, local=c) for k, (r, c) in enumerate(zip(remotes, caches))]
    with WeightedStreamingMixer(doms, cache_limit=3 * per_domain, download_retry=1, **kwargs) as m:
        got, peak = [], 0
        for _, b in zip(range(60), m.dataloader(num_workers=2)):
            got.append(batch_identities(b))
            peak = max(peak, max(_dir_bytes(c) for c in caches))
        usage = [int(ds.cache_usage) for ds in m._datasets]
        probe = m.probe(0, 4, key=1)
    assert got == ref  # the same samples as from local disk
    assert [x["domain"] for x in probe] == [0] * 4
    # Bounded by the limit, plus the shards being downloaded concurrently at that moment: streaming
    # reserves no space for in-flight downloads (2 workers, each reading and prefetching).
    shard = max(s["raw_data"]["bytes"] + s["zip_data"]["bytes"] for d in data
                for s in json.loads((Path(d) / "index.json").read_text())["shards"])
    assert peak <= per_domain + 4 * shard
    for k, c in enumerate(caches):
        assert usage[k] <= per_domain + 4 * shard
        assert _shards_present(c) < SIZES[k] // 8 // 2  # evicted: far from all shards at once
    # Streaming records where each cache came from, so a later run can detect a changed remote.
    assert (Path(caches[0]) / ".grape_stream_source.json").is_file()


def test_missing_credentials_are_named_before_any_request(s3_server, s3_bucket, data, tmp_path, monkeypatch):
    remote = upload(s3_server, s3_bucket, data[2], "cred/d2")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    dom = [DomainStream("lowres", remote=remote, local=str(tmp_path / "c"))]
    with pytest.raises(DomainUnavailableError, match=r"'lowres'.*no AWS credentials.*S3_ENDPOINT_URL"):
        WeightedStreamingMixer(dom, batch_size=B)
    # An emulator accepts any signature: opt in to placeholders and it works.
    with WeightedStreamingMixer(dom, batch_size=B, s3_dummy_credentials=True) as m:
        batch = next(iter(m.dataloader()))
    assert set(batch["domain"].tolist()) == {0}
    assert os.environ["AWS_ACCESS_KEY_ID"]


def test_unreachable_remote_names_the_domain_and_url(s3_server, s3_bucket, data, tmp_path, monkeypatch):
    with pytest.raises(DomainUnavailableError, match=rf"'ghost'.*s3://{s3_bucket}/nothing/here/index.json"):
        WeightedStreamingMixer([DomainStream("ghost", remote=f"s3://{s3_bucket}/nothing/here",
                                             local=str(tmp_path / "g"))], batch_size=B, download_retry=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{dead}")
    with pytest.raises(DomainUnavailableError, match=r"'far'.*s3://b/far/index.json.*gave up after \d+ attempt"):
        WeightedStreamingMixer([DomainStream("far", remote="s3://b/far", local=str(tmp_path / "f"))],
                               batch_size=B, download_retry=1, download_timeout=5, retry_deadline=3)


def test_a_cache_directory_of_another_remote_is_not_reused(s3_server, s3_bucket, data, tmp_path):
    ra = upload(s3_server, s3_bucket, data[1], "stale/a")
    rb = upload(s3_server, s3_bucket, data[2], "stale/b")
    cache = str(tmp_path / "shared_cache")
    with WeightedStreamingMixer([DomainStream("x", remote=ra, local=cache)], batch_size=B) as m:
        assert {d for d, _ in batch_identities(next(iter(m.dataloader())))} == {1}
    with pytest.raises(RemoteMismatchError, match=rf"{cache}.*from {ra}.*not {rb}"):
        WeightedStreamingMixer([DomainStream("x", remote=rb, local=cache)], batch_size=B)
    with WeightedStreamingMixer([DomainStream("x", remote=rb, local=cache)], batch_size=B,
                                overwrite_local=True) as m:
        assert {d for d, _ in batch_identities(next(iter(m.dataloader())))} == {2}
    # The same remote re-converted (new index, new shards): the stale cache is dropped with a warning.
    fresh = write_domain(tmp_path / "fresh", 7, 40, seq_len=SEQ, samples_per_shard=8, seed=5)
    client = boto3.client("s3", endpoint_url=s3_server)
    for obj in client.list_objects_v2(Bucket=s3_bucket, Prefix="stale/b/").get("Contents", []):
        client.delete_object(Bucket=s3_bucket, Key=obj["Key"])
    upload(s3_server, s3_bucket, fresh, "stale/b")
    with pytest.warns(UserWarning, match="changed since"):
        m = WeightedStreamingMixer([DomainStream("x", remote=rb, local=cache)], batch_size=B)
    with m:
        assert {d for d, _ in batch_identities(next(iter(m.dataloader())))} == {7}
    # A directory holding an index.json of unknown origin is not trusted either.
    foreign = str(tmp_path / "foreign")
    shutil.copytree(data[0], foreign)
    with pytest.raises(RemoteMismatchError, match="unknown origin"):
        WeightedStreamingMixer([DomainStream("x", remote=ra, local=foreign)], batch_size=B)
