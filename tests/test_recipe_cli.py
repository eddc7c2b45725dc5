"""`grape-stream inspect` and `grape-stream plot` on real MDS output and a real trajectory."""

from __future__ import annotations

import json
import os

from _grape_data import write_dataset
from grape_stream.cli import main as cli


def _trajectory(path) -> str:
    meta = {"type": "meta", "method": "grape", "domains": ["d0", "d1", "d2"], "tasks": ["t0", "t1"]}
    recs = [{"type": "update", "step": 0, "initial": True, "alpha": [1 / 3] * 3, "z": [0.5, 0.5]}]
    alpha = [1 / 3] * 3
    for step in (100, 200, 300):
        alpha = [alpha[0] + 0.05, alpha[1] - 0.02, 1 - alpha[0] - 0.05 - (alpha[1] - 0.02)]
        recs.append({"type": "update", "step": step, "alpha": alpha, "z": [0.6, 0.4],
                     "task_loss": [5.0 - step / 1000, 4.0],
                     "alignment": [[0.1, -0.2], [0.0, 0.3], [0.2, 0.1]], "seconds": {"total": 0.5}})
    with open(path, "w", encoding="utf-8") as f:
        for r in [meta, *recs]:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_inspect_manifest_dir_mds_dir_and_trajectory(tmp_path, capsys):
    root = str(tmp_path / "mds")
    write_dataset(root, domains=2, tasks=(1,), n_domain=40, n_val=8, n_test=4)
    assert cli(["inspect", root]) == 0
    out = capsys.readouterr().out
    assert "d0/train" in out and "tasks/t0/validation" in out and "40" in out and "vocab_size" in out

    assert cli(["inspect", os.path.join(root, "d1", "train"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "mds" and summary["samples"] == 40 and summary["columns"] == {"tokens": "ndarray:uint16"}

    traj = _trajectory(tmp_path / "t.jsonl")
    assert cli(["inspect", traj]) == 0
    out = capsys.readouterr().out
    assert "updates 3" in out and "alpha last" in out and "d0=0.483" in out

    assert cli(["inspect", str(tmp_path / "nothing")]) == 2  # a DataError: one line on stderr
    assert "no such file" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path, capsys):
    traj = _trajectory(tmp_path / "t.jsonl")
    out = str(tmp_path / "fig" / "t.png")
    assert cli(["plot", traj, "-o", out]) == 0
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 10_000
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "meta"}\n')
    assert cli(["plot", str(bad)]) == 2
    assert "no update records" in capsys.readouterr().err


def test_inspect_counts_a_merged_conversion_once_and_summarises_its_report(tmp_path, capsys):
    from grape_stream.convert import convert

    src = tmp_path / "in"
    src.mkdir()
    for lang in ("en", "fr"):
        with open(src / f"{lang}.jsonl", "w", encoding="utf-8") as f:
            for i in range(60):
                f.write(json.dumps({"text": f"{lang} document {i} " * 20, "lang": lang}) + "\n")
            f.write("not json\n")
    res = convert("jsonl", [str(src)], str(tmp_path / "out"), tokenizer="bytes", seq_len=64, domain_field="lang",
                  workers=2, progress=False)
    assert any(p.name.startswith("part-") for p in (tmp_path / "out" / "en").iterdir())  # merged from parts
    assert cli(["inspect", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    total = sum(d["samples"] for d in res.manifest["domains"].values())
    assert f"total {total}" in " ".join(out.split())  # each sample once, not once more per part-* index
    assert "part-" not in out
    assert "2 files, 120 documents; bad input: invalid_json 2" in out


def test_print_config_prints_and_does_not_train(capsys):
    assert cli(["train", "demo-cpu", "--print-config", "trainer.max_duration=7ba"]) == 0
    out = capsys.readouterr().out
    assert "max_duration: 7ba" in out and '"model"' not in out  # YAML only: no build summary, no training
