"""Comparison plots for the demo and the mixture-quality benchmark: several methods side by side.

(:mod:`grape_stream.apps.plots` draws one run's trajectory; these put the methods on common axes.)
Results are the dicts returned by :func:`grape_stream.apps.demo.run_method`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

from grape_stream.integrations.plot_style import series_style

__all__ = ["plot_test_loss", "plot_weights", "METHOD_COLORS"]

METHOD_COLORS = {
    "uniform": "#7f7f7f",
    "doge": "#1f77b4",
    "doge_pcgrad": "#17becf",
    "grape": "#d62728",
    "grape_gap": "#ff7f0e",
    "grape_ema": "#9467bd",
}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_test_loss(results: Mapping[str, Mapping[str, Any]], path: str | os.PathLike[str], dpi: int = 90,
                   unit: str = "byte") -> str:
    """One panel per target plus the average and the worst: test loss vs training tokens, one line per method
    (``unit``: what a token is, "byte" or "token", for the axis labels)."""
    plt = _plt()
    first = next(iter(results.values()))
    targets = list(first["targets"])
    panels = targets + ["average", "worst"]
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.0 * cols, 2.6 * rows), squeeze=False, sharex=True)
    for ax, name in zip(axes.flat, panels):
        for m, r in results.items():
            c = r["curve"]
            x = [t / 1e6 for t in c["tokens"]]
            y = c["avg"] if name == "average" else c["worst"] if name == "worst" else c["loss"][name]
            # skip the initial point (log vocab) so the interesting range is visible
            ax.plot(x[1:], y[1:], label=m, color=METHOD_COLORS.get(m), lw=1.5)
        ax.set_title(name if name in ("average", "worst") else f"target {name}", fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel(f"training tokens (M {unit}s)")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"test nats/{unit}")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("test log-perplexity during training (strided subset of each target's test split)", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return os.fspath(path)


def plot_weights(results: Mapping[str, Mapping[str, Any]], path: str | os.PathLike[str], dpi: int = 90) -> str:
    """Source weights alpha of every method, then target weights z of the GRAPE variants (z is fixed
    uniform for DoGE); at most three panels per row."""
    plt = _plt()
    methods = [m for m, r in results.items() if r.get("trajectory")]
    panels = [(m, "alpha") for m in methods]
    panels += [(m, "z") for m in methods if m.startswith("grape") and results[m]["trajectory"][-1].get("z") is not None]
    cols = min(3, max(len(methods), 1))
    rows = math.ceil(len(methods) / cols) + math.ceil((len(panels) - len(methods)) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols + 0.8, 2.7 * rows), squeeze=False)
    top = max((max(t["alpha"]) for m in methods for t in results[m]["trajectory"]), default=1.0)
    slots = [(i // cols, i % cols) for i in range(len(methods))]
    z_start = math.ceil(len(methods) / cols) * cols
    if len(methods) <= cols:  # one row of methods: each z panel under its own method
        slots += [(1, methods.index(m)) for m, _ in panels[len(methods):]]
    else:
        slots += [((z_start + i) // cols, (z_start + i) % cols) for i in range(len(panels) - len(methods))]
    used = set()
    for (m, what), (i, j) in zip(panels, slots):
        used.add((i, j))
        r = results[m]
        traj = r["trajectory"]
        steps = [t["step"] for t in traj]
        names = r["domains"] if what == "alpha" else r["targets"]
        ax = axes[i, j]
        for k, name in enumerate(names):
            style = series_style(k)  # 13 languages: a colour + line style each (the default cycle has 10 colours)
            ax.step(steps, [t[what][k] if t.get(what) else float("nan") for t in traj], where="post", label=name,
                    lw=1.5, color=style["color"], linestyle=style["linestyle"])
        ax.set_title(f"{m}: {what} ({'sources' if what == 'alpha' else 'targets'})", fontsize=10)
        if what == "alpha":
            ax.set_ylim(0, min(1.02, top * 1.1 + 0.02))
        ax.grid(alpha=0.3)
        ax.set_xlabel("step", fontsize=8)
        if j == 0:
            ax.set_ylabel("weight")
        if j == cols - 1 or (what == "z" and (m, what) == panels[-1]) or (what == "alpha" and m == methods[-1]):
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), ncol=1 if len(names) <= 16 else 2)
    for i in range(rows):
        for j in range(cols):
            if (i, j) not in used:
                axes[i, j].set_visible(False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return os.fspath(path)
