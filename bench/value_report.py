"""The value benchmark's statistics, table and claims (``bench/value.py`` writes them; issue 32).

Why a module of its own: the figures a reviewer reads (n, t-based confidence intervals, which library
version each row ran on, the worst-target and per-target counts) are computed from the runs on disk in one
place, so ``--collect`` recomputes every figure from the runs and nothing is copied by hand.

Conventions:
- every row is a set of seeds of one method on ONE library version (``library_tree``: the git tree hash of
  ``grape_stream/`` the run imported); runs of another version are left out of the table and listed apart;
- ``ci`` is the half-width of the two-sided 95% t interval of the mean (n - 1 degrees of freedom); n = 1
  has no interval and prints "n=1";
- "better than uniform" compares a run with uniform's seed mean on the same measure (a seed of another
  method does not share uniform's data order, so seeds are not paired).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

#: Two-sided 95% Student t quantiles t_{0.975, df}, df = 1..30 (beyond: 1.96 is within 2% of the truth).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
         2.042)

#: Rows compared with uniform on every target in the claims (the issue's side-by-side list).
SIDE_BY_SIDE = ("grape", "doge", "regmix", "crisp")


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """(mean, sample std); std is 0.0 for one value (the table prints n=1 instead of it)."""
    n = len(xs)
    if not n:
        return float("nan"), float("nan")
    m = sum(xs) / n
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0)


def t_ci(xs: Sequence[float]) -> float | None:
    """Half-width of the 95% t interval of the mean; None for fewer than 2 values."""
    n = len(xs)
    if n < 2:
        return None
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return t * mean_std(xs)[1] / math.sqrt(n)


def summary(xs: Sequence[float]) -> dict[str, Any]:
    """What a row says about one measure: n, mean, std, 95% t half-width, the values."""
    m, s = mean_std(xs)
    return {"n": len(xs), "mean": m, "std": s if len(xs) > 1 else None, "ci": t_ci(xs), "values": list(xs)}


def fmt(st: Mapping[str, Any], digits: int = 4) -> str:
    """'mean +- ci (n=k)', or 'mean (n=1)': never a '+- 0' for a single run."""
    if not st["n"]:
        return "-"
    if st["ci"] is None:
        return f"{st['mean']:.{digits}f} (n=1)"
    return f"{st['mean']:.{digits}f} +- {st['ci']:.{digits}f}"


def tokens_to_reach(curve: Mapping[str, Any], level: float) -> float | None:
    """First training-token count at which the average test loss is <= level (linear interpolation)."""
    xs, ys = curve["tokens"], curve["avg"]
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y <= level:
            if i == 0:
                return float(x)
            x0, y0 = xs[i - 1], ys[i - 1]
            return float(x0 + (x - x0) * (y0 - level) / (y0 - y)) if y0 != y else float(x)
    return None


def probe_step_equivalents(run: Mapping[str, Any], part: str = "reweighting") -> float:
    """What the run's reweighting cost, in training steps of the same run: probe + update seconds over the
    seconds of one training step (total minus test-curve evaluation, reweighting and the prior, per step). Both
    are measured in the same process at the same machine load, so their ratio is steadier than either.
    ``part="prior"``: the same for the prior ``alpha0: crisp`` computed in the run's set-up (paid once, up front)."""
    sec = run.get("seconds") or {}
    cost = float(sec.get(part, 0.0))
    steps = int(run.get("steps") or run["curve"]["step"][-1])
    train = (float(sec.get("total", 0.0)) - float(sec.get("curve_eval", 0.0)) - float(sec.get("reweighting", 0.0))
             - float(sec.get("prior", 0.0)))
    return cost / (train / steps) if cost > 0 and train > 0 and steps else 0.0


#: Reuse methods (issue 32 part 3) -> (the method whose finished runs they are built from, which of its seeds:
#: "previous" (the seed before, cyclically), "same" (this seed's) or "others" (every other seed's, pooled)).
REUSE = {"grape_replay": ("grape", "previous"), "grape_final_static": ("grape", "previous"),
         "grape_final_mean": ("grape", "others"), "doremi_final_static": ("doremi", "same")}


