"""Packing into fixed-length rows and per-example padding, against slow reference implementations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convert_data import expected_packed
from grape_stream.convert.packing import ExamplePadder, SequencePacker

docs_strategy = st.lists(st.lists(st.integers(0, 99), min_size=0, max_size=40), min_size=0, max_size=30)


@settings(max_examples=80, deadline=None)
@given(docs=docs_strategy, seq_len=st.integers(2, 17), split_at=st.integers(0, 30))
def test_packer_equals_slow_reference_however_docs_are_batched(docs, seq_len, split_at):
    eos = 100
    p = SequencePacker(seq_len, eos, np.uint16, eos="auto", remainder="drop")
    arrs = [np.array(d, dtype=np.uint32) for d in docs]
    rows1, m1 = p.add(arrs[:split_at])
    rows2, m2 = p.add(arrs[split_at:])
    last, _ = p.finish()
    got = np.concatenate([rows1, rows2, last]).astype(np.int64)
    want = expected_packed(docs, seq_len, eos)
    assert got.shape == want.shape and (got == want).all()
    assert m1 is None and m2 is None
    assert rows1.dtype == np.uint16
    stream = sum(len(d) + 1 for d in docs)
    assert p.stats.tokens == got.size and p.stats.dropped_tokens == stream - got.size
    assert p.stats.samples == got.shape[0] and p.stats.documents == len(docs)


def test_eos_modes():
    docs = [np.array([1, 2], np.uint32), np.array([3, 9], np.uint32)]  # second already ends with EOS=9
    auto = SequencePacker(5, 9, np.uint16, eos="auto")
    assert auto.add(docs)[0].tolist() == [[1, 2, 9, 3, 9]]
    always = SequencePacker(6, 9, np.uint16, eos="always")
    assert always.add(docs)[0].tolist() == [[1, 2, 9, 3, 9, 9]]
    none = SequencePacker(4, 9, np.uint16, eos="none")
    assert none.add(docs)[0].tolist() == [[1, 2, 3, 9]]


def test_remainder_pad_keeps_every_token_and_masks_padding():
    p = SequencePacker(4, 0, np.uint16, remainder="pad")
    rows, mask = p.add([np.array([5, 6, 7, 8, 1, 2], np.uint32)])  # stream: 5 6 7 8 1 2 0
    assert rows.tolist() == [[5, 6, 7, 8]] and mask.tolist() == [[1, 1, 1, 1]]
    last, lmask = p.finish()
    assert last.tolist() == [[1, 2, 0, 0]] and lmask.tolist() == [[1, 1, 1, 0]]
    assert p.stats.tokens == 7 and p.stats.padding_tokens == 1 and p.stats.dropped_tokens == 0


def test_example_padder_masks_padding_and_counts_truncation():
    p = ExamplePadder(5, 50256, np.uint16)
    rows, mask = p.add([np.array([1, 2], np.uint32), np.array([1, 2, 3, 4], np.uint32),
                        np.array(list(range(10, 17)), np.uint32)])
    assert rows.tolist() == [[1, 2, 50256, 50256, 50256], [1, 2, 3, 4, 50256], [10, 11, 12, 13, 14]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert p.stats.truncated_examples == 1 and p.stats.truncated_tokens == 3  # 7 tokens + EOS -> 5
    assert p.stats.tokens == 3 + 5 + 5 and p.stats.padding_tokens == 2


@pytest.mark.parametrize("bad", [dict(seq_len=1), dict(eos="sometimes"), dict(remainder="keep")])
def test_packer_rejects_bad_settings(bad):
    kw = dict(seq_len=8, eos="auto", remainder="drop") | bad
    with pytest.raises(ValueError):
        SequencePacker(kw.pop("seq_len"), 0, np.uint16, **kw)
