"""The BPE trainer: a real tokenizer.json the converter loads, deterministic, byte-level round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zstandard

from grape_stream.convert.tokenization import load_tokenizer
from grape_stream.convert.train_tokenizer import EOS_TOKEN, corpus_texts, main, train_bpe
from grape_stream.errors import ConfigError

TEXTS = ["the quick brown fox jumps over the lazy dog " * 3, "Съешь же ещё этих мягких французских булок",
         "le renard brun rapide saute par-dessus le chien paresseux", "def f(x):\n    return x + 1\n"] * 20


def _jsonl_zst(path: Path, texts: list[str]) -> Path:
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(raw) + b"")
    return path


def test_trained_tokenizer_loads_in_the_converter_and_round_trips(tmp_path: Path) -> None:
    out = train_bpe(TEXTS, 300, tmp_path / "tok.json")
    tok = load_tokenizer(str(out))
    assert tok.vocab_size == 300
    assert tok.eos_id == 0  # the one special token, found by name
    for t in [*TEXTS[:4], "unseen ünïcödé 漢字 text"]:
        ids = tok.encode_batch([t])[0]
        assert tok.decode(ids) == t
    assert len(tok.encode_batch([TEXTS[0]])[0]) < len(TEXTS[0].encode()) / 2  # merges were learned


def test_same_texts_same_tokenizer(tmp_path: Path) -> None:
    a = train_bpe(TEXTS, 300, tmp_path / "a.json").read_text()
    b = train_bpe(TEXTS, 300, tmp_path / "b.json").read_text()
    assert a == b


def test_cli_reads_compressed_jsonl_and_skips_bad_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _jsonl_zst(tmp_path / "a.jsonl.zst", TEXTS)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "fine text here"}\nnot json\n{"other": 1}\n')
    assert list(corpus_texts([str(bad)])) == ["fine text here"]
    assert main(["--input", str(tmp_path / "*.jsonl*"), "--vocab-size", "280", "--out", str(tmp_path / "t.json")]) == 0
    assert load_tokenizer(str(tmp_path / "t.json")).vocab_size == 280
    assert EOS_TOKEN in (tmp_path / "t.json").read_text()
    assert f.exists()


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 258"):
        train_bpe(TEXTS, 100, tmp_path / "t.json")
    with pytest.raises(ConfigError, match="matches no file"):
        main(["--input", str(tmp_path / "nothing*.jsonl"), "--out", str(tmp_path / "t.json")])
