"""Bad input costs bounded memory and linear time (issue 29 item 4): a 64 MB single line is skipped and
counted, a zstd / gzip bomb is decoded in bounded pieces, good lines around them are unchanged."""

from __future__ import annotations

import gzip
import io
import json
import zlib

import pytest
import zstandard

from grape_stream.convert.formats import (
    DEFAULT_MAX_RECORD_BYTES,
    LineTooLong,
    _gzip_chunks,
    _zstd_chunks,
    iter_jsonl,
    raw_lines,
    record_limit,
)
from grape_stream.convert.pipeline import convert

GOOD = [json.dumps({"text": f"a good document number {i}"}).encode() for i in range(3)]


def _zstd_bomb(size: int) -> bytes:
    """One JSON line of `size` bytes of 'a' (an 8 KB frame for 256 MiB), compressed without holding it."""
    cobj = zstandard.ZstdCompressor(level=19).compressobj()
    parts = [cobj.compress(GOOD[0] + b'\n{"text": "')]
    block = b"a" * (1 << 20)
    for _ in range(size >> 20):
        parts.append(cobj.compress(block))
    parts += [cobj.compress(b'"}\n' + GOOD[1] + b"\n"), cobj.flush()]
    return b"".join(parts)


def test_a_64mb_single_line_is_skipped_counted_and_the_rest_converted(tmp_path):
    src = tmp_path / "huge.jsonl"
    with open(src, "wb") as f:
        f.write(GOOD[0] + b"\n" + b'{"text": "')
        f.write(b"x" * (DEFAULT_MAX_RECORD_BYTES + 1))
        f.write(b'"}\n' + GOOD[1] + b"\n" + GOOD[2])  # the last line without a newline
    lines = list(raw_lines(str(src), DEFAULT_MAX_RECORD_BYTES))
    assert lines[0] == GOOD[0] and lines[2:] == [GOOD[1], GOOD[2]]
    assert lines[1] == LineTooLong(len(b'{"text": "') + DEFAULT_MAX_RECORD_BYTES + 1 + len(b'"}'))
    items = list(iter_jsonl(str(src)))  # the converter's default limit: the line is one counted bad input
    assert [i[0] for i in items if isinstance(i, tuple)] == [1, 3, 4]
    assert items[1].kind == "record_too_large" and items[1].index == 2 and "--max-record-size" in items[1].reason


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 16])
def test_lines_split_across_any_chunking_equal_bytes_split(tmp_path, chunk, monkeypatch):
    import grape_stream.convert.formats as formats

    monkeypatch.setattr(formats, "_CHUNK", chunk)
    data = b"\n".join([b"", b"ab", b"c" * 300, b"", b"d" * 99, b"e" * 101, b"tail"])
    (tmp_path / "x.jsonl").write_bytes(data)
    got = list(raw_lines(str(tmp_path / "x.jsonl"), 100))
    want = [LineTooLong(len(x)) if len(x) > 100 else x for x in data.split(b"\n")]
    assert got == want
    assert list(raw_lines(str(tmp_path / "x.jsonl"))) == data.split(b"\n")


def test_max_record_size_is_a_setting_and_a_flag(tmp_path):
    from grape_stream.convert.cli import build_parser, config_from_args

    (tmp_path / "a.jsonl").write_bytes(b"\n".join([GOOD[0], json.dumps({"text": "y" * 3000}).encode(), GOOD[1]]))
    r = convert("jsonl", [str(tmp_path / "a.jsonl")], str(tmp_path / "out"), tokenizer="bytes", seq_len=16,
                domain="web", progress=False, max_record_size="2kb")
    assert r.report["files"]["a.jsonl"]["bad"] == {"record_too_large": 1}
    assert r.report["files"]["a.jsonl"]["documents"] == 2
    manifest = (tmp_path / "out" / "manifest.json").read_text()  # no path of the converting machine in it
    assert "input_root" not in r.manifest and str(tmp_path) not in manifest
    args = build_parser().parse_args(["jsonl", "-i", str(tmp_path), "--out", str(tmp_path / "o2"),
                                      "--max-record-size", "1kb"])
    assert config_from_args(args).max_record_size == "1kb"


def test_a_zstd_bomb_is_decoded_in_bounded_pieces_and_its_line_skipped(tmp_path):
    bomb = _zstd_bomb(256 << 20)
    assert len(bomb) < 16_000  # an 8 KB file that expands to 256 MiB
    biggest = max(len(c) for c in _zstd_chunks(io.BytesIO(bomb)))
    assert biggest <= (16 << 20) + (1 << 16)  # no single 256 MiB decompress() output
    (tmp_path / "bomb.jsonl.zst").write_bytes(bomb)
    with record_limit(1 << 20):
        items = list(iter_jsonl(str(tmp_path / "bomb.jsonl.zst")))
    assert items[0] == (1, {"text": "a good document number 0"})
    assert items[2] == (3, {"text": "a good document number 1"})
    assert items[1].kind == "record_too_large" and items[1].index == 2


def test_a_gzip_bomb_is_decoded_in_bounded_pieces(tmp_path):
    cobj = zlib.compressobj(9, wbits=31)
    bomb = b"".join([cobj.compress(b"a" * (1 << 20)) for _ in range(64)] + [cobj.flush()])
    assert max(len(c) for c in _gzip_chunks(io.BytesIO(bomb))) <= (1 << 20) + (1 << 16)
    assert sum(len(c) for c in _gzip_chunks(io.BytesIO(bomb))) == 64 << 20
    two = gzip.compress(b"one\n") + gzip.compress(b"two\n")  # members still all read
    assert b"".join(_gzip_chunks(io.BytesIO(two))) == b"one\ntwo\n"
