"""The English corpus of bench/mixture_quality.py (``--corpus english``): its settings, the baseline
mixtures (CRISP, RegMix) computed once per bench and reused by every seed, the derived methods (static runs
from those weights, GRAPE started from them) and multiple-choice accuracy on the QA targets.

Sizes: GPT-2's 50,257-token head dominates a tiny CPU model's step (measured: a d=128 model, 16 x 128
tokens, 11 s/step on the shared 2-core machine), so the model is d=64, 2 layers, 64-token sequences, batch
8; the budget is stated in every output.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("code", "manuals", "encyclopedia", "dictionary", "books", "news", "faq")
TARGETS = ("trivia", "vocab", "cmdqa", "codeqa")
SEQ_LEN = 64
#: The recipe overrides that turn demo-cpu into the English benchmark's model and data.
OVERRIDES = [
    "model.vocab_size=50257", "model.n_layer=2", "model.n_head=4", "model.d_model=64", "model.d_ff=256",
    f"data.seq_len={SEQ_LEN}", f"data.domains=[{','.join(SOURCES)}]", f"data.tasks=[{','.join(TARGETS)}]",
]
#: Methods beyond the reweighting registry's: name -> (registry method, where its weights come from, option).
DERIVED = {"crisp": ("static", "crisp", "weights"), "regmix": ("static", "regmix", "weights"),
           "grape_crisp": ("grape", "crisp", "alpha0"), "grape_regmix": ("grape", "regmix", "alpha0")}
#: GRAPE with an option beyond the paper (docs/reweighting.md): bench method -> the recipe overrides it adds.
OPTIONS = {"grape_adam": ("grape", ["algorithm.geometry=adam"])}
DEFAULT_METHODS = ["uniform", "doge", "doge_pcgrad", "crisp", "regmix", "grape", "grape_crisp", "grape_regmix"]


def settings(steps: int) -> Any:
    from grape_stream.apps.demo_settings import DEMO

    return DEMO.replace(steps=steps, global_batch=8, warmup=max(steps // 10, 1), update_every=max(steps // 5, 1),
                        curve_every=max(steps // 3, 1), curve_samples=16, final_eval=False, final_samples=64,
                        probe_domain_batch=4, probe_task_batch=4, eval_batch_size=64)


def convert(corpus: Path, mds: Path) -> None:
    from grape_stream.apps.demo_corpus import ensure_converted

    ensure_converted(corpus, mds, seq_len=SEQ_LEN, progress=False, tokenizer="gpt2", domain_field="domain")


def baseline(name: str, corpus: Path, mds: Path, out: Path, *, steps: int, proxies: int, jobs: int,
             crisp_samples: int, fresh: bool) -> dict[str, Any]:
    """CRISP or RegMix weights (cached in OUT/<name>.json: computed once, cost counted once)."""
    from grape_stream.apps.mixture import crisp_from_corpus, regmix_from_proxies, run_proxies
    from grape_stream.mixture.regmix import dirichlet_mixtures

    path = out / f"{name}.json"
    want = {"steps": steps, "proxies": proxies, "crisp_samples": crisp_samples}
    if path.is_file() and not fresh:
        doc = json.loads(path.read_text())
        if doc.get("bench_key") == want:
            return doc
    if name == "crisp":
        doc = crisp_from_corpus(corpus, SOURCES, TARGETS, samples=crisp_samples, seed=0)
    else:
        t0 = time.perf_counter()
        proxy_steps = max(steps // 3, 4)
        mixes = dirichlet_mixtures(len(SOURCES), proxies, 0)
        runs = run_proxies(mixes, mds=str(mds), out=str(out / "regmix-proxies"), steps=proxy_steps, seed=0,
                           overrides=OVERRIDES, jobs=jobs)
        doc = regmix_from_proxies(SOURCES, runs, seconds=time.perf_counter() - t0)
        doc["details"]["proxy_steps"] = proxy_steps
    doc["bench_key"] = want
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"{name}: alpha {json.dumps(doc['alpha'])} ({doc['seconds']:.0f} s)", flush=True)
    return doc


def method_overrides(method: str, docs: dict[str, dict[str, Any]]) -> tuple[str, list[str]]:
    """(registry method, extra overrides) of a bench method."""
    if method in OPTIONS:
        return OPTIONS[method][0], list(OPTIONS[method][1])
    if method not in DERIVED:
        return method, []
    base, source, option = DERIVED[method]
    vec = "[" + ",".join(repr(x) for x in docs[source]["weights"]) + "]"
    return base, [f"algorithm.options.{option}={vec}"]


def choice_items(corpus: Path, n: int) -> dict[str, list[dict[str, Any]]]:
    """A fixed strided subset of each target's test items (the same for every run)."""
    from grape_stream.apps.demo_callbacks import strided_indices
    from grape_stream.mixture.texts import read_docs

    out = {}
    for t in TARGETS:
        docs = read_docs(corpus, "test", t)
        out[t] = [docs[i] for i in strided_indices(len(docs), n)]
    return out


def scorer(items: dict[str, list[dict[str, Any]]]) -> Any:
    from grape_stream.apps.choice_callback import ChoiceAccuracy
    from grape_stream.convert.tokenization import load_tokenizer

    tok = load_tokenizer("gpt2")
    return ChoiceAccuracy(items, lambda s: [int(i) for i in tok.encode_batch([s])[0]], max_len=SEQ_LEN)


def accuracy_summary(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    n = len(scores)
    return {k: sum(s[k] for s in scores.values()) / n for k in ("acc", "acc_norm")}


def cost_seconds(method: str, run_seconds: float, docs: dict[str, dict[str, Any]]) -> float:
    """Wall time of the method: its run plus the one-time CRISP embeddings / RegMix proxies it used."""
    return run_seconds + (docs[DERIVED[method][1]]["seconds"] if method in DERIVED else 0.0)


def methods_list(arg: str | None, registry: Sequence[str]) -> list[str]:
    ms = [m for m in (arg.split(",") if arg else DEFAULT_METHODS) if m]
    bad = [m for m in ms if m not in registry and m not in DERIVED and m not in OPTIONS]
    if bad:
        raise SystemExit(f"unknown methods {bad}; choose from {list(registry) + list(DERIVED) + list(OPTIONS)}")
    return ms
