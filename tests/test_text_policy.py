"""The converter's text policy: lone surrogates and control characters repaired or skipped, huge
documents tokenized in pieces with exactly the token ids of the whole text."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from grape_stream.convert.text_policy import MAX_PIECE_CHARS, clean_text, split_for_tokenizer
from grape_stream.convert.tokenization import load_tokenizer


def test_clean_text_leaves_good_text_alone():
    for text in ["plain", "tabs\tand\nnewlines\r\n", "page\x0cbreak", "é 日本語 ✓"]:
        assert clean_text(text) == clean_text(text, "skip") and clean_text(text).text == text
        assert clean_text(text).kind is None


def test_lone_surrogates_and_control_characters_are_repaired_or_skipped():
    text = json.loads('"a\\ud800b\\u0000c\\udfffd"')  # what json.loads gives for a crawl's broken escape
    with pytest.raises(UnicodeEncodeError):
        text.encode("utf-8")
    fixed = clean_text(text)
    assert fixed.text == "a\ufffdbc\ufffdd" and fixed.kind == "repaired_text"
    assert "2 lone surrogate(s)" in fixed.reason and "1 control character(s)" in fixed.reason
    fixed.text.encode("utf-8")  # now encodable
    skipped = clean_text(text, "skip")
    assert skipped.text is None and skipped.kind == "unencodable_text"
    with pytest.raises(ValueError, match="text policy"):
        clean_text(text, "ignore")


@pytest.mark.parametrize("tokenizer", ["gpt2", "bytes"])
def test_pieces_tokenize_exactly_like_the_whole_text(tokenizer):
    rng = random.Random(0)
    words = ["the", "  cat", " sat", "\n\non", "’s", "don't", "123", "4567", "ab,", "  ", "x" * 50, " \t ", "é", "日本"]
    text = "".join(rng.choice(words) + rng.choice(["", " ", "  ", "\n"]) for _ in range(30_000))
    tok = load_tokenizer(tokenizer)
    whole = tok.encode_batch([text])[0]
    for max_chars in (700, 10_000):
        pieces = split_for_tokenizer(text, max_chars)
        assert "".join(pieces) == text and len(pieces) > 3
        assert max(map(len, pieces)) <= max_chars + 60  # one 'word' may overhang
        assert np.array_equal(np.concatenate(tok.encode_batch(pieces)), whole)


def test_a_text_without_spaces_is_cut_too():
    text = "日本語のテキスト" * 375_000  # 3M characters, no space: the memory bound holds for it too
    pieces = split_for_tokenizer(text)
    assert "".join(pieces) == text and max(map(len, pieces)) <= MAX_PIECE_CHARS and len(pieces) == 3
    assert split_for_tokenizer("y" * 5000, 1000) == ["y" * 1000] * 5
    assert split_for_tokenizer("short", 1000) == ["short"]
    assert split_for_tokenizer("y" * 1000 + " " + "z" * 10, 1000) == ["y" * 1000, " " + "z" * 10]  # a space just after


def _jsonl_with_broken_records(path) -> None:
    lines = [
        '{"text": "a good first document", "domain": "web"}',
        '{"text": "broken \\ud800 surrogate", "domain": "web"}',  # a lone surrogate, as crawls have
        '{"text": "nul\\u0000 inside", "domain": "web"}',
        '{"text": "a good last document", "domain": "web"}',
    ]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_a_conversion_repairs_broken_text_and_counts_it_with_file_and_line(tmp_path, tokenizer):
    from grape_stream.convert import convert

    src = tmp_path / "in.jsonl"
    _jsonl_with_broken_records(src)
    res = convert("jsonl", [str(src)], str(tmp_path / "out"), tokenizer=tokenizer, seq_len=16,
                  domain_field="domain", progress=False)
    rep = res.report["files"]["in.jsonl"]
    assert rep["documents"] == 4 and rep["bad"] == {"repaired_text": 2}  # nothing good lost, both counted
    assert [(e["kind"], e["line"]) for e in rep["examples"]] == [("repaired_text", 2), ("repaired_text", 3)]
    assert "lone surrogate" in rep["examples"][0]["reason"]


def test_skip_policy_drops_and_strict_stops_at_file_and_line(tmp_path):
    from grape_stream.convert import ConvertInputError, convert

    src = tmp_path / "in.jsonl"
    _jsonl_with_broken_records(src)
    res = convert("jsonl", [str(src)], str(tmp_path / "skip"), tokenizer="bytes", seq_len=16,
                  domain_field="domain", text_policy="skip", progress=False)
    rep = res.report["files"]["in.jsonl"]
    assert rep["documents"] == 2 and rep["bad"] == {"unencodable_text": 2}
    with pytest.raises(ConvertInputError, match=r"in\.jsonl: line 2: repaired_text: 1 lone surrogate"):
        convert("jsonl", [str(src)], str(tmp_path / "strict"), tokenizer="bytes", seq_len=16,
                domain_field="domain", strict=True, progress=False)
