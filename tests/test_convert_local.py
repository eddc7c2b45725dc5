"""End-to-end conversions to a local directory, read back with streaming.StreamingDataset."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from convert_data import (
    EXPECTED_TASK_TEXT,
    SLIMPAJAMA_DOMAINS,
    expected_packed,
    make_docs,
    read_mds,
    task_examples,
    tree_bytes,
    wiki_articles,
    write_climblab_tree,
    write_jsonl,
    write_slimpajama_tree,
    write_wiki40b,
)
from grape_stream.cli import main as grape_stream_main
from grape_stream.convert.pipeline import convert
from grape_stream.convert.readers.wiki40b import strip_markers
from grape_stream.convert.tokenization import load_tokenizer


def cli_main(argv: list[str]) -> int:
    """`grape-stream convert ARGV` through the dispatcher, as a user runs it (known errors: one line)."""
    return grape_stream_main(["convert", *argv])

SEQ = 64


def domain_tokens(path) -> np.ndarray:
    rows = [s["tokens"] for s in read_mds(path)]
    return np.stack(rows) if rows else np.zeros((0, SEQ), np.int64)


def split_docs(stream: np.ndarray, eos: int) -> list[np.ndarray]:
    """Complete documents of an EOS-separated stream (the piece after the last EOS is cut)."""
    cuts = np.flatnonzero(stream == eos)
    return [stream[a + 1:b] for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


@pytest.fixture(scope="module")
def slimpajama(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp_in")
    tree = write_slimpajama_tree(root, files=3, per_file=120, seed=11)
    out = tmp_path_factory.mktemp("sp_out") / "w1"
    result = convert("slimpajama", [str(root)], str(out), tokenizer="gpt2", seq_len=SEQ, progress=False)
    return root, tree, out, result


def test_slimpajama_tokens_equal_reference_packing_per_unit(slimpajama):
    root, tree, out, result = slimpajama
    tok = load_tokenizer("gpt2")
    assert set(result.domains) == set(SLIMPAJAMA_DOMAINS)
    for dom in SLIMPAJAMA_DOMAINS:
        want = [expected_packed([tok.encode_batch([r["text"]])[0] for r in recs
                                 if r["meta"]["redpajama_set_name"] == dom], SEQ, 50256)
                for recs in tree.values()]  # units = files, in sorted path order
        want = np.concatenate(want)
        got = domain_tokens(out / dom)
        assert got.dtype == np.uint16
        assert got.shape == want.shape and (got.astype(np.int64) == want).all(), dom
        m = result.manifest["domains"][dom]
        assert m["samples"] == len(got) and m["tokens"] == got.size
        assert m["documents"] == sum(r["meta"]["redpajama_set_name"] == dom for recs in tree.values() for r in recs)


def test_slimpajama_decodes_back_to_source_documents(slimpajama):
    root, tree, out, result = slimpajama
    tok = load_tokenizer("gpt2")
    first = next(iter(tree.values()))
    dom = "RedPajamaBook"
    source = [r["text"] for r in first if r["meta"]["redpajama_set_name"] == dom]
    stream = domain_tokens(out / dom).ravel()
    decoded = [tok.decode(d) for d in split_docs(stream, 50256)]
    assert len(decoded) >= len(source) - 2
    assert decoded[: len(source) - 2] == source[: len(source) - 2]


def test_manifest_and_report_contents(slimpajama):
    root, tree, out, result = slimpajama
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == result.manifest
    assert manifest["tokenizer"] == {"name": "gpt2", "vocab_size": 50257, "eos_id": 50256}
    assert manifest["seq_len"] == SEQ and manifest["dtype"] == "uint16"
    assert manifest["columns"] == {"tokens": "ndarray:uint16"} and manifest["kind"] == "domain"
    assert manifest["sources"] == sorted(tree)
    assert manifest["converter_version"] >= 1 and manifest["source"] == "slimpajama"
    assert manifest["totals"]["documents"] == 360
    assert manifest["totals"]["samples"] == sum(d["samples"] for d in manifest["domains"].values())
    report = json.loads((out / "report.json").read_text())
    assert report["totals"] == {"files": 3, "documents": 360, "bad": {}}
    idx = json.loads((out / "RedPajamaC4" / "index.json").read_text())
    assert idx["version"] == 2 and all(s["compression"] == "zstd" for s in idx["shards"])
    assert [s["raw_data"]["basename"].split("/")[0] for s in idx["shards"]] == [
        "part-00000", "part-00001", "part-00002"]
    assert "table" and "RedPajamaC4" in result.table()


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_same_output_for_one_and_two_workers(slimpajama, tmp_path, monkeypatch, start_method):
    root, tree, out, result = slimpajama
    monkeypatch.setenv("GRAPE_STREAM_CONVERT_START_METHOD", start_method)
    r2 = convert("slimpajama", [str(root)], str(tmp_path / "w2"), tokenizer="gpt2", seq_len=SEQ, workers=2,
                 progress=False)
    assert r2.units_run == 3
    assert tree_bytes(out) == tree_bytes(tmp_path / "w2")


def test_rerun_of_finished_conversion_does_nothing(slimpajama):
    root, tree, out, result = slimpajama
    before = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in tree_bytes(out)}
    again = convert("slimpajama", [str(root)], str(out), tokenizer="gpt2", seq_len=SEQ, progress=False)
    assert again.units_run == 0 and again.manifest == result.manifest
    assert {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in tree_bytes(out)} == before


def test_climblab_packs_gpt2_ids_with_eos_between_documents(tmp_path):
    tree = write_climblab_tree(tmp_path / "in", clusters=(1, 2), files=2, per_file=40)
    r = convert("climblab", [str(tmp_path / "in")], str(tmp_path / "out"), seq_len=SEQ, progress=False)
    assert r.domains == ["cluster_1", "cluster_2"]
    for k in (1, 2):
        want = np.concatenate([expected_packed(docs, SEQ, 50256) for rel, docs in sorted(tree.items())
                               if rel.startswith(f"cluster_{k}/")])
        got = domain_tokens(tmp_path / "out" / f"cluster_{k}")
        assert (got.astype(np.int64) == want).all()
    assert r.manifest["tokenizer"]["name"] == "gpt2"


def test_climblab_rejects_another_tokenizer(tmp_path):
    write_climblab_tree(tmp_path / "in", clusters=(1,), files=1, per_file=3)
    with pytest.raises(ValueError, match="already tokenized"):
        convert("climblab", [str(tmp_path / "in")], str(tmp_path / "out"), tokenizer="bytes", progress=False)


def test_climbmix_cluster_domains(tmp_path):
    tok = load_tokenizer("gpt2")
    docs = [tok.encode_batch([t])[0].tolist() for t in make_docs(80, 3)]
    recs = [{"cluster_id": 1 + i % 3, "tokens": d, "token_count": len(d)} for i, d in enumerate(docs)]
    write_jsonl(tmp_path / "part_0.tokenized.jsonl", recs)
    r = convert("climbmix", [str(tmp_path / "part_0.tokenized.jsonl")], str(tmp_path / "out"), seq_len=SEQ,
                progress=False)
    assert r.domains == ["cluster_1", "cluster_2", "cluster_3"]
    got = domain_tokens(tmp_path / "out" / "cluster_2")
    want = expected_packed([d for i, d in enumerate(docs) if 1 + i % 3 == 2], SEQ, 50256)
    assert (got.astype(np.int64) == want).all()


def test_wiki40b_languages_markers_and_holdout(tmp_path):
    arts = {lang: wiki_articles(60, seed) for seed, lang in enumerate(["en", "fr"])}
    for lang, a in arts.items():
        write_wiki40b(tmp_path / "in", lang, "train", a)
    r = convert("wiki40b", [str(tmp_path / "in")], str(tmp_path / "out"), tokenizer="bytes", seq_len=SEQ,
                holdout=0.25, split_seed=5, remainder="pad", progress=False)
    assert r.domains == ["en", "fr"]
    tok = load_tokenizer("bytes")
    for lang in ("en", "fr"):
        assert set(r.manifest["domains"][lang]["splits"]) == {"train", "val"}
        texts = {}
        for sp in ("train", "val"):
            rows = read_mds(tmp_path / "out" / lang / sp)
            stream = np.concatenate([s["tokens"][s["loss_mask"] == 1] for s in rows])  # pad: nothing lost
            texts[sp] = [tok.decode(d) for d in split_docs(stream, 256)]
        # Independent split assignment: blake2b(seed, file, row) against 0.75.
        import pyarrow.parquet as pq

        raw = pq.read_table(tmp_path / "in" / lang / "train-00000-of-00001.parquet").column("text").to_pylist()
        rel = f"{lang}/train-00000-of-00001.parquet"
        want = {"train": [], "val": []}
        for i, t in enumerate(raw):
            digest = hashlib.blake2b(f"5\x00{rel}\x00{i}".encode(), digest_size=8).digest()
            u = int.from_bytes(digest, "little") / 2.0**64
            want["train" if u < 0.75 else "val"].append(strip_markers(t))
        assert texts == want
        assert 0 < len(want["val"]) < len(want["train"])
        assert "_START_" not in "".join(texts["train"])


def test_large_vocab_tokenizer_writes_uint32(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    docs = make_docs(50, 1)
    words = sorted({w for d in docs for w in d.split()})
    vocab = {f"filler{i}": i for i in range(66_000)}
    vocab.update({w: 66_000 + i for i, w in enumerate(words)})
    vocab["<eos>"] = len(vocab)
    t = Tokenizer(WordLevel(vocab, unk_token="<eos>"))
    t.pre_tokenizer = Whitespace()
    t.save(str(tmp_path / "tok.json"))
    write_jsonl(tmp_path / "big.jsonl", [{"text": d} for d in docs])
    r = convert("jsonl", [str(tmp_path / "big.jsonl")], str(tmp_path / "out"), tokenizer=str(tmp_path / "tok.json"),
                eos_id=vocab["<eos>"], seq_len=SEQ, progress=False)
    assert r.manifest["dtype"] == "uint32" and r.manifest["columns"]["tokens"] == "ndarray:uint32"
    rows = read_mds(tmp_path / "out" / "big")
    assert rows[0]["tokens"].dtype == np.uint32 and int(np.max([s["tokens"].max() for s in rows])) >= 66_000


def test_generic_jsonl_domain_and_split_fields_round_trip_bytes(tmp_path):
    docs = make_docs(200, 9)
    recs = [{"text": d, "lang": ["fr", "de", "es"][i % 3], "split": ["train", "probe"][i % 2]}
            for i, d in enumerate(docs)]
    write_jsonl(tmp_path / "corpus.jsonl", recs)
    r = convert("jsonl", [str(tmp_path / "corpus.jsonl")], str(tmp_path / "out"), tokenizer="bytes", seq_len=SEQ,
                domain_field="lang", split_field="split", progress=False)
    assert r.domains == ["de", "es", "fr"]
    tok = load_tokenizer("bytes")
    for lang in ("de", "fr"):
        for sp in ("probe", "train"):
            assert r.path(lang, sp) == str(tmp_path / "out" / lang / sp)
            stream = domain_tokens(r.path(lang, sp)).ravel()
            got = [tok.decode(d) for d in split_docs(stream, 256)]
            want = [x["text"] for x in recs if x["lang"] == lang and x["split"] == sp]
            assert got == want[: len(got)] and len(got) >= len(want) - 2


def test_cli_hash_split_and_printed_table(tmp_path, capsys):
    write_jsonl(tmp_path / "en.jsonl", [{"text": d} for d in make_docs(300, 2)])
    rc = cli_main(["jsonl", "--input", str(tmp_path / "en.jsonl"), "--out", str(tmp_path / "out"),
                   "--tokenizer", "bytes", "--seq-len", "128", "--split", "train=0.8,probe=0.1,test=0.1"])
    assert rc == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "domain" in printed and "probe" in printed and "total" in printed
    # not a terminal (captured): plain progress lines, units and tokens per domain, no tqdm control codes
    assert "units" in captured.err and "(en " in captured.err and "\r" not in captured.err
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    splits = m["domains"]["en"]["splits"]
    assert set(splits) == {"train", "probe", "test"} and m["split"] == {"train": 0.8, "probe": 0.1, "test": 0.1}
    assert splits["train"]["documents"] > 4 * splits["probe"]["documents"] > 0
    assert sum(s["documents"] for s in splits.values()) == 300


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    argv = ["jsonl", "--input", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"), "--no-progress"]
    assert cli_main(argv) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    assert cli_main(["jsonl", "-i", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "o"), "--holdout", "0.1",
                     "--split-field", "s", "--no-progress"]) == 2
    assert "pick one" in capsys.readouterr().err


def test_task_conversion_one_padded_example_per_sample(tmp_path):
    for layout, exs in task_examples().items():
        write_jsonl(tmp_path / "tasks" / f"{layout}.jsonl", exs)
    long_text = " ".join(make_docs(5, 4))
    write_jsonl(tmp_path / "tasks" / "custom.jsonl", [{"text": "A short custom example."}, {"text": long_text}])
    r = convert("task", [str(tmp_path / "tasks")], str(tmp_path / "out"), tokenizer="gpt2", seq_len=128, progress=False)
    assert r.manifest["kind"] == "task"
    assert r.manifest["columns"] == {"tokens": "ndarray:uint16", "loss_mask": "ndarray:uint8"}
    assert set(r.domains) == set(EXPECTED_TASK_TEXT) | {"custom"}
    tok = load_tokenizer("gpt2")
    for layout, text in EXPECTED_TASK_TEXT.items():
        rows = read_mds(tmp_path / "out" / layout)
        assert len(rows) == 3
        t, m = rows[0]["tokens"], rows[0]["loss_mask"]
        assert t.shape == (128,) and m.dtype == np.uint8
        n = int(m.sum())
        assert (m[:n] == 1).all() and (m[n:] == 0).all()
        assert t[n - 1] == 50256 and tok.decode(t[: n - 1]) == text
    custom = r.manifest["domains"]["custom"]
    assert custom["truncated_examples"] == 1 and custom["samples"] == 2
    rows = read_mds(tmp_path / "out" / "custom")
    assert rows[1]["loss_mask"].all()
    assert tok.decode(rows[1]["tokens"]) == tok.decode(tok.encode_batch([long_text])[0][:128])


def test_split_spec_parsing_and_option_errors(tmp_path):
    from grape_stream.convert.pipeline import parse_split

    assert parse_split("train=0.8,probe=0.1,test=0.1") == {"train": 0.8, "probe": 0.1, "test": 0.1}
    assert parse_split(None, 0.05) == {"train": 0.95, "val": 0.05}
    for bad, match in [("train=0.8,val=0.1", "sum to 1"), ("train", "name=fraction"), ("a/b=1", "split"),
                       ("train=x", "not a number")]:
        with pytest.raises(ValueError, match=match):
            parse_split(bad)
    with pytest.raises(ValueError, match="exclusive"):
        parse_split("train=1", 0.1)
    write_jsonl(tmp_path / "en.jsonl", [{"text": "hello"}])
    for kw, match in [({"compression": "lz9"}, "compression"), ({"hashes": ["nope"]}, "hash"),
                      ({"seq_len": 1}, "seq_len"), ({"workers": 0}, "workers"), ({"eos": "maybe"}, "eos"),
                      ({"domain": "a/b"}, "domain")]:
        with pytest.raises(ValueError, match=match):
            convert("jsonl", [str(tmp_path / "en.jsonl")], str(tmp_path / "o"), tokenizer="bytes", progress=False, **kw)
