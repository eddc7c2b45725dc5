"""The docs name every method the registry has: recipes.md's `algorithm.method` row lists each registry name (and
`schedule`), and README.md / docs/index.md name the methods the registry added after the paper's baselines."""

from __future__ import annotations

import os
import re

from grape_stream.grape.reweighting import available_methods

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts: str) -> str:
    return open(os.path.join(ROOT, *parts), encoding="utf-8").read()


def test_recipes_md_method_row_lists_the_registry():
    row = next(line for line in _read("docs", "recipes.md").splitlines() if line.startswith("| `method` |"))
    named = set(re.findall(r"`([a-z_]+)`", row)) - {"method", "grape"} | {"grape"}
    assert set(available_methods()) | {"schedule"} <= named, set(available_methods()) - named


def test_readme_and_index_name_every_method_family():
    for doc in (_read("README.md"), _read("docs", "index.md")):
        for name in ("DoGE", "GRAPE", "DoReMi", "ODM", "ADO", "R&B", "CRISP", "RegMix"):
            assert name in doc, name
        assert "uniform / DoGE / GRAPE" not in doc
