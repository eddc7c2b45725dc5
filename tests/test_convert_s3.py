"""Conversion straight to object storage: a real S3 server (moto_server), read back with streaming."""

from __future__ import annotations

import json

import boto3
import numpy as np

from convert_data import make_docs, read_mds, write_jsonl, write_slimpajama_tree
from grape_stream.cli import main as grape_stream_main
from grape_stream.convert.pipeline import convert


def cli_main(argv: list[str]) -> int:
    """`grape-stream convert ARGV` through the dispatcher, as a user runs it (known errors: one line)."""
    return grape_stream_main(["convert", *argv])


def s3_keys(endpoint: str, bucket: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=endpoint)
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))


def s3_json(endpoint: str, bucket: str, key: str) -> dict:
    return json.loads(boto3.client("s3", endpoint_url=endpoint).get_object(Bucket=bucket, Key=key)["Body"].read())


def test_convert_to_s3_reads_back_identical_to_local(s3_server, s3_bucket, tmp_path):
    src = tmp_path / "in"
    write_slimpajama_tree(src, files=3, per_file=80, seed=4)
    local = convert("slimpajama", [str(src)], str(tmp_path / "local_out"), seq_len=64, progress=False)
    remote = f"s3://{s3_bucket}/corpora/slimpajama"
    r = convert("slimpajama", [str(src)], remote, local=str(tmp_path / "stage"), seq_len=64, workers=2, progress=False)
    assert r.out == remote and r.manifest["domains"] == local.manifest["domains"]
    keys = s3_keys(s3_server, s3_bucket)
    assert "corpora/slimpajama/manifest.json" in keys and "corpora/slimpajama/report.json" in keys
    assert s3_json(s3_server, s3_bucket, "corpora/slimpajama/manifest.json") == r.manifest
    for dom in r.domains:
        assert f"corpora/slimpajama/{dom}/index.json" in keys
        got = read_mds(r.path(dom), tmp_path / "cache" / dom)
        want = read_mds(local.path(dom))
        assert len(got) == len(want) == r.manifest["domains"][dom]["samples"]
        assert all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(got, want))
    # Staging keeps the small index files (resume, merging) but not the uploaded shards.
    staged = [p.name for p in (tmp_path / "stage").rglob("shard.*")]
    assert staged == []
    again = convert("slimpajama", [str(src)], remote, local=str(tmp_path / "stage"), seq_len=64, progress=False)
    assert again.units_run == 0


def test_cli_to_s3_with_splits_and_default_staging(s3_server, s3_bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    recs = [{"text": t, "lang": "fr" if i % 2 else "de", "split": "probe" if i % 5 == 0 else "train"}
            for i, t in enumerate(make_docs(120, 8))]
    write_jsonl(tmp_path / "demo.jsonl", recs)
    out = f"s3://{s3_bucket}/demo"
    rc = cli_main(["jsonl", "-i", str(tmp_path / "demo.jsonl"), "-o", out, "--tokenizer", "bytes", "--seq-len", "128",
                   "--domain-field", "lang", "--split-field", "split", "--no-progress"])
    assert rc == 0 and f"to {out}" in capsys.readouterr().out
    assert list((tmp_path / "cache" / "grape_stream" / "convert").iterdir())  # default staging under the cache
    rows = read_mds(f"{out}/fr/probe", tmp_path / "read")
    text = bytes(np.concatenate([s["tokens"] for s in rows]).astype(np.uint8)[:30]).decode("utf-8", "ignore")
    first = next(x["text"] for x in recs if x["lang"] == "fr" and x["split"] == "probe")
    assert first.startswith(text[:20])


def test_missing_bucket_fails_fast_with_endpoint_in_message(s3_server, tmp_path, capsys):
    write_jsonl(tmp_path / "en.jsonl", [{"text": "hello"}])
    rc = cli_main(["jsonl", "-i", str(tmp_path / "en.jsonl"), "-o", "s3://no-such-bucket-xyz/p", "--local",
                   str(tmp_path / "stage"), "--tokenizer", "bytes", "--no-progress"])
    assert rc == 1  # a StorageError: one line, exit status 1
    err = capsys.readouterr().err
    assert "s3://no-such-bucket-xyz/p" in err and s3_server in err
