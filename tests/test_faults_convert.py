"""The converter against a failing object store: faults at each of its call sites, outages, credentials.

A real moto_server behind grape_stream.testing.FaultProxy. Each call the converter makes to the store
(the bucket check when an uploader is built, in the parent and in each pool worker; shard uploads; the
partitions' index.json; the merged index.json; report.json; manifest.json) gets faults of its own,
many enough to exhaust botocore's and streaming's own retries, and the conversion must finish with the
same objects as a fault-free one. Credentials: none at all, or refused, is one line at once (never
retried as a network blip); rotated mid-run, the next request uses the new ones, and no unit or shard
looks credentials up again.
"""

from __future__ import annotations

import threading
import time

import boto3
import pytest

from convert_data import make_docs, write_jsonl
from grape_stream.cli import main as grape_stream_main
from grape_stream.convert.pipeline import convert
from grape_stream.testing.credentials import RotatingCredentials

FILES = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("faultconv")
    for i in range(FILES):
        write_jsonl(root / f"part{i}.jsonl", [{"text": t, "d": f"d{j % 2}"} for j, t in enumerate(make_docs(40, i))])
    return root


def _convert(corpus, out: str, stage, workers: int = 2):
    return convert("jsonl", [str(corpus)], out, local=str(stage), tokenizer="bytes", seq_len=64, domain_field="d",
                   shard_size="2kb", workers=workers, progress=False)


def _objects(endpoint: str, bucket: str, prefix: str) -> dict[str, bytes]:
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing")
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            key = o["Key"][len(prefix) + 1:]
            if key not in ("manifest.json", "report.json"):  # they name the staging paths
                out[key] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory, s3_server):
    import uuid

    bucket = f"ref-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    _convert(corpus, f"s3://{bucket}/ref", tmp_path_factory.mktemp("refstage"))
    ref = _objects(s3_server, bucket, "ref")
    assert len([k for k in ref if "shard." in k]) > 2 * FILES  # several shards per unit: many uploads
    return ref