def aggregate(runs: Mapping[str, Mapping[int, Mapping[str, Any]]], targets: Sequence[str],
              sources: Sequence[str]) -> dict[str, Any]:
    """Per method: n, avg / worst / per-target test loss, oracle gain captured, targets better than uniform,
    tokens and compute to uniform's final. Long because each measure is one short, separate block."""
    u, o = runs.get("uniform", {}), runs.get("oracle", {})
    out: dict[str, Any] = {}
    if not u:
        return out
    u_avg = mean_std([r["final_avg"] for r in u.values()])[0]
    u_worst = mean_std([r["final_worst"] for r in u.values()])[0]
    u_t = {t: mean_std([r["final"][t] for r in u.values()])[0] for t in targets}
    o_avg = mean_std([r["final_avg"] for r in o.values()])[0] if o else None
    o_worst = mean_std([r["final_worst"] for r in o.values()])[0] if o else None
    u_final = {s: r["curve"]["avg"][-1] for s, r in u.items()}
    u_final_mean = mean_std(list(u_final.values()))[0]
    u_tokens = next(iter(u.values()))["train_tokens"]
    for m, by_seed in runs.items():
        seeds = sorted(by_seed)
        rs = [by_seed[s] for s in seeds]
        avg, worst = [r["final_avg"] for r in rs], [r["final_worst"] for r in rs]
        st: dict[str, Any] = {
            "seeds": seeds, "n": len(seeds), "avg": summary(avg), "worst": summary(worst),
            "per_target": {t: summary([r["final"][t] for r in rs]) for t in targets},
            "targets_better_than_uniform": [sum(r["final"][t] < u_t[t] for t in targets) for r in rs],
            "worst_better_than_uniform": [w < u_worst for w in worst],
            "commits": sorted({(r.get("code") or {}).get("commit", "unrecorded") for r in rs}),
        }
        # per seed: the gain over uniform's seed mean, as a share of the oracle's (seed means); only where the
        # oracle gains at all (a share of a loss, or of nothing, reads backwards)
        if o_avg is not None and u_avg - o_avg > 1e-12:
            st["gain_captured_avg"] = summary([(u_avg - a) / (u_avg - o_avg) for a in avg])
        if o_worst is not None and u_worst - o_worst > 1e-12:
            st["gain_captured_worst"] = summary([(u_worst - w) / (u_worst - o_worst) for w in worst])
        reach = [tokens_to_reach(r["curve"], u_final.get(s, u_final_mean)) for s, r in zip(seeds, rs)]
        frac = [None if t is None else t / r["train_tokens"] for t, r in zip(reach, rs)]
        got = [x for x in frac if x is not None]
        st["tokens_to_uniform_final"] = {"values": frac, "mean": mean_std(got)[0] if got else None,
                                         "reached": len(got), "of": len(frac)}
        # compute: the training steps to reach uniform's final plus the reweighting's cost up to then
        # (probe seconds spread evenly over the run) and the prior's (paid before step 0), over uniform's 400 steps
        comp = []
        for f, r in zip(frac, rs):
            if f is not None:
                steps = int(r.get("steps") or r["curve"]["step"][-1])
                spent = f * (steps + probe_step_equivalents(r)) + probe_step_equivalents(r, "prior")
                comp.append(spent / steps * r["train_tokens"] / u_tokens)
        st["compute_to_uniform_final"] = summary(comp) | {"reached": len(comp), "of": len(frac)}
        st["steps"] = mean_std([int(r.get("steps") or r["curve"]["step"][-1]) for r in rs])[0]
        st["probe_step_equivalents"] = summary([probe_step_equivalents(r) for r in rs])
        # reuse rows: how many source runs each run was built from (their compute is its cost); a run recorded
        # before runs kept their sources is one source run's, unless it pools several (unknown how many)
        if m in REUSE:
            source, which = REUSE[m]
            st["reuse_sources"] = {"method": source, "runs": [
                len(x["seeds"]) if x else (None if which == "others" else 1)
                for x in (r.get("reuse_sources") for r in rs)]}
        st["prior_step_equivalents"] = summary([probe_step_equivalents(r, "prior") for r in rs])
        tv, finals = [], []
        for r in rs:
            traj = r.get("trajectory") or []
            if traj:
                a0 = np.full(len(sources), 1.0 / len(sources))
                tv.append(max(0.5 * float(np.abs(np.asarray(x["alpha"]) - a0).sum()) for x in traj))
                finals.append(traj[-1]["alpha"])
        st["alpha_moved_tv"] = mean_std(tv)[0] if tv else 0.0
        st["final_alpha"] = dict(zip(sources, np.mean(finals, axis=0).round(4).tolist())) if finals else None
        st["seconds"] = mean_std([r["seconds"]["total"] for r in rs])[0]
        st["reweighting_seconds"] = mean_std([r["seconds"]["reweighting"] for r in rs])[0]
        # a run's own process's peak RSS (runs recorded before runs had a process each lack it)
        peaks = [r["peak_rss_mb"] for r in rs if r.get("peak_rss_mb") is not None]
        st["peak_rss_mb"] = {"max": max(peaks) if peaks else None, "values": [r.get("peak_rss_mb") for r in rs],
                             "recorded": len(peaks), "of": len(rs)}
        out[m] = st
    return out


