"""One demo run on the product path: the ``demo-cpu`` recipe plus a few overrides, built into a Composer
Trainer with GrapeAlgorithm, watched by the demo's callbacks. ``bench/mixture_quality.py`` drives the same
runner (:func:`run_method`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from grape_stream.apps.demo_callbacks import Progress, TestCurve
from grape_stream.apps.demo_settings import DEMO, DemoSettings
from grape_stream.integrations.composer.trainer import build
from grape_stream.recipe import as_recipe, load_recipe
from grape_stream.streaming_compat.local_index import release_streaming_dataset

__all__ = ["RECIPE", "RUN_ONLY_KEYS", "recipe_overrides", "reproduce_command", "run_method"]

RECIPE = "demo-cpu"
#: Recipe keys the demo sets that change where a run writes and what it prints, never what it trains: the
#: command that reproduces a demo run leaves them at the recipe's values (its own folder, checkpoints, console).
RUN_ONLY_KEYS = frozenset({
    "output_dir", "algorithm.summary", "trainer.save_folder", "trainer.save_interval", "trainer.autoresume",
    "trainer.log_to_console", "trainer.progress_bar", "trainer.log_interval", "trainer.eval_interval",
})


def recipe_overrides(method: str, settings: DemoSettings, *, mds: str | os.PathLike[str],
                     out_dir: str | os.PathLike[str], seed: int, extra: Sequence[str] = ()) -> list[str]:
    """The ``key=value`` overrides that turn the ``demo-cpu`` recipe into one demo/bench run."""
    s = settings
    return [
        *s.model_data,
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
        "algorithm.summary=false",  # the demo prints one table comparing the methods, not one per run
        *([f"algorithm.mu_alpha={s.mu_alpha}", f"algorithm.mu_z={s.mu_z}", "algorithm.options.step_size=lr_over_mu"]
          if s.mu_alpha is not None else []),
        f"algorithm.options.clip_norm={'null' if s.clip_norm is None else s.clip_norm}",
        f"optimizer.lr={s.lr}",
        f"scheduler.t_warmup={s.warmup}ba",
        f"trainer.max_duration={s.steps}ba",
        f"trainer.global_train_batch_size={s.global_batch}",
        # (data.task_test_split is read by the final evaluation and by the demo's test curve alike)
        # the final evaluation only; the curve comes from _TestCurve (cheaper, same test split)
        f"trainer.eval_interval={s.steps if s.final_eval else 0}ba",  # 0: never (Composer)
        "trainer.save_folder=null",
        "trainer.autoresume=false",
        "trainer.log_to_console=false",
        "trainer.progress_bar=false",
        *extra,
    ]


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _yaml_value(v: Any) -> str:
    """An override's value as the YAML the dotlist parses back to ``v`` (flow style, one line)."""
    from enum import Enum

    import yaml

    if isinstance(v, Enum):  # a choice setting (config.choices): its word
        v = v.value
    return yaml.safe_dump(v, default_flow_style=True, width=1 << 16).strip().removesuffix("\n...").strip()


