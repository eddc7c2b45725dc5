"""README's "Use it on your data" block, run verbatim on the data it describes: JSON lines of three source domains and
one target task with validation and test lines, converted with `grape-stream convert jsonl`, then the `train` command
as a dry run (local data, splits, the manifest's vocabulary: what a real run checks before training)."""

from __future__ import annotations

import json
import os
import re
import shlex

from grape_stream.cli import main as cli_main

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _commands() -> list[list[str]]:
    m = re.search(r"<!-- readme-local -->\s*```bash\n(.*?)```", open(README, encoding="utf-8").read(), re.S)
    assert m, "README.md lost its <!-- readme-local --> bash block"
    lines = m.group(1).replace("\\\n", " ").strip().splitlines()
    out = []
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == ".venv/bin/grape-stream", line
        out.append(argv[1:])
    return out


def test_readme_local_jsonl_convert_and_train(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.mkdir("my_corpus")
    rows = [{"text": f"{d} document {i}: " + " ".join(f"{d}{i}w{j}" for j in range(60)), "domain": d, "split": "train"}
            for d in ("web", "code", "books") for i in range(12)]
    rows += [{"text": f"question {i}? answer {i}. " * 8, "domain": "qa", "split": s} for s in ("validation", "test")
             for i in range(6)]
    with open("my_corpus/part-0.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    convert, train = _commands()
    assert convert[0] == "convert" and train[:2] == ["train", "demo-cpu"]
    assert cli_main(convert) == 0, capsys.readouterr().err
    for d, split in [("web", "train"), ("code", "train"), ("books", "train"), ("qa", "validation"), ("qa", "test")]:
        assert os.path.isfile(os.path.join("runs/my_corpus", d, split, "index.json")), (d, split)
    capsys.readouterr()
    assert cli_main([*train, "--dry-run"]) == 0, capsys.readouterr().err
    described = json.loads(capsys.readouterr().out)
    assert described["domains"] == ["web", "code", "books"] and described["tasks"] == ["qa"]
    assert described["run_name"] == "my-run" and described["method"] == "grape"
