"""The plain PyTorch loop of docs/composer.md, run verbatim: GRAPE without Composer, and its resume.

The snippet is read from the document, so the docs cannot drift from working code. It runs three times:
16 steps straight; 8 steps then a checkpoint; a resume from that checkpoint to step 16. The resumed run must
reproduce the straight run's weights and losses exactly.
"""

from __future__ import annotations

import contextlib
import io
import os
import re

import torch

from _grape_data import SEQ, VOCAB, write_dataset

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "composer.md")


def _snippet() -> str:
    text = open(DOC, encoding="utf-8").read()
    m = re.search(r"<!-- plain-loop -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/composer.md lost its <!-- plain-loop --> python block"
    return m.group(1)


def _run(code: str, **names) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, DOC, "exec"), {"__name__": "plain_loop", **names})
    return out.getvalue().splitlines()


def test_plain_loop_from_the_docs_trains_checkpoints_and_resumes(tmp_path):
    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=128, n_val=24, n_test=8)
    code = _snippet()
    assert len(code.strip().splitlines()) <= 36  # "a loop of ~30 lines"
    common = dict(DATA=data, DOMAINS=["d0", "d1", "d2"], TASKS=["t0", "t1"], VOCAB=VOCAB, SEQ=SEQ, TOTAL_STEPS=16)

    straight = _run(code, STEPS=16, RESUME_FROM=None, CHECKPOINT=str(tmp_path / "straight.pt"), **common)
    first = _run(code, STEPS=8, RESUME_FROM=None, CHECKPOINT=str(tmp_path / "half.pt"), **common)
    resumed = _run(code, STEPS=16, RESUME_FROM=str(tmp_path / "half.pt"), CHECKPOINT=str(tmp_path / "end.pt"), **common)

    assert [line.split(":")[0] for line in straight] == [f"step {s}" for s in (4, 8, 12, 16)]
    assert first + resumed == straight  # same weights and same losses, printed at every update
    a = torch.load(tmp_path / "straight.pt", weights_only=True)
    b = torch.load(tmp_path / "end.pt", weights_only=True)
    strip = lambda h: [(r["step"], r["alpha"], r["z"], r.get("task_loss")) for r in h]  # noqa: E731 (no timings)
    assert strip(a["grape"]["history"]) == strip(b["grape"]["history"])
    assert a["mixer"]["schedule"] == b["mixer"]["schedule"]
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    alphas = [r["alpha"] for r in a["grape"]["history"]]
    assert alphas[-1] != alphas[0]  # the mixture moved
