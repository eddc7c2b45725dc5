"""docs/lightning.md's example, run verbatim in a real Lightning Trainer (tiny GPT, CPU, real MDS shards).

The snippet is read from the document, so the docs cannot drift from working code.
"""

from __future__ import annotations

import json
import os
import re

import torch

from _grape_data import write_dataset

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "lightning.md")


def _snippet() -> str:
    m = re.search(r"<!-- lightning-example -->\s*```python\n(.*?)```", open(DOC, encoding="utf-8").read(), re.S)
    assert m, "docs/lightning.md lost its <!-- lightning-example --> python block"
    return m.group(1)


def test_the_lightning_example_trains_logs_and_checkpoints_grape(tmp_path):
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=64, n_val=16, n_test=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exec(compile(_snippet(), DOC, "exec"), {"__name__": "lightning_example", "DATA": data, "OUT": out,
                                                "RESUME": None})
    finally:
        torch.set_num_threads(threads)
    ckpts = sorted(os.listdir(os.path.join(out, "ckpt")))
    assert ckpts == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    for name, step in zip(ckpts, (4, 8)):
        state = torch.load(os.path.join(out, "ckpt", name), weights_only=True)["callbacks"]["GrapeLightningCallback"]
        assert state["format"] == "grape_stream.loop/1" and state["step"] == step and state["batches"] == step
        assert state["mixer"]["batch"] == step and state["controller"]["num_updates"] == step // 4
    lines = open(os.path.join(out, "grape_trajectory.jsonl"), encoding="utf-8").read().splitlines()
    assert [json.loads(x).get("step") for x in lines[1:]] == [0, 4, 8]
    assert os.path.getsize(os.path.join(out, "grape_trajectory.png")) > 0