#: The margin rule: a benchmark tells mixtures apart when its oracle beats uniform by >= this many uniform seed-stds.
MARGIN_RULE = 4.0


def claims(agg: Mapping[str, Any], method: str = "grape",
           search_settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The issues' acceptance figures (25 and 32) for ``method`` (the default GRAPE), from the runs.
    ``search_settings``: the oracle search's (its proxies' count and steps price RegMix in the reuse claim)."""
    if "uniform" not in agg or "oracle" not in agg:
        return {}
    u, o = agg["uniform"], agg["oracle"]
    c: dict[str, Any] = {
        "oracle_margin_in_uniform_std": {
            k: ((u[k]["mean"] - o[k]["mean"]) / u[k]["std"] if u[k]["std"] else None) for k in ("avg", "worst")},
        "uniform_seed_std": {"avg": u["avg"]["std"], "worst": u["worst"]["std"]},
        # the benchmark separates mixtures only where the best static one is this far ahead of uniform (issue 32)
        "margin_rule": {"uniform_stds": MARGIN_RULE, "met": {
            k: bool(u[k]["std"] and (u[k]["mean"] - o[k]["mean"]) / u[k]["std"] >= MARGIN_RULE)
            for k in ("avg", "worst")}},
        "targets_improved_per_seed": {
            m: {"per_seed": dict(zip(map(str, agg[m]["seeds"]), agg[m]["targets_better_than_uniform"])),
                "of": len(agg[m]["per_target"])} for m in SIDE_BY_SIDE if m in agg},
    }
    if method in agg:
        g = agg[method]
        c["method"] = method
        c["n"] = g["n"]
        gains = {k: {x: g[f"gain_captured_{k}"][x] for x in ("mean", "std", "ci", "n")}
                 for k in ("avg", "worst") if f"gain_captured_{k}" in g}
        if gains:  # a side is absent where the oracle does not beat uniform on it (no gain to capture)
            c["oracle_gain_captured"] = gains
        c["worst_target_improved_seeds"] = {"improved": sum(g["worst_better_than_uniform"]), "n": g["n"],
                                            "reference": "uniform's seed mean of the worst-target test loss"}
        t = g["tokens_to_uniform_final"]
        c["tokens_to_uniform_final"] = {"mean": t["mean"], "reached": t["reached"], "of": t["of"]}
        c["compute_to_uniform_final"] = _compute_claim(agg, g)
        c["prior_repair"] = _prior_repair(agg, method)
        c["reuse"] = _reuse(agg, search_settings)
        ok = [k in c.get("oracle_gain_captured", {}) and c["oracle_gain_captured"][k]["mean"] >= 0.5
              and (c["oracle_gain_captured"][k]["std"] or 0.0) < c["oracle_gain_captured"][k]["mean"]
              for k in ("avg", "worst")]
        c["goal_met"] = {"gain_captured_ge_0.5_and_mean_minus_std_gt_0": all(ok),
                         "tokens_le_0.6x": bool(t["mean"] is not None and t["reached"] == t["of"] and t["mean"] <= 0.6),
                         "worst_better_than_uniform_every_seed": c["worst_target_improved_seeds"]["improved"] == g["n"]}
    return c


#: The static priors GRAPE is started from (``grape_<prior>``: alpha0 = that mixture), issue 32 part 3.
#: name -> (the static row, the GRAPE row started from it; ``{m}`` is the method). ``crisp_in_run``: GRAPE started
#: from ``alpha0: crisp`` (CRISP computed in the run's own set-up from its shards), against the search's CRISP row.
PRIORS = {"crisp": ("crisp", "{m}_crisp"), "regmix": ("regmix", "{m}_regmix"),
          "crisp_in_run": ("crisp", "{m}_crisp_prior")}


def _prior_repair(agg: Mapping[str, Any], method: str) -> dict[str, Any]:
    """Per prior: the prior's test loss minus GRAPE-from-that-prior's, paired by seed (positive: repaired),
    on the average and the worst target; only seeds both rows ran."""
    out: dict[str, Any] = {}
    for name, (static, start) in PRIORS.items():
        started = start.format(m=method)
        if static not in agg or started not in agg:
            continue
        p, g = agg[static], agg[started]
        seeds = sorted(set(p["seeds"]) & set(g["seeds"]))
        row: dict[str, Any] = {"static": static, "started": started, "seeds": seeds}
        for k in ("avg", "worst"):
            pv = dict(zip(p["seeds"], p[k]["values"]))
            gv = dict(zip(g["seeds"], g[k]["values"]))
            diffs = [pv[s] - gv[s] for s in seeds]
            row[k] = {x: summary(diffs)[x] for x in ("mean", "ci", "n", "values")} if diffs else None
        out[name] = row
    return out


def _reuse(agg: Mapping[str, Any], search_settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """A finished run reused as the next run's mixture, against RegMix at its full proxy cost, in training-step
    equivalents of this model: ``marginal_steps`` is the run itself (its probes included); ``total_steps`` adds
    its source runs (their steps and probes), the price when they were trained only to be reused. RegMix's
    total is its proxies' steps plus its run (the proxies are this model, at ``proxy_steps``); without the
    search's settings its price is unknown and it is left out."""
    def cost(m: str) -> float:
        a = agg[m]
        return float(a["steps"]) + a["probe_step_equivalents"]["mean"] + a["prior_step_equivalents"]["mean"]

    def row(m: str, extra_steps: float, **more: Any) -> dict[str, Any]:
        total = cost(m) + extra_steps
        return {**{k: {x: agg[m][k][x] for x in ("mean", "ci", "n")} for k in ("avg", "worst")},
                "marginal_steps": cost(m), **more, "total_steps": total, "total_of_uniform": total / cost("uniform")}

    rows: dict[str, Any] = {}
    for m in (m for m in REUSE if m in agg):
        src = agg[m]["reuse_sources"]
        if src["method"] in agg and None not in src["runs"]:
            k = float(np.mean(src["runs"]))
            rows[m] = row(m, k * cost(src["method"]),
                          source={"method": src["method"], "runs": k, "steps_each": cost(src["method"])})
    ss = search_settings or {}
    if "regmix" in agg and ss.get("proxies") and ss.get("proxy_steps"):
        rows["regmix"] = row("regmix", float(ss["proxies"]) * float(ss["proxy_steps"]),
                             proxies={"runs": ss["proxies"], "steps": ss["proxy_steps"]})
    return rows


