"""`grape-stream export-schedule`: a trajectory as a plain JSON schedule, torchtitan's multi-source dataset string and
a Megatron-Energon metadataset, on a hand-built trajectory whose mean mixture is computed here independently."""

from __future__ import annotations

import json

import pytest
import yaml

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
    # batches 0-3 at 0.5, 4-9 at 0.7, 10-13 at 0.9 (the last change + alpha_every = 14)
    web = (4 * 0.5 + 6 * 0.7 + 4 * 0.9) / 14
    assert s["until"] == 14 and s["mean"]["web"] == pytest.approx(web) and s["mean"]["code"] == pytest.approx(1 - web)
    assert s["final"] == {"web": 0.9, "code": 0.1}
    assert cli_main(["export-schedule", traj, "--until", "20"]) == 0
    assert json.loads(capsys.readouterr().out)["mean"]["web"] == pytest.approx((2 + 4.2 + 10 * 0.9) / 20)


def test_torchtitan_and_energon_formats(traj, tmp_path, capsys):
    assert cli_main(["export-schedule", traj, "-f", "torchtitan", "--at", "final", "--root", "/data",
                     "--path", "code=/other/code"]) == 0
    assert capsys.readouterr().out == "/data/web:0.9,/other/code:0.1\n"
    out = tmp_path / "mix.yaml"
    assert cli_main(["export-schedule", traj, "-f", "energon", "--root", "./mds", "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["__module__"] == "megatron.energon" and doc["__class__"] == "MetadatasetV2"
    blend = doc["splits"]["train"]["blend"]
    assert [b["path"] for b in blend] == ["./mds/web", "./mds/code"]
    assert sum(b["weight"] for b in blend) == pytest.approx(1.0)
    assert blend[0]["weight"] == pytest.approx((4 * 0.5 + 6 * 0.7 + 4 * 0.9) / 14)


def test_mistakes_are_one_line(traj, tmp_path, capsys):
    assert cli_main(["export-schedule", traj, "-f", "energon"]) == 2
    assert "no path for domain(s) web, code: give --root DIR or --path DOMAIN=PATH" in capsys.readouterr().err
    assert cli_main(["export-schedule", traj, "-f", "torchtitan", "--path", "wbe=/x"]) == 2
    assert "expected DOMAIN=PATH with DOMAIN one of web, code" in capsys.readouterr().err
    assert cli_main(["export-schedule", str(tmp_path / "nope.jsonl")]) != 0
    assert "no trajectory file" in capsys.readouterr().err
