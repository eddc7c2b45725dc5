"""docs/index.md's Python quickstart, run verbatim on real MDS shards (the snippet is read from the document)."""

from __future__ import annotations

import contextlib
import io
import os
import re

import numpy as np

from _grape_data import write_dataset

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "index.md")


def test_the_index_quickstart_runs_and_moves_the_mixture(tmp_path):
    m = re.search(r"<!-- index-example -->\s*```python\n(.*?)```", open(DOC, encoding="utf-8").read(), re.S)
    assert m, "docs/index.md lost its <!-- index-example --> python block"
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=64, n_val=16, n_test=8)
    out = io.StringIO()
    scope = {"__name__": "index_example", "DATA": data}
    with contextlib.redirect_stdout(out):
        exec(compile(m.group(1), DOC, "exec"), scope)
    weights = np.asarray(scope["mixer"].weights)
    assert weights.sum() == np.float64(1.0) or abs(weights.sum() - 1) < 1e-9
    assert not np.allclose(weights, 1 / 3) and scope["grape"].num_updates == 2
    assert out.getvalue().strip().startswith("[")