def _compute_claim(agg: Mapping[str, Any], g: Mapping[str, Any]) -> dict[str, Any]:
    """Compute to uniform's final (probe included) beside uniform trained under shorter schedules of its own:
    GRAPE pays off in compute where it reaches uniform-400's final at a compute at which uniform's own
    schedule of that length is still behind it."""
    short = {int(m.rsplit("_s", 1)[1]): agg[m]["avg"] for m in agg if m.startswith("uniform_s")}
    u = agg["uniform"]["avg"]
    return {"fraction_of_uniform_steps": {k: g["compute_to_uniform_final"][k] for k in ("mean", "ci", "n", "values")},
            "reached": g["compute_to_uniform_final"]["reached"], "of": g["compute_to_uniform_final"]["of"],
            "probe_step_equivalents": g["probe_step_equivalents"]["mean"],
            "uniform_final_by_schedule": {str(k): {"steps": k, "avg": v["mean"], "ci": v["ci"], "n": v["n"]}
                                          for k, v in sorted(short.items())}
            | {"400": {"steps": 400, "avg": u["mean"], "ci": u["ci"], "n": u["n"]}}}


def table(agg: Mapping[str, Any], targets: Sequence[str]) -> str:
    """The table docs/results.md shows: n, mean +- 95% t half-width (n=1 says so), per-target means."""
    rows = [("method", "n", "avg test loss", "worst test loss", "gain capt. avg", "gain capt. worst",
             "targets > unif. per seed", "worst > unif.", "compute to unif.", "alpha moved", "s/run", "peak RSS MB")]
    for m, st in agg.items():
        c = st["compute_to_uniform_final"]
        part = "" if c["reached"] == c["of"] else f" ({c['reached']}/{c['of']})"
        reach = "not reached" if not c["reached"] else f"{c['mean']:.2f}x{part}"
        rows.append((m, str(st["n"]), fmt(st["avg"]), fmt(st["worst"]),
                     fmt(st["gain_captured_avg"], 2) if "gain_captured_avg" in st else "-",
                     fmt(st["gain_captured_worst"], 2) if "gain_captured_worst" in st else "-",
                     ",".join(map(str, st["targets_better_than_uniform"])) + f" of {len(targets)}",
                     f"{sum(st['worst_better_than_uniform'])}/{st['n']}", reach, f"{st['alpha_moved_tv']:.2f}",
                     f"{st['seconds']:.0f}", peak_rss(st)))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip() for r in rows]
    lines.insert(1, "-" * max(len(x) for x in lines))
    lines += ["", "+- is the 95% t interval's half-width over seeds (n - 1 df); gain captured: share of the oracle's "
              "gain over uniform ('-' where the oracle does not beat uniform); compute: steps to uniform-400's final "
              "average, probe cost included, / 400; peak "
              "RSS: the largest over seeds of a run's own process's ru_maxrss (n/a: runs from before a run had a "
              "process of its own; (k/n): k of the n seeds recorded it)",
              "", "per-target test loss (nats/token, mean over seeds; * = best):",
              f"{'method':<20}" + "".join(f"{t:>8}" for t in targets)]
    best = {t: min(st["per_target"][t]["mean"] for st in agg.values()) for t in targets}
    for m, st in agg.items():
        lines.append(f"{m:<20}" + "".join(
            f"{st['per_target'][t]['mean']:>7.3f}{'*' if st['per_target'][t]['mean'] == best[t] else ' '}"
            for t in targets))
    lines += ["", "final alpha (mean over seeds):"]
    for m, st in agg.items():
        if st.get("final_alpha"):
            lines.append(f"{m:<20}" + " ".join(f"{k} {v:.2f}" for k, v in st["final_alpha"].items()))
    return "\n".join(lines)


