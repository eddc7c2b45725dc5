"""`grape-stream demo`: uniform vs DoGE vs GRAPE on real multilingual text, on a laptop CPU.

The paper's wiki40b experiment in miniature: six source languages (en fr de es ru it) are the domains
whose mixture is learned, seven low-resource languages (tr da ca pl nl uk pt) are the targets whose
held-out text we want to model well. Every method trains the same byte-level decoder from the same
initialisation on the same token budget; only the domain weights differ.

Everything runs on the product path: the bundled corpus (``data/demo``) is converted with
:func:`grape_stream.convert.pipeline.convert` into per-language MDS shards, and each method is the bundled
``demo-cpu`` recipe (:mod:`grape_stream.integrations.composer.trainer`) built into a Composer Trainer with ``GrapeAlgorithm``,
with a few overrides (:func:`recipe_overrides`). Two callbacks of this module watch the run: a tqdm
progress bar, and a test-loss curve on a fixed strided subset of each target's test split (the
headline numbers come from the recipe's own evaluators, on the whole test split, at the end).

Outputs under ``--out`` (default ``runs/demo``): ``mds/`` (the converted corpus, reused while the
corpus and settings are unchanged), ``<method>/`` (metrics.jsonl, grape_trajectory.jsonl/.png,
result.json), ``summary.json``, ``test_loss.png`` and ``weights.png``.

The same runner (:func:`run_method`) drives ``bench/mixture_quality.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = [
    "DemoSettings",
    "DEMO",
    "QUICK",
    "METHOD_BLURBS",
    "find_corpus",
    "ensure_converted",
    "recipe_overrides",
    "run_method",
    "format_table",
    "main",
]

log = logging.getLogger(__name__)

RECIPE = "demo-cpu"
CONVERT_SETTINGS_FILE = "grape_demo_convert.json"

METHOD_BLURBS = {
    "uniform": "fixed 1/6 on every source language",
    "doge": "DoGE: upweight sources whose gradient aligns with the average target gradient",
    "doge_pcgrad": "DoGE with PCGrad-combined target gradients",
    "grape": "GRAPE: upweight sources that help the targets that are learning slowest (z)",
    "grape_gap": "GRAPE, progress = raw alignment (no loss normalisation)",
    "grape_ema": "GRAPE, progress normalised by an EMA of the target loss",
}


@dataclass(frozen=True)
class DemoSettings:
    """What the demo changes relative to the ``demo-cpu`` recipe (everything else comes from it).

    ``mu_alpha`` / ``mu_z`` / ``clip_norm``: GRAPE's step sizes are eta = lr / mu (GRAPE-SPEC.md); at the
    peak lr of 2e-3 these give eta_alpha = eta_z = 10, with every probe gradient clipped to norm 1 before
    the inner products (the authors' code does the same). Chosen with short tuning runs on this corpus
    (docs/results.md): without clipping the raw alignments swing by 100x between updates (gradient-norm
    spikes), so a step that moves alpha at all on quiet updates flips it onto one source on a spiky one
    (eta_alpha = 10: collapse onto ru), and one that never flips barely moves (eta_alpha = 2: 5% total
    variation). ``curve_every`` / ``curve_samples``: the test-loss curve (strided subset per target).
    """

    steps: int = 400
    global_batch: int = 32
    lr: float = 2.0e-3
    warmup: int = 20
    update_every: int = 25
    probe_domain_batch: int = 8
    probe_task_batch: int = 8
    mu_alpha: float = 2.0e-4
    mu_z: float = 2.0e-4
    clip_norm: float | None = 1.0
    curve_every: int = 50
    curve_samples: int = 64
    eval_batch_size: int = 64
    final_eval: bool = True  # the recipe's evaluators on the whole test split at the last step
    final_samples: int = 192  # without final_eval: a larger strided subset per target, at the last step

    def replace(self, **changes: Any) -> "DemoSettings":
        return dataclasses.replace(self, **changes)


#: `grape-stream demo` (7.2 minutes for three methods measured on 2 idle CPU cores).
DEMO = DemoSettings()
#: `grape-stream demo --quick` (1.3 minutes measured on 2 idle CPU cores).
QUICK = DemoSettings(steps=48, warmup=8, update_every=8, curve_every=16, curve_samples=32, final_eval=False,
                     final_samples=96)


# ---------------------------------------------------------------------------------------------------
# corpus -> MDS
# ---------------------------------------------------------------------------------------------------
def find_corpus(path: str | None = None) -> Path:
    """The bundled corpus directory (holds corpus.json): ``path``, else ./data/demo, else the repo's."""
    candidates = [Path(path)] if path else [Path("data/demo"), Path(__file__).resolve().parents[1] / "data" / "demo"]
    for c in candidates:
        if (c / "corpus.json").is_file():
            return c
    where = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"no demo corpus (corpus.json) at {where}; run from the repository root or pass --data DIR "
        "(scripts/build_demo_corpus.py builds it)"
    )