def reproduce_command(overrides: Sequence[str]) -> str:
    """The ``grape-stream train`` command that trains what a demo run with ``overrides`` trained: the recipe plus
    the keys whose resolved value differs from the recipe's (less :data:`RUN_ONLY_KEYS`), shell-quoted.

    Why computed, not listed: the demo's overrides repeat most of the recipe's values; the command a user copies
    should say what differs (nothing for the default GRAPE run but its folder's name)."""
    import shlex

    base = _flat(load_recipe(RECIPE))
    run = _flat(load_recipe(RECIPE, list(overrides)))
    diff = [f"{k}={_yaml_value(v)}" for k, v in run.items()
            if k not in RUN_ONLY_KEYS and (k not in base or base[k] != v)]
    return " ".join(["grape-stream", "train", RECIPE, *(shlex.quote(x) for x in diff)])


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Composer and streaming talk a lot for a demo; keep warnings and errors, drop the chatter."""
    noisy = ["composer", "streaming", "grape_stream.integrations.composer.trainer", "grape_stream.recipe",
             "torch.distributed"]
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
               extra_overrides: Sequence[str] = (), extra_callbacks: Sequence[Any] = (),
               reuse: bool = False, bar_line: int | None = None) -> dict[str, Any]:
    """Train one method with the ``demo-cpu`` recipe and return its result (also written to
    ``out_dir/result.json``): final per-target test log-perplexity (nats per token = per byte), the
    test-loss curve, the alpha/z trajectory and timings. ``extra_callbacks``: more Composer callbacks (the
    benchmark's multiple-choice scorer reads the trained model at fit end). ``reuse``: return the result
    already in ``out_dir`` when it was trained with exactly these overrides (runs are deterministic, so a
    benchmark killed halfway resumes its search instead of retraining finished runs). ``bar_line``: the
    progress bar's terminal line when several runs share the terminal (:func:`run_methods`)."""
    out_dir = Path(out_dir)
    if reuse and not extra_callbacks:
        done = finished_result(out_dir, recipe_overrides(method, settings, mds=mds, out_dir=out_dir, seed=seed,
                                                   extra=extra_overrides))
        if done is not None:
            return done
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a fresh run: metrics.jsonl appends, the trajectory must not mix runs
    out_dir.mkdir(parents=True)
    overrides = recipe_overrides(method, settings, mds=mds, out_dir=out_dir, seed=seed, extra=extra_overrides)
    cfg = load_recipe(RECIPE, overrides)
    t0 = time.perf_counter()
    with _quiet():
        curve = TestCurve(settings)
        bar = Progress(curve, method, progress=progress, position=position, line=bar_line)
        built = build(cfg, extra_callbacks=[curve, bar, *extra_callbacks], progress=progress)
        try:
            curve.prepare(built.tasks)
            built.trainer.fit()
            ctl = getattr(built.algorithm, "controller", None)
            history = list(ctl.history) if ctl is not None else []
            domains = list(ctl.domain_names) if ctl is not None else [d["name"] for d in built.domains]
        finally:
            _release(built)
    seconds = time.perf_counter() - t0
    result = _result(method, seed, settings, cfg, overrides, built, curve, bar, history, domains, seconds)
    with open(out_dir / "result.json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return result


def _one_thread_each(threads: int) -> None:
    """A run process's torch threads (the cores shared out between the concurrent runs)."""
    import torch

    torch.set_num_threads(threads)


def run_methods(methods: Sequence[str], *, jobs: int, out: Path, labels: Sequence[str],
                **common: Any) -> dict[str, dict[str, Any]]:
    """:func:`run_method` for each method (``out/<method>``), ``jobs`` at a time in their own processes.

    Why processes: the demo's model is small, so one torch thread per run on each core beats two threads on one
    run at a time (the value benchmark ran uniform and GRAPE side by side, 457 and 545 s on one thread each).
    Each run is the same deterministic function of its settings either way; only float summation order (the
    thread count) differs."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    if jobs <= 1 or len(methods) <= 1:
        return {m: run_method(m, out_dir=out / m, position=label, **common) for m, label in zip(methods, labels)}
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_one_thread_each, initargs=(threads,)) as pool:
        futures = {m: pool.submit(run_method, m, out_dir=out / m, position=label, bar_line=i % jobs, **common)
                   for i, (m, label) in enumerate(zip(methods, labels))}
        return {m: f.result() for m, f in futures.items()}


def finished_result(out_dir: str | os.PathLike[str], overrides: Sequence[str]) -> dict[str, Any] | None:
    """The result in ``out_dir`` if it was written by a run with exactly ``overrides``."""
    try:
        prev = json.loads((Path(out_dir) / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return prev if isinstance(prev, dict) and prev.get("overrides") == list(overrides) else None


def _result(method: str, seed: int, settings: DemoSettings, cfg: Mapping[str, Any], overrides: list[str], built: Any,
            curve: TestCurve, bar: Progress, history: list[dict[str, Any]], domains: list[str],
            seconds: float) -> dict[str, Any]:
    """What one run reports (result.json): final losses, the test-loss curve, the trajectory, timings."""
    seq_len = int(as_recipe(cfg).data.seq_len or 256)
    tokens_per_step = settings.global_batch * seq_len
    tasks = [t.name for t in built.tasks]
    final = curve.final or {n: curve.loss[n][-1] for n in tasks}
    traj = [{"step": int(r["step"]), "alpha": r["alpha"], "z": r.get("z")} for r in history]
    probe_seconds = sum(float((r.get("seconds") or {}).get("total", 0.0)) for r in history)
    return {
        "method": method,
        "seed": seed,
        "settings": dataclasses.asdict(settings),
        "recipe": RECIPE,
        "overrides": overrides,
        "command": reproduce_command(overrides),
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
        "seconds": {"total": seconds, "curve_eval": curve.eval_seconds, "reweighting": probe_seconds,
                    "prior": float(built.prior["seconds"]) if built.prior else 0.0},
        # alpha0: crisp's weights and how they were computed (its seconds are in "seconds" above)
        **({"prior": {k: built.prior[k] for k in ("prior", "alpha", "details")}} if built.prior else {}),
    }
