"""The end-of-run summary of a GRAPE run, with no trainer imported: per-target log-perplexity, their
average and worst (the paper's two headline numbers), the final mixture and where the trajectory and
plots went. Every integration (Composer, HF Trainer, Lightning, a plain loop) prints the same table.

Why a table at the end: a run that trained for hours should say, in its last console lines, whether the
mixture helped the targets and where to look next, without opening a tracker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

__all__ = ["RunSummary", "format_summary", "summarize_controller"]


@dataclass
class RunSummary:
    """What the end-of-run table shows (plain data: build it from a controller or by hand)."""

    method: str
    domains: list[str]
    alpha: list[float]
    alpha_start: list[float]
    tasks: list[str]
    z: Optional[list[float]] = None
    #: per-target log-perplexity from the trainer's evaluation (mean token cross-entropy on the test split)
    eval_log_ppl: dict[str, float] = field(default_factory=dict)
    #: per-target probe loss at the last GRAPE update (the validation split the controller probes)
    probe_loss: dict[str, float] = field(default_factory=dict)
    num_updates: int = 0
    last_step: Optional[int] = None
    trajectory: Optional[str] = None
    plot: Optional[str] = None

    def headline(self) -> tuple[str, dict[str, float]]:
        """(source, per-target values) used for avg / worst: evaluation if there was one, else the probe."""
        if self.eval_log_ppl:
            return "eval log-ppl", dict(self.eval_log_ppl)
        return "probe loss", dict(self.probe_loss)

    def average(self) -> float | None:
        _, values = self.headline()
        finite = [v for v in values.values() if math.isfinite(v)]
        return sum(finite) / len(finite) if finite else None

    def worst(self) -> tuple[str, float] | None:
        _, values = self.headline()
        finite = {k: v for k, v in values.items() if math.isfinite(v)}
        if not finite:
            return None
        name = max(finite, key=lambda k: finite[k])
        return name, finite[name]


def summarize_controller(
    controller: Any,
    eval_log_ppl: Mapping[str, float] | None = None,
    *,
    trajectory: str | None = None,
    plot: str | None = None,
) -> RunSummary:
    """A :class:`RunSummary` from a :class:`~grape_stream.grape.controller.GrapeController` (duck-typed:
    ``method``, ``domain_names``, ``task_names``, ``alpha``, ``z``, ``history``, ``num_updates``)."""
    history: Sequence[Mapping[str, Any]] = list(getattr(controller, "history", []) or [])
    updates = [r for r in history if r.get("type", "update") == "update" and not r.get("initial")]
    tasks = list(getattr(controller, "task_names", []) or [])
    probe: dict[str, float] = {}
    for rec in reversed(updates):
        if rec.get("task_loss"):
            probe = {t: float(v) for t, v in zip(tasks, rec["task_loss"])}
            break
    alpha = [float(a) for a in controller.alpha]
    # the initial record (step 0); the history keeps only the newest records, so a long run may lack it
    first = next((r for r in history if r.get("initial")), history[0] if history else {})
    start = [float(a) for a in first["alpha"]] if first.get("alpha") else alpha
    z = controller.z
    return RunSummary(
        method=str(controller.method),
        domains=list(controller.domain_names),
        alpha=alpha,
        alpha_start=start,
        tasks=tasks,
        z=None if z is None else [float(v) for v in z],
        eval_log_ppl={k: float(v) for k, v in (eval_log_ppl or {}).items()},
        probe_loss=probe,
        num_updates=int(getattr(controller, "num_updates", len(updates))),
        last_step=int(updates[-1]["step"]) if updates else None,
        trajectory=trajectory,
        plot=plot,
    )


def _num(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.4f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [line(header), line(["-" * w for w in widths]), *[line(r) for r in rows]]


def format_summary(s: RunSummary) -> str:
    """The summary as console text: a targets table (eval log-ppl, last probe loss, final z), avg and
    worst, a domains table (alpha at start and end) and the file locations."""
    last = f", last at step {s.last_step}" if s.last_step is not None else ""
    out = [f"GRAPE run summary: method {s.method}, {s.num_updates} updates{last}"]
    if s.tasks:
        rows = []
        for i, t in enumerate(s.tasks):
            zi = s.z[i] if s.z is not None and i < len(s.z) else None
            rows.append([t, _num(s.eval_log_ppl.get(t)), _num(s.probe_loss.get(t)), _num(zi)])
        source, _ = s.headline()
        avg, worst = s.average(), s.worst()
        rows.append([f"avg ({source})", _num(avg) if source.startswith("eval") else "",
                     "" if source.startswith("eval") else _num(avg), ""])
        if worst is not None:
            wcol = f"{worst[1]:.4f} ({worst[0]})"
            rows.append([f"worst ({source})", wcol if source.startswith("eval") else "",
                         "" if source.startswith("eval") else wcol, ""])
        out += _table(["target", "eval log-ppl", "probe loss", "z final"], rows)
    drows = [[d, _num(a0), _num(a)] for d, a0, a in zip(s.domains, s.alpha_start, s.alpha)]
    out += _table(["domain", "alpha start", "alpha final"], drows)
    out.append(f"trajectory: {s.trajectory or '(not written: add GrapeTrajectoryCallback)'}")
    out.append(f"plots:      {s.plot or '(none)'}")
    return "\n".join(out)