def _corpus_fingerprint(corpus: Path, files: Sequence[Path], seq_len: int) -> dict[str, Any]:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(corpus)).encode())
        h.update(f.read_bytes())
    from grape_stream.convert.pipeline import CONVERTER_VERSION

    return {"inputs_sha256": h.hexdigest(), "tokenizer": "bytes", "seq_len": int(seq_len),
            "domain_field": "lang", "split_field": "split", "converter_version": CONVERTER_VERSION}


def ensure_converted(corpus: Path, out: Path, *, seq_len: int = 256, progress: bool = True) -> tuple[dict[str, Any], bool]:
    """Convert the corpus to ``out`` (OUT/<lang>/<split>/) unless it already holds this exact conversion.

    Returns (manifest, converted_now). The check is a hash of the input files plus the settings, so an
    edited corpus or another seq_len converts again (over the old output), and a finished one is reused.
    """
    files = sorted(corpus.glob("*/*.jsonl.zst"))
    if not files:
        raise FileNotFoundError(f"{corpus}: no <split>/<lang>.jsonl.zst files")
    want = _corpus_fingerprint(corpus, files, seq_len)
    stamp = out / CONVERT_SETTINGS_FILE
    manifest_path = out / "manifest.json"
    if stamp.is_file() and manifest_path.is_file():
        try:
            have = json.loads(stamp.read_text())
        except json.JSONDecodeError:
            have = None
        if have == want:
            return json.loads(manifest_path.read_text()), False
    from grape_stream.convert.pipeline import convert

    overwrite = out.exists() and any(out.iterdir())
    result = convert("jsonl", [str(f) for f in files], str(out), tokenizer="bytes", seq_len=seq_len,
                     domain_field="lang", split_field="split", overwrite=overwrite, progress=progress)
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps(want, indent=2))
    os.replace(tmp, stamp)
    return result.manifest, True


# ---------------------------------------------------------------------------------------------------
# one training run on the product path
# ---------------------------------------------------------------------------------------------------
def recipe_overrides(method: str, settings: DemoSettings, *, mds: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                     seed: int, extra: Sequence[str] = ()) -> list[str]:
    """The ``key=value`` overrides that turn the ``demo-cpu`` recipe into one demo/bench run."""
    s = settings
    return [
        f"run_name=demo-{method}",
        f"output_dir={os.fspath(out_dir)}",
        f"seed={seed}",
        f"data.local={os.fspath(mds)}",
        "data.split=train",
        "data.task_probe_split=probe",  # the bundled corpus calls the targets' validation split "probe"
        "data.task_test_split=test",
        f"data.eval_batch_size={s.eval_batch_size}",
        f"algorithm.method={method}",
        f"algorithm.seed={seed}",
        f"algorithm.alpha_every={s.update_every}",
        f"algorithm.z_every={s.update_every}",
        f"algorithm.probe_domain_batch={s.probe_domain_batch}",
        f"algorithm.probe_task_batch={s.probe_task_batch}",
        f"algorithm.mu_alpha={s.mu_alpha}",
        f"algorithm.mu_z={s.mu_z}",
        f"algorithm.options.clip_norm={'null' if s.clip_norm is None else s.clip_norm}",
        f"optimizer.lr={s.lr}",
        f"scheduler.t_warmup={s.warmup}ba",
        f"trainer.max_duration={s.steps}ba",
        f"trainer.global_train_batch_size={s.global_batch}",
        # the final evaluation only; the curve comes from _TestCurve (cheaper, same test split)
        f"trainer.eval_interval={s.steps if s.final_eval else 0}ba",  # 0: never (Composer)
        "trainer.save_folder=null",
        "trainer.autoresume=false",
        "trainer.log_to_console=false",
        "trainer.progress_bar=false",
        *extra,
    ]