def peak_rss(st: Mapping[str, Any]) -> str:
    """The peak RSS cell: the largest over the seeds that recorded one, 'n/a' when none did."""
    p = st.get("peak_rss_mb") or {}
    if not p.get("recorded"):
        return "n/a"
    return f"{p['max']:.0f}" + ("" if p["recorded"] == p["of"] else f" ({p['recorded']}/{p['of']})")


def split_by_version(runs: Mapping[str, Mapping[int, Mapping[str, Any]]], version: str | None,
                     equivalent: Sequence[str] = ()
                     ) -> tuple[dict[str, dict[int, Any]], dict[str, dict[int, Any]], str | None]:
    """(runs on ``version``, runs on any other, the version used). ``version`` None: the library tree most
    runs recorded (the table is one version; the others are listed apart, never mixed into a row).
    ``equivalent``: trees shown to reproduce ``version``'s runs (bench/value.py ``--join``), counted as it."""
    def tree(r: Mapping[str, Any]) -> str:
        return str((r.get("code") or {}).get("library_tree", "unrecorded"))

    if version is None:
        count: dict[str, int] = {}
        for by_seed in runs.values():
            for r in by_seed.values():
                count[tree(r)] = count.get(tree(r), 0) + 1
        version = max(count, key=lambda k: (k != "unrecorded", count[k])) if count else None
    same: dict[str, dict[int, Any]] = {}
    other: dict[str, dict[int, Any]] = {}
    for m, by_seed in runs.items():
        for s, r in by_seed.items():
            (same if tree(r) == version or tree(r) in equivalent else other).setdefault(m, {})[s] = r
    return same, other, version
