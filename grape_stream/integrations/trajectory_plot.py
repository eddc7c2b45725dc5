"""Weight and loss trajectories to PNG: what a person looks at to see what GRAPE did.

It sits with the integrations (not in apps/) because the trainers' trajectory callbacks draw it at fit end;
``grape-stream plot`` (:mod:`grape_stream.apps.plots`) is its command line.

One figure per trajectory JSONL (written by :class:`~grape_stream.grape.controller.GrapeController`):
stacked areas of the domain weights alpha and the task weights z over training steps, the
domain-task alignment A[k, n] over time as a heatmap (one row per pair, grouped by domain and labelled
with the domain and the task; each update's column scaled by its largest magnitude so early and late
updates are equally readable), the last update's K x N alignment as a labelled matrix, and the probe loss
of each target task. Every domain and task has a colour + line style (hatch, for areas) of its own
(:func:`~grape_stream.integrations.plot_style.series_style`), for up to 32 and more.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from grape_stream.grape.controller import load_trajectory
from grape_stream.integrations.plot_style import series_style

__all__ = ["plot_trajectory"]


def _matrix(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if not rows:
        return np.zeros(0), np.zeros((0, 0))
    steps = np.array([s for s, _ in rows], dtype=np.float64)
    vals = np.array([v for _, v in rows], dtype=np.float64)
    return steps, vals


def _stacked(ax: Any, steps: np.ndarray, vals: np.ndarray, labels: Sequence[str], title: str) -> None:
    if vals.size == 0:
        ax.set_visible(False)
        return
    # A step function: weights hold from one update to the next.
    polys = ax.stackplot(steps, vals.T, labels=labels, step="post", alpha=0.9)
    for i, poly in enumerate(polys):
        style = series_style(i)
        poly.set_facecolor(style["color"])
        poly.set_hatch(style["hatch"])
        poly.set_edgecolor("white")
    ax.set_xlim(steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1)
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", ncol=1 if len(labels) <= 12 else 2)


def plot_trajectory(path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> str:
    """Render one trajectory JSONL to PNG; returns the PNG path (default: beside the JSONL)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    meta, records = load_trajectory(path)
    out = os.fspath(out) if out is not None else os.path.splitext(os.fspath(path))[0] + ".png"
    K = len(records[0]["alpha"])
    domains = list(meta.get("domains") or [f"domain{k}" for k in range(K)])
    z_rec = next((r["z"] for r in records if r.get("z") is not None), None)
    tasks = list(meta.get("tasks") or ([f"task{n}" for n in range(len(z_rec))] if z_rec else []))
    method = meta.get("method", records[-1].get("method", "?"))

    a_steps, alpha = _matrix(records, "alpha")
    z_steps, z = _matrix(records, "z")
    al = [(r["step"], np.asarray(r["alignment"], dtype=np.float64)) for r in records if r.get("alignment")]
    tl_steps, task_loss = _matrix(records, "task_loss")

    heights = [3.2, 3.2] + ([_heatmap_height(al[0][1].size), max(3.2, 0.22 * len(domains) + 1.2)] if al else [])
    heights += [3.2] if task_loss.size else []
    fig, axes = plt.subplots(len(heights), 1, figsize=(11, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    axes = axes[:, 0]
    _stacked(axes[0], a_steps, alpha, domains, f"domain weights alpha ({method})")
    _stacked(axes[1], z_steps, z, tasks, "task weights z")
    i = 2
    if al:
        _alignment_over_time(fig, axes[i], al, domains, tasks)
        _alignment_matrix(fig, axes[i + 1], al[-1], domains, tasks)
        i += 2
    if task_loss.size:
        ax = axes[i]
        for n, name in enumerate(tasks[: task_loss.shape[1]]):
            style = series_style(n)
            ax.plot(tl_steps, task_loss[:, n], marker=".", label=name, color=style["color"],
                    linestyle=style["linestyle"])
        ax.set_title("target-task probe loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean token cross-entropy")
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _heatmap_height(pairs: int) -> float:
    """Inches for the over-time heatmap: every (domain, task) row readable (a label each up to 120 rows)."""
    return float(min(max(3.2, 0.11 * pairs + 1.2), 14.0))


def _alignment_over_time(fig: Any, ax: Any, al: list[tuple[int, np.ndarray]], domains: Sequence[str],
                         tasks: Sequence[str]) -> None:
    """One row per (domain, task) pair, grouped by domain (a line between groups, the domain named on the left
    and each row's task on the right), one column per update."""
    steps = np.array([s for s, _ in al])
    mats = np.stack([m.reshape(-1) for _, m in al], axis=1)  # (K*N, T)
    scale = np.max(np.abs(mats), axis=0, keepdims=True)
    mats = mats / np.where(scale > 0, scale, 1.0)
    K, N = al[0][1].shape
    im = ax.imshow(mats, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest",
                   extent=(steps[0], steps[-1] if len(steps) > 1 else steps[0] + 1, mats.shape[0], 0))
    names = list(domains[:K]) + [f"domain{k}" for k in range(len(domains), K)]
    task_names = list(tasks[:N]) + [f"task{n}" for n in range(len(tasks), N)]
    ax.set_yticks(np.arange(K) * N + N / 2)
    ax.set_yticklabels(names, fontsize=7 if K <= 32 else 5)
    ax.set_ylabel("domain (rows: its tasks)")
    for k in range(1, K):
        ax.axhline(k * N, color="black", lw=0.6)
    if K * N <= 120:  # each row's task on the right
        right = ax.twinx()
        right.set_ylim(mats.shape[0], 0)
        right.set_yticks(np.arange(K * N) + 0.5)
        right.set_yticklabels(task_names * K, fontsize=5 if K * N > 40 else 7)
    ax.set_title("domain-task alignment <g_k, h_n> over time (each update scaled to max |.| = 1)")
    ax.set_xlabel("optimizer step")
    fig.colorbar(im, ax=ax, fraction=0.025, pad=0.1)


def _alignment_matrix(fig: Any, ax: Any, last: tuple[int, np.ndarray], domains: Sequence[str],
                      tasks: Sequence[str]) -> None:
    """The last update's K x N alignment, domains down and tasks across, both labelled."""
    step, mat = last
    K, N = mat.shape
    scale = float(np.max(np.abs(mat))) or 1.0
    im = ax.imshow(mat / scale, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_yticks(np.arange(K))
    ax.set_yticklabels(list(domains[:K]) + [f"domain{k}" for k in range(len(domains), K)], fontsize=7)
    ax.set_xticks(np.arange(N))
    ax.set_xticklabels(list(tasks[:N]) + [f"task{n}" for n in range(len(tasks), N)], fontsize=7,
                       rotation=45 if N > 10 else 0)
    ax.set_xlabel("target task")
    ax.set_ylabel("domain")
    ax.set_title(f"alignment at the last update (step {step}; scaled to max |.| = 1)")
    fig.colorbar(im, ax=ax, fraction=0.025)