def _strided_indices(n_total: int, n: int) -> list[int]:
    """n indices spread over the whole split (the test files are ordered by source document, so the
    first n samples would all come from one documentation package)."""
    n = min(n, n_total)
    return sorted({int(round(i * (n_total - 1) / max(n - 1, 1))) for i in range(n)})


def _make_callbacks(method: str, settings: DemoSettings, progress: bool, position: str) -> tuple[Any, Any]:
    import torch
    from composer.core import Callback, State
    from composer.loggers import Logger
    from torch.nn import functional as F

    class TestCurve(Callback):
        """Token-level test cross-entropy of each target on a fixed strided subset, every few steps."""

        def __init__(self) -> None:
            self.tasks: list[Any] = []
            self.batches: dict[str, list[dict[str, torch.Tensor]]] = {}
            self.steps: list[int] = []
            self.loss: dict[str, list[float]] = {}
            self.final: dict[str, float] = {}
            self.final_step: int | None = None
            self.eval_seconds = 0.0

        def prepare(self, tasks: Sequence[Any]) -> None:
            self.tasks = list(tasks)
            self.batches = self._subset(settings.curve_samples)
            self.final_batches = None if settings.final_eval else self._subset(settings.final_samples)
            self.loss = {t.name: [] for t in self.tasks}

        def _subset(self, n: int) -> dict[str, list[dict[str, torch.Tensor]]]:
            from grape_stream.grape.tasks import collate_task_samples

            out = {}
            for t in self.tasks:
                ds = t.dataset(t.test_split)
                samples = [ds[i] for i in _strided_indices(ds.num_samples, n)]
                bs = settings.eval_batch_size
                out[t.name] = [collate_task_samples(samples[i:i + bs]) for i in range(0, len(samples), bs)]
            return out

        @torch.no_grad()
        def _ce(self, state: State, subset: Mapping[str, list[dict[str, torch.Tensor]]]) -> dict[str, float]:
            t0 = time.perf_counter()
            model = state.model
            was = model.training
            model.eval()
            out = {}
            try:
                for name, batches in subset.items():
                    tot, cnt = 0.0, 0.0
                    for b in batches:
                        logits = model(b)
                        tgt = b["tokens"].long()[:, 1:]
                        m = b["loss_mask"][:, 1:].to(torch.float64)
                        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1),
                                             reduction="none").view(tgt.shape).double()
                        tot += float((ce * m).sum())
                        cnt += float(m.sum())
                    out[name] = tot / max(cnt, 1.0)
            finally:
                model.train(was)
            self.eval_seconds += time.perf_counter() - t0
            return out

        def _measure(self, state: State) -> None:
            for name, v in self._ce(state, self.batches).items():
                self.loss[name].append(v)
            self.steps.append(int(state.timestamp.batch))

        def fit_start(self, state: State, logger: Logger) -> None:
            self._measure(state)

        def batch_end(self, state: State, logger: Logger) -> None:
            step = int(state.timestamp.batch)
            if step % settings.curve_every == 0 or step == settings.steps:
                self._measure(state)
            if step == settings.steps and self.final_batches is not None:
                self.final, self.final_step = self._ce(state, self.final_batches), step

        def eval_after_all(self, state: State, logger: Logger) -> None:
            vals = {}
            for t in self.tasks:
                metric = state.eval_metrics.get(t.name, {}).get("LanguageCrossEntropy")
                if metric is not None:
                    vals[t.name] = float(metric.compute())
            if vals:
                self.final, self.final_step = vals, int(state.timestamp.batch)

        def latest_avg(self) -> float | None:
            if not self.steps:
                return None
            return sum(v[-1] for v in self.loss.values()) / max(len(self.loss), 1)

    class Progress(Callback):
        """One tqdm bar per run: train loss, the current test average and the heaviest source weight."""

        def __init__(self, curve: TestCurve) -> None:
            self.curve = curve
            self.bar: Any = None
            self.train_loss: list[tuple[int, float]] = []

        def fit_start(self, state: State, logger: Logger) -> None:
            if progress:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=settings.steps, desc=f"{position} {method:<11}", unit="step", leave=True,
                                dynamic_ncols=True, file=sys.stderr)

        def batch_end(self, state: State, logger: Logger) -> None:
            step = int(state.timestamp.batch)
            loss = float(state.loss.detach()) if isinstance(state.loss, torch.Tensor) else float("nan")
            if step % 5 == 0 or step == 1:
                self.train_loss.append((step, loss))
            if self.bar is None:
                return
            post = {"train": f"{loss:.3f}"}
            avg = self.curve.latest_avg()
            if avg is not None:
                post["test avg"] = f"{avg:.3f}"
            algo = next((a for a in state.algorithms if type(a).__name__ == "GrapeAlgorithm"), None)
            ctl = getattr(algo, "controller", None)
            if ctl is not None and method != "uniform":
                k = int(ctl.alpha.argmax())
                post["top source"] = f"{ctl.domain_names[k]} {ctl.alpha[k]:.2f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)

        def fit_end(self, state: State, logger: Logger) -> None:
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    curve = TestCurve()
    return curve, Progress(curve)


