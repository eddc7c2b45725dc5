"""`grape-stream export-schedule`: a trajectory as a plain JSON schedule and as Megatron-LM's `--data-path` blend, on a
hand-built trajectory whose mean mixture is computed here independently. The blend is read back by the rule Megatron
documents for it (megatron/core/datasets/utils.py, ``get_blend_from_list``: "a flattened, zipped list of weights and
prefixes, e.g. ["30", "path/to/dataset_1_prefix", "70", "path/to/dataset_2_prefix"]", the list being the
whitespace-separated ``--data-path`` values or a ``--data-args-path`` file's content)."""

from __future__ import annotations

import json

import pytest

from grape_stream.cli import main as cli_main
from grape_stream.grape.trajectory import write_trajectory

META = {"type": "meta", "method": "grape", "domains": ["web", "code"], "tasks": ["qa"], "alpha_every": 4}
RECORDS = [{"type": "update", "step": 0, "initial": True, "alpha": [0.5, 0.5]},
           {"type": "update", "step": 4, "from_batch": 4, "alpha": [0.7, 0.3]},
           {"type": "update", "step": 8, "from_batch": 10, "alpha": [0.9, 0.1]}]


@pytest.fixture
def traj(tmp_path):
    path = str(tmp_path / "grape_trajectory.jsonl")
    write_trajectory(path, META, RECORDS)
    return path


def test_json_schedule_mean_and_final(traj, tmp_path, capsys):
    assert cli_main(["export-schedule", traj]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["format"] == "grape_stream.schedule/1" and s["domains"] == ["web", "code"]
    assert [e["from_batch"] for e in s["schedule"]] == [0, 4, 10]
    assert s["schedule"][1]["weights"] == {"web": 0.7, "code": 0.3}
    # the run ended at its last update's step (8): batches 0-3 at 0.5, 4-7 at 0.7; the weights from batch 10 never
    # trained (nothing after the run's end counts in the mean)
    web = (4 * 0.5 + 4 * 0.7) / 8
    assert s["until"] == 8 and s["mean"]["web"] == pytest.approx(web) and s["mean"]["code"] == pytest.approx(1 - web)
    assert s["final"] == {"web": 0.9, "code": 0.1}
    assert cli_main(["export-schedule", traj, "--until", "20"]) == 0
    assert json.loads(capsys.readouterr().out)["mean"]["web"] == pytest.approx((2 + 4.2 + 10 * 0.9) / 20)


def test_the_true_end_of_a_run_is_its_last_update_step(tmp_path, capsys):
    """A 400-step run with an update every 25 steps: the update at step 400 takes effect from batch 400, which never
    trains; `--until 400` (the true end) is accepted and equals the default."""
    recs = [{"type": "update", "step": s, "from_batch": s, "alpha": [0.5 + s / 1000, 0.5 - s / 1000]}
            for s in range(0, 401, 25)]
    path = str(tmp_path / "t.jsonl")
    write_trajectory(path, {**META, "alpha_every": 25}, recs)
    web = sum((0.5 + s / 1000) * 25 for s in range(0, 400, 25)) / 400
    for extra in ([], ["--until", "400"]):
        assert cli_main(["export-schedule", path, *extra]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["until"] == 400 and s["mean"]["web"] == pytest.approx(web)


def _megatron_blend(text: str) -> tuple[list[str], list[float]]:
    """Megatron-LM's documented reading of a --data-path blend: prefixes and weights normalised to sum 1."""
    items = text.split()
    assert len(items) % 2 == 0, "Megatron refuses an odd number of items (weight prefix pairs)"
    weights = [float(w) for w in items[0::2]]
    prefixes = [p.strip() for p in items[1::2]]
    assert all(w > 0 for w in weights)
    return prefixes, [w / sum(weights) for w in weights]


def test_megatron_data_path_blend(traj, tmp_path, capsys):
    assert cli_main(["export-schedule", traj, "-f", "megatron", "--at", "final", "--root", "/data",
                     "--path", "code=/other/code_text_document"]) == 0
    out = capsys.readouterr().out
    assert out == "0.9 /data/web 0.1 /other/code_text_document\n"
    assert _megatron_blend(out) == (["/data/web", "/other/code_text_document"], [pytest.approx(0.9),
                                                                              pytest.approx(0.1)])
    args = tmp_path / "blend.txt"  # a --data-args-path file
    assert cli_main(["export-schedule", traj, "-f", "megatron", "--root", "./megatron", "-o", str(args)]) == 0
    prefixes, weights = _megatron_blend(args.read_text())
    assert prefixes == ["./megatron/web", "./megatron/code"]
    assert weights[0] == pytest.approx((4 * 0.5 + 4 * 0.7) / 8, abs=1e-6)


def test_mistakes_are_one_line(traj, tmp_path, capsys):
    assert cli_main(["export-schedule", traj, "-f", "megatron"]) == 2
    assert "no path for domain(s) web, code: give --root DIR or --path DOMAIN=PATH" in capsys.readouterr().err
    assert cli_main(["export-schedule", traj, "-f", "megatron", "--path", "wbe=/x"]) == 2
    assert "expected DOMAIN=PATH with DOMAIN one of web, code" in capsys.readouterr().err
    assert cli_main(["export-schedule", str(tmp_path / "nope.jsonl")]) != 0
    assert "no trajectory file" in capsys.readouterr().err
    assert cli_main(["export-schedule", traj, "-f", "megatron", "--root", "/my data"]) == 2
    assert "cannot be empty or hold whitespace" in capsys.readouterr().err
    assert cli_main(["export-schedule", traj, "--until", "0"]) == 2
    assert "must be after the first weights' batch (0)" in capsys.readouterr().err
