"""Weight and loss trajectories to PNG: what a person looks at to see what GRAPE did.

It sits with the integrations (not in apps/) because the trainers' trajectory callbacks draw it at fit end;
``grape-stream plot`` (:mod:`grape_stream.apps.plots`) is its command line.

One figure per trajectory JSONL (written by :class:`~grape_stream.grape.controller.GrapeController`):
stacked areas of the domain weights alpha and the task weights z over training steps, the
domain-task alignment A[k, n] over time as a heatmap (one row per pair, each update's column scaled
by its largest magnitude so early and late updates are equally readable), and the probe loss of each
target task.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from grape_stream.grape.controller import load_trajectory

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
    ax.stackplot(steps, vals.T, labels=labels, step="post", alpha=0.9)
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

    panels = 2 + (1 if al else 0) + (1 if task_loss.size else 0)
    fig, axes = plt.subplots(panels, 1, figsize=(11, 3.2 * panels), squeeze=False)
    axes = axes[:, 0]
    _stacked(axes[0], a_steps, alpha, domains, f"domain weights alpha ({method})")
    _stacked(axes[1], z_steps, z, tasks, "task weights z")
    i = 2
    if al:
        steps = np.array([s for s, _ in al])
        mats = np.stack([m.reshape(-1) for _, m in al], axis=1)  # (K*N, T)
        scale = np.max(np.abs(mats), axis=0, keepdims=True)
        mats = mats / np.where(scale > 0, scale, 1.0)
        ax = axes[i]
        im = ax.imshow(mats, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest",
                       extent=(steps[0], steps[-1] if len(steps) > 1 else steps[0] + 1, mats.shape[0], 0))
        n_t = al[0][1].shape[1]
        labels = [f"{d} / {t}" for d in domains for t in tasks[:n_t]]
        if len(labels) <= 60:
            ax.set_yticks(np.arange(len(labels)) + 0.5)
            ax.set_yticklabels(labels, fontsize=6)
        ax.set_title("domain-task alignment <g_k, h_n> over time (each update scaled to max |.| = 1)")
        ax.set_xlabel("optimizer step")
        fig.colorbar(im, ax=ax, fraction=0.025)
        i += 1
    if task_loss.size:
        ax = axes[i]
        for n, name in enumerate(tasks[: task_loss.shape[1]]):
            ax.plot(tl_steps, task_loss[:, n], marker=".", label=name)
        ax.set_title("target-task probe loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean token cross-entropy")
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
