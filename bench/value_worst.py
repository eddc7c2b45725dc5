"""Why z does not rescue a starving target (issue 32 part 2): the evidence, read from the value benchmark's
recorded trajectories (``runs/bench_value/<method>-seed<s>/grape_trajectory.jsonl``).

GRAPE's update (GRAPE-SPEC.md): a_n = sum_k alpha_k A[k, n] / l_n (the task's alignment with the update
direction, per nat of its loss), z_n <- z_n exp(-eta_z a_n); b_k = sum_n z_n A[k, n] / l_n,
alpha_k <- alpha_k exp(eta_alpha b_k). A target that starves (little alpha on its own language) should get
a low a_n, so a rising z_n, so a rising b on its own language. Per update and per seed this prints, for the
run's worst target on the test split (n*) and its own source domain (k*):

- whether a_{n*} is the lowest task score (the one z raises most), and z_{n*} with its rank;
- b_{k*} (the score alpha follows) and its rank among the K domains; alpha_{k*};
- the divergence each step actually moved (KL(z_t || z_{t-1}), KL(alpha_t || alpha_{t-1})) and the lr factor;
- the probe's own noise figure (probe_rse: the alignments' standard error over their spread, when recorded)
  and the sign agreement of consecutive a_n (how often z's direction for n* flips between updates).

    .venv/bin/python bench/value_worst.py                       # grape seeds found on disk
    .venv/bin/python bench/value_worst.py --method grape_paper --json bench/results/value_worst.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def _kl(p: Sequence[float], q: Sequence[float]) -> float:
    pa, qa = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    m = pa > 0
    return float(np.sum(pa[m] * np.log(pa[m] / qa[m])))


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def _spent_before_top(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The share of the run's alpha movement (summed per-update KL) spent before z first ranked the worst
    target first and kept it there to the end (None: it never did)."""
    total = sum(x["kl_alpha"] for x in rows)
    top = None
    for i in range(len(rows)):
        if all(x["z_rank"] == 1 for x in rows[i:]):
            top = i
            break
    if top is None:
        return {"z_top_from_step": None, "share": None}
    return {"z_top_from_step": rows[top]["step"], "share": sum(x["kl_alpha"] for x in rows[:top]) / total,
            "lr_factor_then": rows[top]["lr_factor"]}


