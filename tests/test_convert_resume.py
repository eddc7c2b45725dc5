"""Kill a conversion mid-way (SIGKILL), re-run it, and get exactly the bytes of an uninterrupted run."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from convert_data import make_docs, tree_bytes, write_climblab_tree, write_jsonl
from grape_stream.convert.pipeline import ConvertStateError, convert

ARGS = dict(seq_len=32, shard_size="2kb", progress=False)


def wait_for(pred, proc, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"converter exited early ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    raise AssertionError("timed out waiting for the conversion to get there")


def test_kill_and_resume_is_byte_identical_and_skips_finished_domain(tmp_path):
    src = tmp_path / "in"
    write_climblab_tree(src, clusters=(1, 2), files=2, per_file=60)
    ref = convert("climblab", [str(src)], str(tmp_path / "ref"), **ARGS)
    assert ref.units_run == 4

    out = tmp_path / "out"
    env = dict(os.environ, GRAPE_STREAM_CONVERT_TEST_DELAY="1.0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "grape_stream.cli", "convert", "climblab", "--input", str(src), "--out", str(out),
         "--seq-len", "32", "--shard-size", "2kb", "--no-progress"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        # Kill once cluster_1 is finalised and the next unit has written shards but not finished.
        wait_for(lambda: (out / "cluster_1" / "index.json").exists()
                 and glob.glob(str(out / "cluster_2" / "part-00002" / "shard.*")), proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / "manifest.json").exists()  # a partial conversion lists nothing
    assert not (out / "cluster_2" / "index.json").exists()
    assert not (out / "cluster_2" / "part-00002" / "index.json").exists()  # killed mid-unit
    assert sorted(os.listdir(out / ".grape_convert" / "units")) == ["part-00000.json", "part-00001.json"]
    finished_index = (out / "cluster_1" / "index.json").stat().st_mtime_ns

    resumed = convert("climblab", [str(src)], str(out), workers=2, **ARGS)
    assert (resumed.units_run, resumed.units_skipped) == (2, 2)
    assert (out / "cluster_1" / "index.json").stat().st_mtime_ns == finished_index  # finished domain skipped
    assert tree_bytes(out) == tree_bytes(tmp_path / "ref")
    assert resumed.manifest == ref.manifest


def test_rerun_with_other_settings_refuses_then_overwrites(tmp_path):
    write_jsonl(tmp_path / "en.jsonl", [{"text": t} for t in make_docs(30, 1)])
    convert("jsonl", [str(tmp_path / "en.jsonl")], str(tmp_path / "out"), tokenizer="bytes", **ARGS)
    with pytest.raises(ConvertStateError, match="seq_len"):
        convert("jsonl", [str(tmp_path / "en.jsonl")], str(tmp_path / "out"), tokenizer="bytes", seq_len=16,
                progress=False)
    r = convert("jsonl", [str(tmp_path / "en.jsonl")], str(tmp_path / "out"), tokenizer="bytes", seq_len=16,
                overwrite=True, progress=False)
    assert r.units_run == 1 and json.loads((tmp_path / "out" / "manifest.json").read_text())["seq_len"] == 16


def test_refuses_foreign_non_empty_output(tmp_path):
    write_jsonl(tmp_path / "en.jsonl", [{"text": "hello"}])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(ConvertStateError, match="holds no grape-stream conversion"):
            convert("jsonl", [str(tmp_path / "en.jsonl")], str(tmp_path / "out"), tokenizer="bytes",
                    overwrite=overwrite, progress=False)
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"
