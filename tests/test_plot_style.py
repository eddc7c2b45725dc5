"""Plots people can read: every domain of a figure has its own colour + line style (hatch for areas) up to 32 domains,
and the alignment heatmaps name their rows (domain, task) and the last update's matrix its domains and tasks."""

from __future__ import annotations

import numpy as np

from grape_stream.integrations.plot_style import series_style
from grape_stream.integrations.trajectory_plot import _alignment_matrix, _alignment_over_time, plot_trajectory


def test_every_series_has_its_own_look_up_to_32():
    looks = [series_style(i) for i in range(32)]
    assert len({(s["color"], s["linestyle"]) for s in looks}) == 32
    assert len({(s["color"], s["hatch"]) for s in looks}) == 32
    assert len({s["color"] for s in looks[:10]}) == 10  # ten colours before any style repeats a colour


def test_alignment_heatmaps_are_labelled(tmp_path):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    domains = [f"dom{k}" for k in range(13)]
    tasks = [f"task{n}" for n in range(7)]
    rng = np.random.default_rng(0)
    al = [(s, rng.normal(size=(13, 7))) for s in (25, 50, 75)]
    fig, (a, b) = plt.subplots(2, 1)
    _alignment_over_time(fig, a, al, domains, tasks)
    _alignment_matrix(fig, b, al[-1], domains, tasks)
    fig.canvas.draw()
    assert [t.get_text() for t in a.get_yticklabels()] == domains  # one label per domain group of 7 rows
    right = [ax for ax in fig.axes if ax is not a and ax.bbox.bounds == a.bbox.bounds][0]
    assert [t.get_text() for t in right.get_yticklabels()] == tasks * 13  # each of the 91 rows names its task
    assert [t.get_text() for t in b.get_yticklabels()] == domains
    assert [t.get_text() for t in b.get_xticklabels()] == tasks
    plt.close(fig)
    from grape_stream.grape.trajectory import write_trajectory

    recs = [{"type": "update", "step": s, "alpha": list(rng.dirichlet(np.ones(13))), "z": [1 / 7] * 7,
             "alignment": m.tolist(), "task_loss": [3.0] * 7} for s, m in [(0, al[0][1]), *al]]
    path = str(tmp_path / "t.jsonl")
    write_trajectory(path, {"type": "meta", "method": "grape", "domains": domains, "tasks": tasks}, recs)
    png = plot_trajectory(path)
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
