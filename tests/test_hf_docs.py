"""docs/hf.md's example, run verbatim in a real Hugging Face Trainer (tiny random Llama, CPU, real MDS shards).

The snippet is read from the document, so the docs cannot drift from working code.
"""

from __future__ import annotations

import json
import os
import re

import torch

from _grape_data import write_dataset

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "hf.md")


def _snippet() -> str:
    m = re.search(r"<!-- hf-example -->\s*```python\n(.*?)```", open(DOC, encoding="utf-8").read(), re.S)
    assert m, "docs/hf.md lost its <!-- hf-example --> python block"
    return m.group(1)


def test_the_hf_example_trains_logs_and_checkpoints_grape(tmp_path, capsys):
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=64, n_val=16, n_test=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exec(compile(_snippet(), DOC, "exec"), {"__name__": "hf_example", "DATA": data, "OUT": out, "RESUME": None})
    finally:
        torch.set_num_threads(threads)
    for step in (4, 8):
        state = torch.load(os.path.join(out, f"checkpoint-{step}", "grape_stream.pt"), weights_only=True)
        assert state["format"] == "grape_stream.loop/1" and state["step"] == step
        assert state["mixer"]["batch"] == step and state["controller"]["num_updates"] == step // 4
    log = json.load(open(os.path.join(out, "checkpoint-8", "trainer_state.json"), encoding="utf-8"))["log_history"]
    updates = [row for row in log if "grape/alpha/d0" in row]
    assert [row["step"] for row in updates] == [4, 8]
    assert abs(sum(updates[-1][f"grape/alpha/d{k}"] for k in range(3)) - 1) < 1e-9
    lines = open(os.path.join(out, "grape_trajectory.jsonl"), encoding="utf-8").read().splitlines()
    assert [json.loads(x).get("step") for x in lines[1:]] == [0, 4, 8]
    assert os.path.getsize(os.path.join(out, "grape_trajectory.png")) > 0
    # the default end-of-run hook prints the summary table, naming where the trajectory went
    printed = capsys.readouterr().out
    assert "GRAPE run summary: method grape, 2 updates, last at step 8" in printed
    assert os.path.join(out, "grape_trajectory.jsonl") in printed
    with open(os.path.join(out, "grape_summary.txt"), encoding="utf-8") as f:  # and writes it, as Composer runs do
        assert "GRAPE run summary: method grape, 2 updates, last at step 8" in f.read()
