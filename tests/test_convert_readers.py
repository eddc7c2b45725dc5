"""Dataset readers on files in their exact published layouts (no MDS writing here)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from convert_data import (
    EXPECTED_TASK_TEXT,
    slimpajama_records,
    task_examples,
    write_climblab_tree,
    write_jsonl,
    write_slimpajama_parquet,
    write_slimpajama_tree,
    write_wiki40b,
)
from grape_stream.convert.readers import BadInput, Record, build_reader
from grape_stream.convert.readers.generic import domain_from_path
from grape_stream.convert.readers.tasks import detect_layout


def records(reader, path):
    items = list(reader.read(str(path)))
    return [r for r in items if isinstance(r, Record)], [b for b in items if isinstance(b, BadInput)]


def test_slimpajama_jsonl_zst_domain_is_set_name(tmp_path):
    tree = write_slimpajama_tree(tmp_path, files=1, per_file=40)
    (rel, recs), = tree.items()
    got, bad = records(build_reader("slimpajama"), tmp_path / rel)
    assert not bad
    assert [r.text for r in got] == [r["text"] for r in recs]
    assert [r.domain for r in got] == [r["meta"]["redpajama_set_name"] for r in recs]
    assert [r.index for r in got] == list(range(1, 41))  # 1-based line numbers


@pytest.mark.parametrize("as_string", [False, True], ids=["meta-struct", "meta-json-string"])
def test_slimpajama_parquet_meta_struct_or_json_string(tmp_path, as_string):
    recs = slimpajama_records(100, 7)
    path = write_slimpajama_parquet(tmp_path / "train-00000-of-00001.parquet", recs, meta_as_string=as_string)
    got, bad = records(build_reader("slimpajama"), path)
    assert not bad
    assert [(r.text, r.domain) for r in got] == [(r["text"], r["meta"]["redpajama_set_name"]) for r in recs]
    assert [r.index for r in got] == list(range(100))  # rows are 0-based across row groups


def test_slimpajama_split_from_path(tmp_path):
    write_slimpajama_tree(tmp_path, files=1, per_file=3)
    p = tmp_path / "validation" / "chunk1" / "example_holdout_0.jsonl.zst"
    p.parent.mkdir(parents=True)
    (tmp_path / "train/chunk1/example_train_0.jsonl.zst").rename(p)
    got, _ = records(build_reader("slimpajama", split_from_path=True), p)
    assert len(got) == 3 and {r.split for r in got} == {"validation"}


def test_climblab_domain_is_directory_and_tokens_exact(tmp_path):
    tree = write_climblab_tree(tmp_path, clusters=(3,), files=1, per_file=70)
    (rel, docs), = tree.items()
    reader = build_reader("climblab")
    assert reader.path_domain(str(tmp_path / rel)) == "cluster_3"
    got, bad = records(reader, tmp_path / rel)
    assert not bad and len(got) == 70
    assert all(r.domain == "cluster_3" for r in got)
    assert [r.tokens.tolist() for r in got] == docs


def test_climblab_token_count_mismatch_is_reported_but_kept(tmp_path):
    path = tmp_path / "cluster_1" / "cluster_1_000.tokenized.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3], [4]], type=pa.list_(pa.int64())), "token_count": [3, 9]}),
                   path)
    items = list(build_reader("climblab").read(str(path)))
    assert isinstance(items[0], Record)
    assert isinstance(items[1], BadInput) and items[1].kind == "token_count_mismatch"
    assert items[1].keep is not None and items[1].keep.tokens.tolist() == [4]


def test_climbmix_cluster_id_names_domain(tmp_path):
    path = write_jsonl(tmp_path / "part_0.tokenized.jsonl", [
        {"cluster_id": 4, "tokens": [15496, 995], "token_count": 2},
        {"cluster_id": 17, "tokens": [50256], "token_count": 1},
    ])
    got, bad = records(build_reader("climbmix"), path)
    assert not bad
    assert [(r.domain, r.tokens.tolist()) for r in got] == [("cluster_4", [15496, 995]), ("cluster_17", [50256])]


ARTICLE = ("Zürich", [("", ["Zürich is the largest city in Switzerland.", "It lies on Lake Zürich."]),
                      ("History", ["Founded by the Romans."])])


def test_wiki40b_markers_strip_and_keep(tmp_path):
    path = write_wiki40b(tmp_path, "de", "train", [ARTICLE])
    got, _ = records(build_reader("wiki40b"), path)
    assert got[0].domain == "de"
    assert got[0].text == ("Zürich\n\nZürich is the largest city in Switzerland.\nIt lies on Lake Zürich."
                           "\n\nHistory\n\nFounded by the Romans.")
    kept, _ = records(build_reader("wiki40b", markers="keep"), path)
    raw = pq.read_table(path).column("text").to_pylist()[0]
    assert kept[0].text == raw and "_START_PARAGRAPH_" in raw and "_NEWLINE_" in raw
    split, _ = records(build_reader("wiki40b", split_from_path=True), path)
    assert split[0].split == "train"


def test_generic_domain_from_path_field_and_split_field(tmp_path):
    assert domain_from_path("/d/fr.jsonl.zst") == "fr"
    assert domain_from_path("/d/ai2_arc/ARC-Easy/validation-00000-of-00001.parquet") == "ARC-Easy"
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"text": "bonjour", "meta": {"lang": "fr"}, "split": "probe"},
        {"text": "hallo", "meta": {"lang": "de"}, "split": "train"},
    ])
    got, bad = records(build_reader("jsonl", domain_field="meta.lang", split_field="split"), path)
    assert not bad
    assert [(r.text, r.domain, r.split) for r in got] == [("bonjour", "fr", "probe"), ("hallo", "de", "train")]
    fixed, _ = records(build_reader("jsonl"), path)
    assert {r.domain for r in fixed} == {"mixed"}


def test_generic_parquet_text_field(tmp_path):
    path = tmp_path / "en.parquet"
    pq.write_table(pa.table({"content": ["one", "two"], "id": [1, 2]}), path)
    got, _ = records(build_reader("parquet", text_field="content"), path)
    assert [(r.text, r.domain) for r in got] == [("one", "en"), ("two", "en")]


@pytest.mark.parametrize("layout", sorted(EXPECTED_TASK_TEXT))
def test_task_layouts_give_question_plus_correct_answer(tmp_path, layout):
    exs = task_examples()[layout]
    path = write_jsonl(tmp_path / f"{layout}.jsonl", exs)
    got, bad = records(build_reader("task"), path)
    assert not bad, bad
    assert len(got) == 3 and got[0].text == EXPECTED_TASK_TEXT[layout]
    assert all(r.domain == layout for r in got)
    assert detect_layout(exs[0]) == layout


def test_task_parquet_hf_layout_with_struct_column(tmp_path):
    exs = task_examples()["ai2_arc"]
    path = tmp_path / "ai2_arc" / "ARC-Challenge" / "validation-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(exs), path)
    got, bad = records(build_reader("task"), path)
    assert not bad
    assert got[0].domain == "ARC-Challenge" and got[0].text == EXPECTED_TASK_TEXT["ai2_arc"]
    assert got[1].text.endswith("Answer: 100 °C")


def test_task_missing_gold_answer_is_bad_input(tmp_path):
    ex = dict(task_examples()["hellaswag"][0], label="")  # HF test split: no label
    path = write_jsonl(tmp_path / "hs.jsonl", [ex, {"foo": 1}])
    got, bad = records(build_reader("task"), path)
    assert not got
    assert [(b.kind, b.index) for b in bad] == [("missing_field", 1), ("missing_field", 2)]


@pytest.mark.parametrize("source,opts,flag", [
    ("slimpajama", {"domain": "x"}, "--domain"),
    ("climbmix", {"markers": "keep"}, "--markers"),
    ("wiki40b", {"split_field": "s"}, "--split-field"),
    ("jsonl", {"layout": "gsm8k"}, "--layout"),
])
def test_build_reader_rejects_options_that_do_not_apply(source, opts, flag):
    with pytest.raises(ValueError, match=flag):
        build_reader(source, **opts)


def test_domain_and_domain_field_exclusive():
    with pytest.raises(ValueError, match="exclusive"):
        build_reader("jsonl", domain="a", domain_field="b")


def test_slimpajama_jsonl_with_meta_as_json_string(tmp_path):
    from convert_data import write_zst

    recs = slimpajama_records(5, 3)
    lines = [json.dumps({"text": r["text"], "meta": json.dumps(r["meta"])}).encode() for r in recs]
    path = write_zst(tmp_path / "example_train_0.jsonl.zst", lines)
    got, bad = records(build_reader("slimpajama"), path)
    assert not bad and [r.domain for r in got] == [r["meta"]["redpajama_set_name"] for r in recs]