@contextlib.contextmanager
def _quiet() -> Any:
    """Composer and streaming talk a lot for a demo; keep warnings and errors, drop the chatter."""
    noisy = ["composer", "streaming", "grape_stream.integrations.composer.trainer", "torch.distributed"]
    old = {n: logging.getLogger(n).level for n in noisy}
    for n in noisy:
        logging.getLogger(n).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Cannot split tensor.*")
        warnings.filterwarnings("ignore", category=UserWarning, module="composer")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        try:
            yield
        finally:
            for n, lvl in old.items():
                logging.getLogger(n).setLevel(lvl)


def _release(built: Any) -> None:
    """Free streaming's shared memory so the next run in this process can open the same directories."""
    from grape_stream.streaming_compat.local_index import release_streaming_dataset

    with contextlib.suppress(Exception):
        built.trainer.close()
    with contextlib.suppress(Exception):
        built.mixer.close()
    for t in built.tasks:
        # TaskStream has no close(); its datasets live in a private cache (see the report / issue).
        for ds in list(getattr(t, "_datasets", {}).values()):
            with contextlib.suppress(Exception):
                release_streaming_dataset(ds)
        if hasattr(t, "_datasets"):
            t._datasets.clear()


def run_method(method: str, *, mds: str | os.PathLike[str], out_dir: str | os.PathLike[str],
               settings: DemoSettings = DEMO, seed: int = 17, progress: bool = True, position: str = "",
               extra_overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Train one method with the ``demo-cpu`` recipe and return its result (also written to
    ``out_dir/result.json``): final per-target test log-perplexity (nats per token = per byte), the
    test-loss curve, the alpha/z trajectory and timings."""
    from grape_stream.integrations.composer.trainer import build, load_recipe

    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a fresh run: metrics.jsonl appends, the trajectory must not mix runs
    out_dir.mkdir(parents=True)
    overrides = recipe_overrides(method, settings, mds=mds, out_dir=out_dir, seed=seed, extra=extra_overrides)
    cfg = load_recipe(RECIPE, overrides)
    t0 = time.perf_counter()
    with _quiet():
        curve, bar = _make_callbacks(method, settings, progress, position)
        built = build(cfg, extra_callbacks=[curve, bar])
        try:
            curve.prepare(built.tasks)
            built.trainer.fit()
            ctl = getattr(built.algorithm, "controller", None)
            history = list(ctl.history) if ctl is not None else []
            domains = list(ctl.domain_names) if ctl is not None else [d["name"] for d in built.domains]
        finally:
            _release(built)
    seconds = time.perf_counter() - t0
    seq_len = int(cfg["data"]["seq_len"] or 256)
    tokens_per_step = settings.global_batch * seq_len
    tasks = [t.name for t in built.tasks]
    final = curve.final or {n: curve.loss[n][-1] for n in tasks}
    traj = [{"step": int(r["step"]), "alpha": r["alpha"], "z": r.get("z")} for r in history]
    probe_seconds = sum(float((r.get("seconds") or {}).get("total", 0.0)) for r in history)
    result = {
        "method": method,
        "seed": seed,
        "settings": dataclasses.asdict(settings),
        "recipe": RECIPE,
        "overrides": overrides,
        "domains": domains,
        "targets": tasks,
        "steps": settings.steps,
        "tokens_per_step": tokens_per_step,
        "train_tokens": settings.steps * tokens_per_step,
        "final_source": ("test split (full)" if settings.final_eval
                         else f"test split, strided subset of {settings.final_samples} samples per target"),
        "final": final,
        "final_avg": sum(final.values()) / len(final),
        "final_worst": max(final.values()),
        "curve": {
            "step": curve.steps,
            "tokens": [s * tokens_per_step for s in curve.steps],
            "loss": curve.loss,
            "avg": [sum(curve.loss[n][i] for n in tasks) / len(tasks) for i in range(len(curve.steps))],
            "worst": [max(curve.loss[n][i] for n in tasks) for i in range(len(curve.steps))],
            "samples_per_target": settings.curve_samples,
        },
        "trajectory": traj,
        "train_loss": bar.train_loss,
        "seconds": {"total": seconds, "curve_eval": curve.eval_seconds, "reweighting": probe_seconds},
    }
    with open(out_dir / "result.json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return result


# ---------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------
def alpha_movement(result: Mapping[str, Any]) -> float:
    """Largest total-variation distance of alpha from its initial value over the run (0 = never moved)."""
    traj = result.get("trajectory") or []
    if not traj:
        return 0.0
    a0 = traj[0]["alpha"]
    return max(0.5 * sum(abs(x - y) for x, y in zip(r["alpha"], a0)) for r in traj)


def format_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Per-target test log-perplexity, average and worst; the best method of each row is starred."""
    methods = list(results)
    targets = list(next(iter(results.values()))["targets"])
    w = max(9, *(len(m) + 2 for m in methods))
    lines = [f"{'target':<8}" + "".join(f"{m:>{w}}" for m in methods)]
    lines.append("-" * len(lines[0]))

    def row(label: str, values: list[float]) -> str:
        best = min(values)
        cells = "".join(f"{v:>{w - 1}.4f}{'*' if v == best and len(values) > 1 else ' '}" for v in values)
        return f"{label:<8}{cells}"

    for t in targets:
        lines.append(row(t, [results[m]["final"][t] for m in methods]))
    lines.append("-" * len(lines[0]))
    lines.append(row("average", [results[m]["final_avg"] for m in methods]))
    lines.append(row("worst", [results[m]["final_worst"] for m in methods]))
    return "\n".join(lines)


def _summary(results: Mapping[str, Mapping[str, Any]], settings: DemoSettings, seed: int, corpus: Path,
             mds: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "what": "test log-perplexity (nats per byte) per target language after the same token budget",
        "recipe": RECIPE,
        "settings": dataclasses.asdict(settings),
        "seed": seed,
        "corpus": str(corpus),
        "mds": str(mds),
        "methods": {},
    }
    for m, r in results.items():
        out["methods"][m] = {
            "final": r["final"], "average": r["final_avg"], "worst": r["final_worst"],
            "final_source": r["final_source"], "train_tokens": r["train_tokens"],
            "alpha_final": dict(zip(r["domains"], r["trajectory"][-1]["alpha"])) if r["trajectory"] else None,
            "z_final": (dict(zip(r["targets"], r["trajectory"][-1]["z"]))
                        if r["trajectory"] and r["trajectory"][-1].get("z") is not None and m != "uniform" else None),
            "alpha_moved_tv": alpha_movement(r),
            "seconds": r["seconds"],
            "curve": r["curve"],
            "trajectory": r["trajectory"],
        }
    return out


def _header(corpus_meta: Mapping[str, Any], settings: DemoSettings, methods: Sequence[str], quick: bool) -> str:
    roles = corpus_meta.get("roles", {})
    tokens = settings.steps * settings.global_batch * 256
    lines = [
        "",
        "grape-stream demo" + (" (quick)" if quick else "") + ": which source languages should a small model read",
        "to be good at seven other languages? Uniform mixing vs DoGE vs GRAPE, on real text, on this CPU.",
        "",
        f"  sources (the mixture alpha is learned over): {' '.join(roles.get('sources', []))}",
        f"  targets (held-out text we care about):       {' '.join(roles.get('targets', []))}",
        f"  model: the demo-cpu recipe's byte-level GPT; {settings.steps} steps x {settings.global_batch} x 256 bytes"
        f" = {tokens / 1e6:.1f}M training bytes per method",
        f"  every {settings.update_every} steps DoGE/GRAPE probe {settings.probe_domain_batch} samples per source and"
        f" {settings.probe_task_batch} per target (probe split) and update alpha",
        "  methods:",
    ]
    lines += [f"    {m:<12}{METHOD_BLURBS.get(m, '')}" for m in methods]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="grape-stream demo",
        description="Train a small byte-level decoder on the bundled multilingual corpus with uniform, DoGE and "
                    "GRAPE mixtures for the same token budget, and compare target-language test log-perplexity.",
    )
    p.add_argument("--quick", action="store_true", help="a ~1.3 minute run (48 steps per method) instead of ~7 minutes (400 steps), on 2 idle cores")
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.add_argument("--data", default=None, help="the bundled corpus directory (default: data/demo)")
    p.add_argument("--methods", default="uniform,doge,grape",
                   help=f"comma-separated methods (default: uniform,doge,grape; any of {', '.join(METHOD_BLURBS)})")
    p.add_argument("--seed", type=int, default=17, help="seed of model init, data order and probes (default: 17)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per method (default: 400, --quick 48)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHOD_BLURBS]
    if bad or not methods:
        p.error(f"unknown method(s) {bad}; choose from {', '.join(METHOD_BLURBS)}")
    if len(set(methods)) != len(methods):
        p.error(f"--methods repeats a method: {args.methods}")
    settings = QUICK if args.quick else DEMO
    if args.steps is not None:
        if args.steps < 1:
            p.error("--steps must be >= 1")
        settings = settings.replace(steps=args.steps, warmup=min(settings.warmup, max(args.steps // 5, 1)),
                                    update_every=min(settings.update_every, max(args.steps // 4, 1)),
                                    curve_every=min(settings.curve_every, max(args.steps // 3, 1)))
    try:
        corpus = find_corpus(args.data)
    except FileNotFoundError as exc:
        print(f"grape-stream demo: {exc}", file=sys.stderr)
        return 2
    corpus_meta = json.loads((corpus / "corpus.json").read_text())
    out = Path(args.out)
    mds = out / "mds"
    progress = not args.no_progress
    print(_header(corpus_meta, settings, methods, args.quick), flush=True)
    print("", flush=True)

    n_steps = len(methods) + 1
    t0 = time.perf_counter()
    print(f"[1/{n_steps}] corpus {corpus} -> MDS shards in {mds}", flush=True)
    _, converted = ensure_converted(corpus, mds, progress=False)
    print(f"      {'converted' if converted else 'already converted (same corpus and settings): reused'}"
          f" ({time.perf_counter() - t0:.0f}s)", flush=True)

    results: dict[str, dict[str, Any]] = {}
    for i, m in enumerate(methods, start=2):
        if not progress:
            print(f"[{i}/{n_steps}] training {m} ...", flush=True)
        results[m] = run_method(m, mds=mds, out_dir=out / m, settings=settings, seed=args.seed, progress=progress,
                                position=f"[{i}/{n_steps}]")
    from grape_stream.apps.demo_plots import plot_test_loss, plot_weights

    summary = _summary(results, settings, args.seed, corpus, mds)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    pngs = [plot_test_loss(results, out / "test_loss.png"), plot_weights(results, out / "weights.png")]

    budget = settings.steps * settings.global_batch * 256
    print("")
    print(f"Test log-perplexity per target language (nats per byte, lower is better; * = best),")
    where = ("the whole test split of each target" if settings.final_eval
             else f"a strided subset of {settings.final_samples} test samples per target")
    print(f"after {budget / 1e6:.2f}M training bytes each, on {where}:")
    print("")
    print(format_table(results))
    print("")
    for m, r in results.items():
        if r["trajectory"] and m != "uniform":
            final = r["trajectory"][-1]["alpha"]
            top = sorted(zip(r["domains"], final), key=lambda kv: -kv[1])
            print(f"  {m:<12} final alpha: " + " ".join(f"{d} {a:.2f}" for d, a in top)
                  + f"   (moved {alpha_movement(r):.2f} in total variation from uniform)")
    if "uniform" in results and len(results) > 1:
        u = results["uniform"]["final_avg"]
        for m, r in results.items():
            if m != "uniform":
                print(f"  {m:<12} average {r['final_avg'] - u:+.4f} vs uniform, worst "
                      f"{r['final_worst'] - results['uniform']['final_worst']:+.4f}")
    print("")
    print(f"Plots:   {pngs[0]}  (test loss of every target during training)")
    print(f"         {pngs[1]}  (source weights alpha and target weights z over training)")
    for m in results:
        traj_png = out / m / "grape_trajectory.png"
        if traj_png.exists() and m != "uniform":
            print(f"         {traj_png}  ({m}: alpha, z, alignments, probe losses)")
    print(f"Summary: {out / 'summary.json'}")
    print(f"Done in {(time.perf_counter() - t0) / 60:.1f} min. Try `grape-stream train {RECIPE} --print-config` to see "
          f"the recipe each run used.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