#: (call site, method, path pattern, requests let through first). BOTOCORE_ATTEMPTS + 3 failures in a row outlast
#: botocore's attempts, so each site's fault reaches the converter's own retry policy, and more than once.
#: botocore's attempts are set by the environment, as a user would (AWS_MAX_ATTEMPTS): its default of 5 slept
#: ~7.5 s of random exponential backoff at every site, most of this test's time, without changing its claim.
BOTOCORE_ATTEMPTS = 2
SITES = [
    ("bucket check (parent, start-up)", "HEAD", r"^/{bucket}/?$", 0),
    ("bucket check (a worker's uploader)", "HEAD", r"^/{bucket}/?$", 1),
    ("shard upload", "PUT", r"/shard\.\d+\.mds", 0),
    ("partition index.json", "PUT", r"^/{bucket}/{prefix}/d\d/[^/]+/index\.json", 0),
    ("merged index.json", "PUT", r"^/{bucket}/{prefix}/d\d/index\.json", 0),
    ("report.json", "PUT", r"/report\.json", 0),
    ("manifest.json", "PUT", r"/manifest\.json", 0),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("action", ["500", "reset"])
def test_faults_at_every_call_site_are_ridden_out(fault_proxy, s3_bucket, corpus, reference, tmp_path, action,
                                                  monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", str(BOTOCORE_ATTEMPTS))  # the converter's pool workers inherit it
    faults = BOTOCORE_ATTEMPTS + 3
    for n, (site, method, pattern, skip) in enumerate(SITES):
        prefix = f"site{n}"
        fault_proxy.clear()
        rule = fault_proxy.fail(pattern.format(bucket=s3_bucket, prefix=prefix), method=method, action=action,
                                times=faults, skip=skip)
        _convert(corpus, f"s3://{s3_bucket}/{prefix}", tmp_path / prefix)
        assert rule.hits == faults, f"{site}: the fault did not happen ({rule.hits} hits)"
        assert _objects(fault_proxy.url, s3_bucket, prefix) == reference, site


@pytest.mark.timeout(300)
def test_an_outage_mid_conversion_and_random_500s_with_two_workers(fault_proxy, s3_bucket, corpus, reference,
                                                                    tmp_path):
    fault_proxy.outage_after(20, 10.0)  # starts once 20 requests went through: uploads under way
    t0 = time.monotonic()
    _convert(corpus, f"s3://{s3_bucket}/outage", tmp_path / "a")
    assert time.monotonic() - t0 >= 9 and fault_proxy.stats.refused_windows == 1  # it waited the outage out
    assert _objects(fault_proxy.url, s3_bucket, "outage") == reference
    fault_proxy.clear()
    fault_proxy.set_faults(error_rate=0.2, error_status=500)
    _convert(corpus, f"s3://{s3_bucket}/err500", tmp_path / "b")
    assert fault_proxy.stats.errors > 20
    assert _objects(fault_proxy.url, s3_bucket, "err500") == reference


def _set_env(monkeypatch, env: dict) -> None:
    for k, v in env.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)


def _one_line(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.timeout(120)
def test_no_credentials_is_one_line_at_once(s3_server, s3_bucket, corpus, tmp_path, monkeypatch, capsys):
    _set_env(monkeypatch, RotatingCredentials(tmp_path / "creds").env())
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-such-config"))  # no profile: nothing to find
    monkeypatch.setenv("GRAPE_STREAM_RETRY_DEADLINE", "60")
    t0 = time.monotonic()
    rc = grape_stream_main(["convert", "jsonl", "-i", str(corpus), "-o", f"s3://{s3_bucket}/nocreds", "--local",
                            str(tmp_path / "stage"), "--tokenizer", "bytes", "--no-progress"])
    line = _one_line(capsys)
    assert rc == 1 and time.monotonic() - t0 < 20, line  # not retried until the deadline
    assert "no credentials found" in line and "AWS_ACCESS_KEY_ID" in line and "cannot reach" in line, line


@pytest.mark.timeout(120)
def test_refused_credentials_mid_run_are_one_line_at_once(fault_proxy, s3_bucket, corpus, tmp_path, capsys,
                                                           monkeypatch):
    monkeypatch.setenv("GRAPE_STREAM_RETRY_DEADLINE", "60")
    fault_proxy.fail(r"/shard\.\d+\.mds", method="PUT", action="403")  # the key is revoked after the check
    t0 = time.monotonic()
    rc = grape_stream_main(["convert", "jsonl", "-i", str(corpus), "-o", f"s3://{s3_bucket}/revoked", "--local",
                            str(tmp_path / "stage"), "--tokenizer", "bytes", "--no-progress", "--workers", "2"])
    line = _one_line(capsys)
    assert rc == 1 and time.monotonic() - t0 < 30, line
    assert "access refused (InvalidAccessKeyId)" in line and "AWS_SECRET_ACCESS_KEY" in line, line


@pytest.mark.timeout(300)
def test_credentials_rotated_mid_run_are_picked_up_without_per_unit_lookups(fault_proxy, s3_server, s3_bucket, corpus,
                                                                            reference, tmp_path, monkeypatch):
    creds = RotatingCredentials(tmp_path / "creds", key="KEY-ONE")
    _set_env(monkeypatch, creds.env())
    fault_proxy.accept_keys({"KEY-ONE"})
    stop = threading.Event()

    def rotate_once_uploads_run() -> None:
        while not stop.is_set() and fault_proxy.stats.keys["KEY-ONE"] < 30:
            time.sleep(0.01)
        fault_proxy.accept_keys({"KEY-ONE", "KEY-TWO"})  # as a provider rotates: the new key works first,
        creds.rotate("KEY-TWO")  # then lookups hand it out,
        fault_proxy.accept_keys({"KEY-TWO"})  # then the old one stops working

    t = threading.Thread(target=rotate_once_uploads_run)
    t.start()
    try:
        _convert(corpus, f"s3://{s3_bucket}/rotated", tmp_path / "stage")
    finally:
        stop.set()
        t.join()
    assert fault_proxy.stats.refused_keys >= 1 and fault_proxy.stats.keys["KEY-TWO"] > 0  # it did rotate
    assert _objects(s3_server, s3_bucket, "rotated") == reference
    lookups = creds.lookups()
    # one lookup per process (the start-up check, the parent, 2 workers) and one more per process after the
    # rotation; a session per unit (6) or per shard would be far more
    assert len(lookups) <= 8, lookups
    assert len({pid for pid, _ in lookups}) <= 3
