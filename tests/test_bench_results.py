"""bench/results/ holds one current result file per measure, each named on a docs page (docs/results.md's table
says which file holds which measure), and bench/common.py writes a result whole or not at all."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_result_file_is_named_in_the_docs() -> None:
    pages = "\n".join(p.read_text(encoding="utf-8") for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    files = sorted(p.name for p in (REPO / "bench" / "results").glob("*.json"))
    assert files
    assert [f for f in files if f not in pages] == []


def test_write_json_replaces_a_result_whole(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_common", REPO / "bench" / "common.py")
    assert spec is not None and spec.loader is not None
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    out = tmp_path / "new" / "x.json"
    common.write_json(out, {"a": 1}, indent=2, newline=True)
    assert out.read_text() == '{\n  "a": 1\n}\n' and [p.name for p in out.parent.iterdir()] == ["x.json"]
    assert common.parser("doc", "soak").parse_args([]).out == str(REPO / "bench" / "results" / "soak.json")
    assert json.loads(common.write_json(out, [2]).read_text()) == [2]
