"""Bad input is counted per file in report.json (with examples), never lost silently, and --strict
turns the first one into an error naming the file and the line."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from convert_data import make_docs, read_mds, slimpajama_records, write_jsonl, write_slimpajama_parquet, write_zst
from grape_stream.cli import main as grape_stream_main
from grape_stream.convert.pipeline import ConvertInputError, convert


def cli_main(argv: list[str]) -> int:
    """`grape-stream convert ARGV` through the dispatcher, as a user runs it (known errors: one line)."""
    return grape_stream_main(["convert", *argv])

META = {"redpajama_set_name": "RedPajamaC4"}


def good_line(text: str) -> bytes:
    return json.dumps({"text": text, "meta": META}).encode()


@pytest.fixture(scope="module")
def broken_slimpajama(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    docs = make_docs(40, 5)
    write_zst(root / "a_good.jsonl.zst", [good_line(t) for t in docs[:20]])
    # Every per-line fault in one file. The last line is cut off (no closing quote, no newline).
    lines = [
        good_line(docs[20]),
        b"{not json",
        b'{"text": "caf\xe9 au lait", "meta": {"redpajama_set_name": "RedPajamaC4"}}',
        json.dumps({"meta": META}).encode(),
        json.dumps({"text": "no meta here"}).encode(),
        json.dumps({"text": "   \n ", "meta": META}).encode(),
        b"[1, 2, 3]",
        good_line(docs[21]),
    ]
    data = b"".join(x + b"\n" for x in lines) + b'{"text": "cut off mid-rec'
    (root / "b_lines.jsonl.zst").write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(data))
    # A download cut in half: the zstd frame never ends.
    full = zstandard.ZstdCompressor(write_checksum=True).compress(
        b"".join(good_line(t) + b"\n" for t in make_docs(1500, 6)))
    (root / "c_truncated.jsonl.zst").write_bytes(full[: len(full) // 2])
    # Not zstd at all.
    (root / "d_garbage.jsonl.zst").write_bytes(b"this is not a zstd frame" * 10)
    # Parquet: a truncated file (no footer), and one without the `meta` column.
    write_slimpajama_parquet(root / "e_ok.parquet", slimpajama_records(30, 1), meta_as_string=True)
    raw = (root / "e_ok.parquet").read_bytes()
    (root / "f_truncated.parquet").write_bytes(raw[: len(raw) // 2])
    pq.write_table(pa.table({"text": ["only text"]}), root / "g_nometa.parquet")
    out = tmp_path_factory.mktemp("broken_out") / "out"
    result = convert("slimpajama", [str(root)], str(out), tokenizer="bytes", seq_len=32, progress=False)
    return root, out, result


def test_each_bad_kind_counted_per_file(broken_slimpajama):
    root, out, result = broken_slimpajama
    files = json.loads((out / "report.json").read_text())["files"]
    assert files["a_good.jsonl.zst"] == {"documents": 20, "bad": {}, "examples": []}
    lines = files["b_lines.jsonl.zst"]
    assert lines["documents"] == 2
    assert lines["bad"] == {"invalid_json": 3, "non_utf8": 1, "missing_field": 2, "empty_document": 1}
    by_line = {e["line"]: e for e in lines["examples"]}
    assert by_line[2]["kind"] == "invalid_json" and by_line[9]["kind"] == "invalid_json"
    assert by_line[3]["kind"] == "non_utf8" and "UTF-8" in by_line[3]["reason"]
    assert by_line[4]["reason"] == "no 'text' field" and "redpajama_set_name" in by_line[5]["reason"]
    assert by_line[6]["kind"] == "empty_document" and by_line[7]["kind"] == "invalid_json"
    assert all(e["file"] == "b_lines.jsonl.zst" for e in lines["examples"])
    trunc = files["c_truncated.jsonl.zst"]
    assert trunc["bad"] == {"corrupt_zstd": 1} and "truncated" in trunc["examples"][0]["reason"]
    assert trunc["documents"] > 0  # what decoded before the cut is kept, and counted
    assert files["d_garbage.jsonl.zst"]["bad"] == {"corrupt_zstd": 1} and files["d_garbage.jsonl.zst"]["documents"] == 0
    assert files["e_ok.parquet"] == {"documents": 30, "bad": {}, "examples": []}
    assert files["f_truncated.parquet"]["bad"] == {"truncated_parquet": 1}
    assert files["g_nometa.parquet"]["bad"] == {"missing_field": 1}
    assert "meta" in files["g_nometa.parquet"]["examples"][0]["reason"]


def test_totals_match_what_was_written(broken_slimpajama):
    root, out, result = broken_slimpajama
    report = result.report
    assert report["totals"]["bad"] == {
        "corrupt_zstd": 2, "empty_document": 1, "invalid_json": 3, "missing_field": 3, "non_utf8": 1,
        "truncated_parquet": 1,
    }
    assert result.manifest["bad_input"] == report["totals"]["bad"]
    docs = sum(f["documents"] for f in report["files"].values())
    assert report["totals"]["documents"] == docs == result.manifest["totals"]["documents"]
    assert sum(d["documents"] for d in result.manifest["domains"].values()) == docs


def test_strict_names_file_and_line(broken_slimpajama, tmp_path):
    root, _, _ = broken_slimpajama
    with pytest.raises(ConvertInputError, match=r"b_lines\.jsonl\.zst: line 2: invalid_json"):
        convert("slimpajama", [str(root / "b_lines.jsonl.zst")], str(tmp_path / "o"), tokenizer="bytes",
                seq_len=32, strict=True, progress=False)
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_strict_error_in_a_worker_process_reaches_the_caller(broken_slimpajama, tmp_path):
    root, _, _ = broken_slimpajama
    files = [str(root / "a_good.jsonl.zst"), str(root / "b_lines.jsonl.zst"), str(root / "e_ok.parquet")]
    with pytest.raises(ConvertInputError, match=r"b_lines\.jsonl\.zst: line 2"):
        convert("slimpajama", files, str(tmp_path / "o"), tokenizer="bytes", seq_len=32, strict=True, workers=2,
                progress=False)
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_cli_strict_exits_1_with_message(broken_slimpajama, tmp_path, capsys):
    root, _, _ = broken_slimpajama
    rc = cli_main(["slimpajama", "-i", str(root / "f_truncated.parquet"), "-o", str(tmp_path / "o"),
                   "--tokenizer", "bytes", "--strict", "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "f_truncated.parquet: whole file: truncated_parquet" in err


def test_cli_reports_bad_input_summary(broken_slimpajama, tmp_path, capsys):
    root, _, _ = broken_slimpajama
    rc = cli_main(["slimpajama", "-i", str(root / "b_lines.jsonl.zst"), "-o", str(tmp_path / "o"),
                   "--tokenizer", "bytes", "--seq-len", "16", "--no-progress"])
    assert rc == 0
    assert "invalid_json=3" in capsys.readouterr().out


def test_corrupt_gzip_and_bad_fields_in_generic_jsonl(tmp_path):
    docs = make_docs(10, 2)
    payload = gzip.compress(b"".join(json.dumps({"text": t, "lang": "en"}).encode() + b"\n" for t in docs * 10))
    (tmp_path / "cut.jsonl.gz").write_bytes(payload[: len(payload) // 2])
    write_jsonl(tmp_path / "fields.jsonl", [
        {"text": docs[0], "lang": "en"},
        {"text": 42, "lang": "en"},
        {"text": docs[1], "lang": "../etc"},
        {"text": docs[2]},
        {"text": None, "lang": "en"},
    ])
    r = convert("jsonl", [str(tmp_path)], str(tmp_path / "out"), tokenizer="bytes", seq_len=32,
                domain_field="lang", progress=False)
    files = r.report["files"]
    assert files["cut.jsonl.gz"]["bad"] == {"corrupt_gzip": 1} and files["cut.jsonl.gz"]["documents"] > 0
    assert files["fields.jsonl"]["bad"] == {"bad_field": 2, "missing_field": 2}
    assert files["fields.jsonl"]["documents"] == 1
    reasons = {e["line"]: e["reason"] for e in files["fields.jsonl"]["examples"]}
    assert "not a string" in reasons[2] and "safe directory name" in reasons[3] and "lang" in reasons[4]


def test_bad_tokens_empty_documents_and_count_mismatch_in_pretokenized(tmp_path):
    d = tmp_path / "cluster_5"
    d.mkdir()
    pq.write_table(pa.table({
        "tokens": pa.array([[15496, 995], [], [-1, 3], [50257], [464, 3290, 318]], type=pa.list_(pa.int64())),
        "token_count": [2, 0, 2, 1, 99],
    }), d / "cluster_5_000.tokenized.parquet")
    write_jsonl(tmp_path / "part_0.tokenized.jsonl", [
        {"cluster_id": 1, "tokens": [1, 2], "token_count": 2},
        {"cluster_id": 1, "tokens": ["a"], "token_count": 1},
        {"tokens": [3]},
    ])
    r = convert("climblab", [str(d)], str(tmp_path / "o1"), seq_len=4, progress=False)
    f = r.report["files"]["cluster_5_000.tokenized.parquet"]
    assert f["bad"] == {"bad_tokens": 2, "empty_document": 1, "token_count_mismatch": 1}
    assert f["documents"] == 2  # the mismatched row is kept: tokens win over token_count
    rows = read_mds(tmp_path / "o1" / "cluster_5")
    assert [s["tokens"].tolist() for s in rows] == [[15496, 995, 50256, 464]]
    r2 = convert("climbmix", [str(tmp_path / "part_0.tokenized.jsonl")], str(tmp_path / "o2"), seq_len=2,
                 progress=False)
    assert r2.report["files"]["part_0.tokenized.jsonl"]["bad"] == {"bad_tokens": 1, "missing_field": 1}


def test_parquet_with_damaged_row_group_keeps_the_other_groups(tmp_path):
    recs = slimpajama_records(200, 3)
    path = write_slimpajama_parquet(tmp_path / "x.parquet", recs, meta_as_string=False)  # row groups of 64
    md = pq.ParquetFile(path).metadata
    rg = md.row_group(1)
    start = min(rg.column(i).data_page_offset for i in range(rg.num_columns))
    raw = bytearray(path.read_bytes())
    raw[start:start + 64] = b"\xff" * 64  # smash the second row group's first pages
    path.write_bytes(bytes(raw))
    r = convert("slimpajama", [str(path)], str(tmp_path / "out"), tokenizer="bytes", seq_len=32, progress=False)
    f = r.report["files"]["x.parquet"]
    assert f["bad"] == {"truncated_parquet": 1} and "row group 1" in f["examples"][0]["reason"]
    assert f["documents"] == 200 - 64