def _records(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    meta: dict[str, Any] = {}
    recs: list[dict[str, Any]] = []
    for line in (run_dir / "grape_trajectory.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            (recs.append(r) if r.get("type", "update") == "update" else meta.update(r))
    return meta, recs


def analyse(run_dir: Path) -> dict[str, Any]:
    """One run: the worst target's path through the updates, and the summary figures."""
    res = json.loads((run_dir / "result.json").read_text())
    meta, recs = _records(run_dir)
    domains, tasks = meta["domains"], meta["tasks"]
    worst = max(res["final"], key=res["final"].get)
    n, k = tasks.index(worst), domains.index(worst)
    rows = []
    prev = recs[0]
    peak = max((r.get("lr") or 0.0) for r in recs) or 1.0
    for r in recs[1:]:
        a = r.get("task_alignment")
        b = r.get("domain_alignment")
        row: dict[str, Any] = {"step": r["step"], "lr_factor": (r.get("lr") or 0.0) / peak,
                               "alpha_own": r["alpha"][k], "z": r["z"][n] if r.get("z") else None,
                               "z_rank": (int(np.argsort(-np.asarray(r["z"])).tolist().index(n)) + 1
                                          if r.get("z") else None),
                               "kl_z": _kl(r["z"], prev["z"]) if r.get("z") and prev.get("z") else None,
                               "kl_alpha": _kl(r["alpha"], prev["alpha"]),
                               "probe_rse": r.get("probe_rse"), "task_loss": (r.get("task_loss") or [None] * 7)[n]}
        if a is not None:
            a = np.asarray(a, dtype=np.float64)
            row.update(a=float(a[n]), a_lowest=bool(a[n] <= a.min()),
                       a_rank_from_low=int(np.argsort(a).tolist().index(n)) + 1, a_spread=float(a.max() - a.min()))
        if b is not None:
            b = np.asarray(b, dtype=np.float64)
            row.update(b_own=float(b[k]), b_rank=int(np.argsort(-b).tolist().index(k)) + 1)
        rows.append(row)
        prev = r
    upd = [x for x in rows if "a" in x]
    a_all = [np.asarray(r["task_alignment"], dtype=np.float64) for r in recs[1:] if r.get("task_alignment")]
    # how much of a_n is signal: the rank correlation of consecutive updates' task scores (1: the same order
    # each time; ~0: a new order each update, noise), and of the alignment matrices' entries
    rho = [_spearman(x, y) for x, y in zip(a_all, a_all[1:])]
    mats = [np.asarray(r["alignment"], dtype=np.float64).ravel() for r in recs[1:] if r.get("alignment")]
    rho_a = [_spearman(x, y) for x, y in zip(mats, mats[1:])]
    signs = [np.sign(x["a"] - np.mean([y["a"] for y in upd])) for x in upd]
    flips = sum(1 for s, t in zip(signs, signs[1:]) if s != t)
    z_up = [x for x, y in zip(rows[1:], rows[:-1]) if x["z"] is not None and y["z"] is not None and x["z"] > y["z"]]
    summary = {
        "worst_target": worst, "final": res["final"][worst], "updates": len(rows),
        "alpha_own_final": rows[-1]["alpha_own"], "alpha_own_mean": float(np.mean([x["alpha_own"] for x in rows])),
        "z_final": rows[-1]["z"], "z_rank_mean": float(np.mean([x["z_rank"] for x in rows if x["z_rank"]])),
        "z_rose_in": len(z_up), "a_lowest_in": sum(x.get("a_lowest", False) for x in upd),
        "a_rank_from_low_mean": float(np.mean([x["a_rank_from_low"] for x in upd])) if upd else None,
        "b_own_rank_mean": float(np.mean([x["b_rank"] for x in rows if "b_rank" in x])) if upd else None,
        "b_own_top3_in": sum(1 for x in rows if x.get("b_rank", 99) <= 3),
        "kl_z_mean": float(np.mean([x["kl_z"] for x in rows if x["kl_z"] is not None])),
        "kl_alpha_mean": float(np.mean([x["kl_alpha"] for x in rows])),
        "a_sign_flips": flips, "a_rank_corr_consecutive": float(np.mean(rho)) if rho else None,
        "alignment_matrix_rank_corr_consecutive": float(np.mean(rho_a)) if rho_a else None,
        "kl_alpha_spent_before_z_top": _spent_before_top(rows),
    }
    return {"run": str(run_dir.relative_to(REPO)) if run_dir.is_relative_to(REPO) else str(run_dir),
            "summary": summary, "updates": rows}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "runs" / "bench_value"))
    p.add_argument("--method", default="grape")
    p.add_argument("--json", default="", help="also write the analysis here")
    args = p.parse_args(argv)
    found = sorted(Path(args.out).glob(f"{args.method}-seed*/result.json"),
                   key=lambda q: int(q.parent.name.rsplit("seed", 1)[1]))
    out = []
    for path in found:
        an = analyse(path.parent)
        out.append(an)
        s = an["summary"]
        print(f"{path.parent.name}: worst target {s['worst_target']} ({s['final']:.4f}); alpha on it "
              f"{s['alpha_own_mean']:.3f} mean / {s['alpha_own_final']:.3f} final; z on it rank {s['z_rank_mean']:.1f} "
              f"of 7 on average, rose in {s['z_rose_in']} of {s['updates'] - 1} updates; its a_n the lowest in "
              f"{s['a_lowest_in']} (mean rank from the lowest {s['a_rank_from_low_mean']}); b on its language in the "
              f"top 3 in {s['b_own_top3_in']} of {s['updates']} (mean rank {s['b_own_rank_mean']}); KL per update z "
              f"{s['kl_z_mean']:.4f} alpha {s['kl_alpha_mean']:.4f}; a_n sign flips {s['a_sign_flips']}; "
              f"rank corr of consecutive a {s['a_rank_corr_consecutive']:.2f}, of consecutive A "
              f"{s['alignment_matrix_rank_corr_consecutive']:.2f}; z ranks it first from step "
              f"{s['kl_alpha_spent_before_z_top']['z_top_from_step']}, after "
              f"{s['kl_alpha_spent_before_z_top']['share'] or 0:.0%} of alpha's movement")
        print("  step  lr   alpha_k*  z_n*  z rank  a_n*      a rank(low)  b_k*       b rank  KL z    KL alpha  rse")
        for x in an["updates"]:
            print(f"  {x['step']:>4} {x['lr_factor']:.2f}  {x['alpha_own']:.3f}    {x['z'] or math.nan:.3f}  "
                  f"{x['z_rank'] or 0:>5}   {x.get('a', math.nan):+.2e} {x.get('a_rank_from_low', 0):>5}       "
                  f"{x.get('b_own', math.nan):+.2e} {x.get('b_rank', 0):>5}   {x['kl_z'] or 0:.4f}  "
                  f"{x['kl_alpha']:.4f}    {x['probe_rse'] if x['probe_rse'] is not None else '-'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
