"""Benchmark (issue #25): does adaptive mixing pay, in a setting where the mixture matters and the best static
mixture is known?

The setting (``docs/results.md`` says why each choice was made):
- **Corpus**: the bundled multilingual corpus (``data/demo``), all 13 languages as source domains: six
  high-resource ones (en fr de es ru it, ~0.9M tokens each) and the *small* training splits of the seven
  low-resource targets (tr da ca pl nl uk pt, 110-160k tokens each), i.e. a pool where most text is
  irrelevant to the targets and a little is very relevant, as in real multilingual pretraining.
- **Targets**: the seven low-resource languages; GRAPE, RegMix and the oracle search see only their
  ``probe`` split, every reported figure is on their ``test`` split (held-out pages).
- **Tokenizer**: a 4,096-id byte-level BPE trained on the 13 source training splits
  (``grape-stream train-tokenizer``), so the head is small and every language gets multi-character tokens.
- **Model and budget**: our GPT, 4 layers, d=128, 4 heads (1.3M parameters), 128-token sequences, batch 32,
  400 steps = 1.64M training tokens per run (107x benchmark 2's), AdamW lr 1e-3 (at 2e-3 uniform's seed-to-
  seed spread was 5-10x larger), 10% warm-up, cosine to 0.1.
- **Oracle (best static mixture)**: RegMix-style search on the *probe* split: ``--proxies`` Dirichlet mixtures
  trained for a quarter of the budget, a LightGBM regressor, its predicted argmin; then the candidates
  (uniform, the regressor's argmin, CRISP's weights, the best proxies' mixtures) trained at the full budget
  (seed 0) and scored on the probe split; the best becomes ``oracle``.

Every run is the product path (``grape-stream convert`` shards -> recipe -> Composer Trainer with
``GrapeAlgorithm``) through :func:`grape_stream.apps.demo_run.run_method`, each run in a fresh process of its own
(so its ``peak_rss_mb``, the process's ``ru_maxrss``, is that run's). Runs already finished with identical
settings are reused (``--fresh`` redoes them), so an interrupted bench continues where it stopped;
``bench/results/value.json`` is rewritten after every run, with a ``claims`` object computed from the runs.

    .venv/bin/python bench/value.py                          # search + every method x 3 seeds (hours on 2 cores)
    .venv/bin/python bench/value.py --stage search           # the oracle search only
    .venv/bin/python bench/value.py --methods uniform,oracle,grape --seeds 0,1,2
    .venv/bin/python bench/value.py --quick                  # smoke run: tiny budget, 1 seed, 2 methods

**A second benchmark of another kind** (issue 32 part 5, ``--setting english``): the same BPE size, model,
budget, search and table, on the bundled English corpus (``data/english``): seven English sources that differ in
topic and style (code, man pages, a computing encyclopedia, a dictionary, novels, news, a FAQ) against four
question-answering *task* targets (trivia, vocabulary glosses, what a command does, what a function does), each
with its probe / test split; its BPE is trained on those seven sources. Results go to
``bench/results/value_english.json`` and the ``value-table-english`` block of docs/results.md.

    .venv/bin/python bench/value.py --setting english --runs uniform:0,grape:0,...
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

# the setting is the demo's (one definition: grape_stream/apps/demo_pool.py)
from grape_stream.apps.demo_pool import (
    BATCH,
    LR,
    MODEL,
    SEQ_LEN,
    SOURCES,
    STEPS,
    TARGETS,
    VOCAB,
    data_overrides,
    pool_settings,
    update_interval,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from common import peak_rss_mb, write_json  # noqa: E402
from mixture_english import SOURCES as ENGLISH_SOURCES  # noqa: E402
from mixture_english import TARGETS as ENGLISH_TARGETS  # noqa: E402
from value_report import REUSE, aggregate, claims, split_by_version, table  # noqa: E402

RESULTS = REPO / "bench" / "results" / "value.json"


class Setting(NamedTuple):
    """One benchmark this script runs: its corpus and roles, where its runs and results go. Model, tokenizer size,
    budget, search and methods are the same for every setting, so two settings' tables read alike. (A NamedTuple,
    not a dataclass: the tests load this script by path, outside ``sys.modules``, where a dataclass with string
    annotations cannot be built.)"""

    name: str
    data: Path
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    domain_field: str  # the corpus' field naming a document's domain
    results: Path
    out: Path
    docs_block: str  # docs/results.md's block the table is written into: <!-- {docs_block}:begin -->

    @property
    def data_overrides(self) -> list[str]:
        return data_overrides(self.sources, self.targets)


SETTINGS = {
    # the demo's pool: 13 languages, the seven low-resource ones as targets (grape_stream/apps/demo_pool.py)
    "languages": Setting("languages", REPO / "data" / "demo", SOURCES, TARGETS, "lang", RESULTS,
                         REPO / "runs" / "bench_value", "value-table"),
    # issue 32 part 5: English topic / style sources against task targets (data/english/README.md)
    "english": Setting("english", REPO / "data" / "english", ENGLISH_SOURCES, ENGLISH_TARGETS, "domain",
                       RESULTS.with_name("value_english.json"), REPO / "runs" / "bench_value_english",
                       "value-table-english"),
}

_RUN: dict[str, Any] = {"steps": STEPS, "out": REPO / "runs" / "bench_value",  # this invocation's (main sets it)
                        "setting": SETTINGS["languages"]}


def _setting() -> Setting:
    """This invocation's benchmark (``--setting``)."""
    return _RUN["setting"]  # type: ignore[no-any-return]


def _reference_dir(seed: int) -> Path:
    """Where ``uniform_reference`` at ``seed`` saves its checkpoints (DoReMi reads the last one)."""
    return Path(_RUN["out"]) / f"uniform_reference-seed{seed}" / "checkpoints"


def _reference_checkpoint() -> Path:
    """DoReMi's reference model: ``uniform_reference`` seed 0's last checkpoint (run it first)."""
    path = _reference_dir(0) / f"ep0-ba{_RUN['steps']}-rank0.pt"
    if not path.is_file():
        raise SystemExit(f"doremi needs its reference model {path}: run --methods uniform_reference --seeds 0 first")
    return path


def _doremi_average(runs: Mapping[str, Mapping[int, Mapping[str, Any]]], seed: int) -> list[float]:
    """The average alpha of the DoReMi proxy run at ``seed`` (the paper's output for the final run)."""
    from grape_stream.grape.reweighting import average_alpha_from_trajectory

    if seed not in runs.get("doremi", {}):
        raise SystemExit(f"doremi_final_static needs the doremi run of seed {seed} first")
    return average_alpha_from_trajectory(_trajectory_file(runs["doremi"][seed]))


def _trajectory_file(run: Mapping[str, Any]) -> Path:
    """A finished run's alpha(t), as its run wrote it (one line an update)."""
    return Path(run["run_dir"]) / "grape_trajectory.jsonl"


def _every() -> int:
    """:func:`update_interval` at this invocation's budget (the method lambdas do not see it)."""
    return update_interval(_RUN["steps"])


def settings(steps: int) -> Any:
    """The demo's runner at this benchmark's size (:func:`grape_stream.apps.demo_pool.pool_settings`)."""
    return pool_settings(steps)


def _vec(xs: Sequence[float]) -> str:
    """Weights as a recipe list, rounded to 1e-8 with the last one absorbing the rounding (sums to 1)."""
    total = float(sum(xs))
    w = [round(float(x) / total, 8) for x in xs]
    w[-1] = round(1.0 - sum(w[:-1]), 8)
    return "[" + ",".join(repr(x) for x in w) + "]"


# ----------------------------------------------------------------------------- methods

def _paper_step(lr: float) -> list[str]:
    """The paper's update at its published step sizes: eta_alpha = 1.5, eta_z = 10 at peak lr (mu = lr / eta)."""
    return ["algorithm.options.step_size=lr_over_mu", f"algorithm.mu_alpha={lr / 1.5!r}", f"algorithm.mu_z={lr / 10!r}",
            "algorithm.options.clip_norm=null"]


def _demo_step(lr: float) -> list[str]:
    """The demo's hand-tuned update (tuned on the byte-level demo, docs/results.md): eta 10, clip_norm 1."""
    return ["algorithm.options.step_size=lr_over_mu", f"algorithm.mu_alpha={lr / 10!r}", f"algorithm.mu_z={lr / 10!r}",
            "algorithm.options.clip_norm=1.0"]


def _candidate(name: str) -> Callable[..., list[str]]:
    """The overrides of the search candidate ``name`` scored as the search scores it (on the probe split)."""
    return lambda lr, d, s, r: [f"algorithm.options.weights={_vec(_cand_weights(d, name))}", *CANDIDATE_SPLITS]


#: issue 32 part 2's GRAPE variants: a trust region that moves the full KL at every update however far the lr has
#: decayed (a target z recognises late still gets its step), alone and with the Gram averaged across updates; a
#: 4x task probe
PART2 = {"grape": (), "grape_klconst": ("algorithm.options.kl_schedule=constant",),
         "grape_klconst_ema": ("algorithm.options.kl_schedule=constant", "algorithm.options.gram_ema=0.5"),
         # against the noise directly: 4x the task side of each probe (32 samples a target), its cost counted
         "grape_probe32": ("algorithm.probe_task_batch=32",)}
#: A GRAPE variant fitted on one half of the targets' probe split and scored on the other: the choice among
#: variants sees nothing of the test split (swapping the splits, as the static candidates do, would feed it to GRAPE).
SELECTION_HALVES = ("probe_fit", "probe_score")
SELECTION_SPLITS = [f"data.task_probe_split={SELECTION_HALVES[0]}", f"data.task_test_split={SELECTION_HALVES[1]}"]
#: bench method -> (registry method, overrides(lr, docs, seed, runs) -> list). ``docs``: the search's documents.
METHODS: dict[str, tuple[str, Callable[..., list[str]]]] = {
    "uniform": ("uniform", lambda lr, d, s, r: []),
    "oracle": ("static", lambda lr, d, s, r: [f"algorithm.options.weights={_vec(d['oracle']['weights'])}"]),
    "regmix": ("static", lambda lr, d, s, r: [f"algorithm.options.weights={_vec(d['regmix']['weights'])}"]),
    "crisp": ("static", lambda lr, d, s, r: [f"algorithm.options.weights={_vec(d['crisp']['weights'])}"]),
    # uniform again, saving its final checkpoint: DoReMi's reference model (the paper's step 1)
    "uniform_reference": ("uniform", lambda lr, d, s, r: [f"trainer.save_folder={_reference_dir(s)}",
                                                          f"trainer.save_interval={_RUN['steps']}ba"]),
    "grape": ("grape", lambda lr, d, s, r: []),  # the library's defaults, untouched
    "grape_paper": ("grape", lambda lr, d, s, r: _paper_step(lr)),
    "grape_demo_tuned": ("grape", lambda lr, d, s, r: _demo_step(lr)),
    "grape_adam": ("grape", lambda lr, d, s, r: ["algorithm.geometry=adam"]),
    # in-step alignments: the domain side from every training step of the update's interval (25 steps x
    # 32 samples, ~60 per domain) instead of one 8-sample probe per domain
    "grape_steps": ("grape", lambda lr, d, s, r: ["algorithm.alignments=steps",
                                                  f"algorithm.alignment_steps={_every()}"]),
    "grape_ema": ("grape_ema", lambda lr, d, s, r: []),
    "grape_gap": ("grape_gap", lambda lr, d, s, r: []),
    "doge": ("doge", lambda lr, d, s, r: []),
    "doge_paper": ("doge", lambda lr, d, s, r: _paper_step(lr)),
    # the other online methods (issue 24), each at its defaults except where a default is sized for 10^4+ steps
    "rnb": ("rnb", lambda lr, d, s, r: []),  # R&B's Balance, the library's defaults (4 observed steps a round)
    "odm": ("odm", lambda lr, d, s, r: ["algorithm.alpha_every=1"]),  # the paper's bandit step: every step
    # ADO's defaults are the authors' Pile run (warm-up and refit every 1,000 steps): scaled to a 400-step run
    "ado": ("ado", lambda lr, d, s, r: ["algorithm.alpha_every=1", "algorithm.options.warmup_steps=60",
                                        "algorithm.options.fit_every=10", "algorithm.options.ignore_steps=20"]),
    # DoReMi: the proxy run against uniform_reference seed 0's final checkpoint (one reference, as in the paper),
    # then the paper's final run: a static mixture at the proxy's average alpha (same seed)
    "doremi": ("doremi", lambda lr, d, s, r: ["algorithm.alpha_every=1",
                                              f"algorithm.options.reference={_reference_checkpoint()}"]),
    "doremi_final_static": ("static", lambda lr, d, s, r: [f"algorithm.options.weights={_vec(_doremi_average(r, s))}"]),
    # reuse: a previous GRAPE run (the seed before, cyclically) replayed from step 0, or its final weights
    "grape_replay": ("schedule", lambda lr, d, s, r: [
        f"algorithm.schedule_path={_trajectory_file(_source_runs('grape_replay', s, r)[0])}"]),
    "grape_final_static": ("static", lambda lr, d, s, r: [
        f"algorithm.options.weights={_vec(_final_mean(_source_runs('grape_final_static', s, r)))}"]),
    # reuse from several source runs: the mean of every other finished GRAPE run's final weights, as a static mixture
    "grape_final_mean": ("static", lambda lr, d, s, r: [
        f"algorithm.options.weights={_vec(_final_mean(_source_runs('grape_final_mean', s, r)))}"]),
    # GRAPE started from a static prior (issue 32 part 3: the paper's GRAPE-ClimbMix analog), against that prior alone
    "grape_crisp": ("grape", lambda lr, d, s, r: [f"algorithm.options.alpha0={_vec(d['crisp']['weights'])}"]),
    "grape_regmix": ("grape", lambda lr, d, s, r: [f"algorithm.options.alpha0={_vec(d['regmix']['weights'])}"]),
    # the prior as a first-class start: CRISP computed in the run's own set-up from its shards (recipe/prior.py),
    # its seconds counted in the run's compute
    # (data.tokenizer: the prior decodes with the tokenizer the recipe names; the rows in bench/results/ ran before
    # the key existed, when the manifest's path was read: the same file)
    "grape_crisp_prior": ("grape", lambda lr, d, s, r: ["algorithm.options.alpha0=crisp",
                                                         f"data.tokenizer={Path(_RUN['out']) / 'tokenizer.json'}"]),
    # issue 32 part 2's variants, and the choice among them and the default made on the probe split's two halves
    # (sel_*: the test split unseen)
    **{m: ("grape", lambda lr, d, s, r, o=o: list(o)) for m, o in PART2.items() if m != "grape"},
    **{f"sel_{m}": ("grape", lambda lr, d, s, r, o=o: [*o, *SELECTION_SPLITS]) for m, o in PART2.items()},
    # the oracle search's candidates re-scored on this library version (probe split, as the search scores them)
    **{f"cand_{c}": ("static", _candidate(c)) for c in ("uniform", "regmix", "crisp")},
    # uniform trained under its own shorter schedule (warm-up, cosine, curve points all scaled to the budget):
    # the reference for "compute to uniform's final" (issue 32 part 4)
    **{f"uniform_s{n}": ("uniform", lambda lr, d, s, r: []) for n in (200, 260, 320)},
}
#: Scored on the probe split (the split the search may use), tested on nothing else.
CANDIDATE_SPLITS = ["data.task_test_split=probe", "data.task_probe_split=test"]
#: Methods trained at a budget of their own (``uniform_s200`` -> 200 steps), not the invocation's ``--steps``.
SHORT = {m: int(m.rsplit("_s", 1)[1]) for m in METHODS if m.startswith("uniform_s")}
#: Methods whose weights come from the search (the others run before it has finished).
NEEDS_SEARCH = {"oracle", "regmix", "crisp", "cand_uniform", "cand_regmix", "cand_crisp"}
DEFAULT_METHODS = ["uniform", "oracle", "grape", "grape_paper", "grape_demo_tuned", "doge", "regmix", "crisp",
                   "grape_adam", "grape_ema", "grape_replay", "grape_final_static"]


def _cand_weights(docs: Mapping[str, Any], name: str) -> list[float]:
    """A search candidate's weights: uniform, or the search document's RegMix argmin / CRISP weights."""
    k = len(_setting().sources)
    return [1.0 / k] * k if name == "uniform" else list(docs[name]["weights"])


def _reuse_sources(method: str, seed: int, runs: Mapping[str, Mapping[int, Any]]) -> dict[str, Any] | None:
    """The source runs a reuse method's run at ``seed`` is built from (:data:`REUSE`; their compute is its
    cost): ``{"method", "seeds"}``; None for a method that reuses nothing. 'previous' is the seed before among
    the finished ones, cyclically ('last week's run')."""
    if method not in REUSE:
        return None
    source, which = REUSE[method]
    have = sorted(runs.get(source, {}))
    if which == "same":
        seeds = [seed]
    elif which == "others":
        seeds = [s for s in have if s != seed]
    else:
        seeds = [s for s in have if s < seed][-1:] or have[-1:]
    need = 2 if which == "others" else 1
    if len([s for s in seeds if s in have]) < need:
        raise SystemExit(f"{method} needs {need} finished {source} run(s) first (run --methods {source})")
    return {"method": source, "seeds": seeds}


def _source_runs(method: str, seed: int, runs: Mapping[str, Mapping[int, Mapping[str, Any]]]
                 ) -> list[Mapping[str, Any]]:
    """The finished runs :func:`_reuse_sources` names for ``method`` at ``seed``."""
    src = _reuse_sources(method, seed, runs)
    assert src is not None, method
    return [runs[src["method"]][s] for s in src["seeds"]]


def _final_mean(sources: Sequence[Mapping[str, Any]]) -> list[float]:
    """The mean of these runs' final weights (one run: its own)."""
    finals = [r["trajectory"][-1]["alpha"] for r in sources]
    return [sum(float(a[i]) for a in finals) / len(finals) for i in range(len(finals[0]))]


# ----------------------------------------------------------------------------- data

def prepare(out: Path, corpus: Path) -> Path:
    """Train the BPE (once) and convert the corpus with it; returns the MDS directory. The corpus converted is
    the bundled one plus each target's probe split cut in two (:func:`selection_corpus`)."""
    from grape_stream.apps.demo_pool import prepare as prepare_pool

    st = _setting()
    return prepare_pool(out, selection_corpus(corpus, out / "corpus"), sources=st.sources,
                        domain_field=st.domain_field)[0]


def selection_corpus(corpus: Path, dest: Path) -> Path:
    """``corpus`` (its files linked, not copied) plus ``probe_fit`` / ``probe_score``: each target's probe
    documents dealt alternately into two halves. A choice among GRAPE variants (``sel_*``) takes its target
    gradients from one half and is scored on the other, so it sees neither the test split nor its own
    gradients' text (the recipe refuses a probe split scored as the test split)."""
    import zstandard

    for f in sorted(corpus.glob("*/*.jsonl.zst")):
        link = dest / f.relative_to(corpus)
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(f.resolve())
    for t in _setting().targets:
        halves = [dest / split / f"{t}.jsonl.zst" for split in SELECTION_HALVES]
        if all(h.is_file() for h in halves):
            continue
        with open(corpus / "probe" / f"{t}.jsonl.zst", "rb") as f:  # a stream: frames need not state their size
            docs = zstandard.ZstdDecompressor().stream_reader(f).read().decode().splitlines()
        for k, (half, split) in enumerate(zip(halves, SELECTION_HALVES)):
            lines = [json.dumps({**json.loads(d), "split": split}, ensure_ascii=False) for d in docs[k::2] if d]
            half.parent.mkdir(parents=True, exist_ok=True)
            tmp = half.with_suffix(".tmp")
            tmp.write_bytes(zstandard.ZstdCompressor(level=3).compress(("\n".join(lines) + "\n").encode()))
            tmp.replace(half)
    return dest


# ----------------------------------------------------------------------------- oracle search

def _search_key(proxies: int, steps: int, candidates: int, mds: Path) -> dict[str, Any]:
    """What identifies a search on disk (a search with other settings is redone)."""
    return {"proxies": proxies, "steps": steps, "candidates": candidates, "mds": mds.name, "crisp_candidate": True}


def search(out: Path, mds: Path, corpus: Path, *, proxies: int, steps: int, candidates: int,
           fresh: bool) -> dict[str, Any]:
    """RegMix proxies + full-budget candidates, all on the probe split (seed 0); also CRISP's weights."""
    from grape_stream.apps.demo_run import run_method
    from grape_stream.apps.mixture import crisp_from_corpus, regmix_from_proxies, run_proxies, weights_document
    from grape_stream.mixture.regmix import dirichlet_mixtures

    path = out / "search.json"
    key = _search_key(proxies, steps, candidates, mds)
    if path.is_file() and not fresh:
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            return doc
    st = _setting()
    overrides = [*MODEL, *st.data_overrides, f"optimizer.lr={LR}"]
    t0 = time.perf_counter()
    proxy_steps = max(steps // 4, 4)
    mixes = dirichlet_mixtures(len(st.sources), proxies, 0)
    runs = run_proxies(mixes, mds=str(mds), out=str(out / "proxies"), steps=proxy_steps, seed=0, overrides=overrides)
    regmix = regmix_from_proxies(st.sources, runs, seconds=time.perf_counter() - t0)
    regmix["details"]["proxy_steps"] = proxy_steps
    print(f"regmix: {json.dumps(regmix['alpha'])} ({regmix['seconds']:.0f} s)", flush=True)
    ranked = sorted(runs, key=lambda r: r["loss"])
    crisp = crisp_from_corpus(corpus, st.sources, st.targets, samples=64, seed=0)
    # every static answer we can compute is a candidate for the best static mixture (scored on probe text)
    cands = [("uniform", _cand_weights({}, "uniform")), ("regmix", regmix["weights"]),
             ("crisp", crisp["weights"])]
    cands += [(f"proxy{i}", list(r["mixture"])) for i, r in enumerate(ranked[:candidates])]
    scored = []
    for name, w in cands:
        res = run_method("static", mds=mds, out_dir=out / "candidates" / name, settings=settings(steps), seed=0,
                         progress=False, reuse=not fresh,
                         extra_overrides=[*overrides, f"algorithm.options.weights={_vec(w)}",
                                          "data.task_test_split=probe", "data.task_probe_split=test"])
        scored.append({"name": name, "weights": w, "probe_avg": res["final_avg"], "probe_worst": res["final_worst"],
                       "probe": res["final"], "seconds": res["seconds"]["total"]})
        print(f"candidate {name}: probe avg {res['final_avg']:.4f} worst {res['final_worst']:.4f}", flush=True)
    best = min(scored, key=lambda c: c["probe_avg"])
    oracle = weights_document("oracle", st.sources, best["weights"], time.perf_counter() - t0,
                              {"chosen": best["name"], "criterion": "probe-split average at the full budget, seed 0",
                               "candidates": scored})
    doc = {"key": key, "regmix": regmix, "oracle": oracle, "crisp": crisp,
           "settings": {"proxy_steps": proxy_steps, "proxy_seed": 0, "candidate_seed": 0, "regressor": "lightgbm",
                        "crisp_samples": 64, "criterion": "probe-split average at the full budget, seed 0",
                        "code": dict(_CODE)}}
    path.write_text(json.dumps(doc, indent=1))
    return doc


# ----------------------------------------------------------------------------- provenance

def code_version() -> dict[str, Any]:
    """What this process runs: the commit, whether the library or the bench scripts differ from it, and the
    git tree hash of ``grape_stream/`` (the library version a table row is grouped by: a later commit that
    touches only docs or the report keeps it). Read once at start: the modules are imported then."""
    import subprocess

    import torch

    from grape_stream import __version__

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=60,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "unknown"

    lib = git("status", "--porcelain", "--untracked-files=no", "--", "grape_stream", "pyproject.toml")
    bench = git("status", "--porcelain", "--untracked-files=no", "--", "bench/value.py", "bench/value_report.py")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if "unknown" in (lib, bench) else bool(lib or bench),
            "library_tree": git("rev-parse", "HEAD:grape_stream") + ("+dirty" if lib and lib != "unknown" else ""),
            "library_version": __version__, "torch": torch.__version__}


_CODE: dict[str, Any] = {}  # main fills it: code_version() at the start of this process


def search_from(path: Path, out: Path, key: Mapping[str, Any]) -> None:
    """``--search-from``: take the oracle search of an earlier run (a JSON holding ``regmix``, ``crisp``,
    ``oracle`` documents, their settings and candidate scores) as this run's, without retraining its proxies.
    Its figures keep the provenance the file states; ``cand_*`` runs re-score its candidates on this version."""
    doc = json.loads(path.read_text())
    (out / "search.json").write_text(json.dumps({**doc, "key": dict(key)}, indent=1))


# ----------------------------------------------------------------------------- main

def _plan(method: str, seed: int, steps: int, mds: Path, out: Path, docs: Mapping[str, Any],
          runs: Mapping[str, Mapping[int, Mapping[str, Any]]], extra: Sequence[str]) -> dict[str, Any]:
    """What one run of ``method`` at ``seed`` is: registry method, directory, settings, overrides."""
    from grape_stream.apps.demo_run import recipe_overrides

    base, make = METHODS[method]
    s = settings(SHORT.get(method, steps))
    extra_o = [*MODEL, *_setting().data_overrides, *make(LR, docs, seed, runs), *extra]
    run_dir = out / f"{method}-seed{seed}"
    return {"base": base, "settings": s, "extra": extra_o, "run_dir": run_dir,
            "want": recipe_overrides(base, s, mds=mds, out_dir=run_dir, seed=seed, extra=extra_o)}


def _run(method: str, seed: int, steps: int, mds: Path, out: Path, docs: Mapping[str, Any],
         runs: Mapping[str, Mapping[int, Mapping[str, Any]]], fresh: bool, extra: Sequence[str]) -> dict[str, Any]:
    """One run of ``method`` at ``seed`` (trained, or read back when finished with the same settings), with the
    source runs it reused when it is a reuse method (``reuse_sources``: their compute is its cost)."""
    res = _train_or_read(method, seed, steps, mds, out, docs, runs, fresh, extra)
    sources = _reuse_sources(method, seed, runs)
    return res if sources is None else {**res, "reuse_sources": sources}


def _train_or_read(method: str, seed: int, steps: int, mds: Path, out: Path, docs: Mapping[str, Any],
                   runs: Mapping[str, Mapping[int, Mapping[str, Any]]], fresh: bool, extra: Sequence[str]
                   ) -> dict[str, Any]:
    from grape_stream.apps.demo_run import finished_result

    plan = _plan(method, seed, steps, mds, out, docs, runs, extra)
    run_dir, want = plan["run_dir"], plan["want"]
    res_path = run_dir / "result.json"
    if not fresh:
        done = finished_result(run_dir, want)
        if done is not None:
            return done
    twin = None if fresh else _twin(out, run_dir, want)
    if twin is not None:  # e.g. the oracle search chose RegMix's weights: the same run under another name
        res = {**twin, "method": method, "run_dir": str(run_dir), "overrides": want, "same_run_as": twin["run_dir"]}
        run_dir.mkdir(parents=True, exist_ok=True)
        res_path.write_text(json.dumps(res, indent=1))
        print(f"{method} seed {seed}: the same run as {twin['run_dir']}", flush=True)
        return res
    t0 = time.perf_counter()
    # each run in a fresh process: its peak RSS is this run's, not the high-water mark of the runs before it
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        res, peak = pool.submit(_train, plan["base"], mds, run_dir, plan["settings"], seed, plan["extra"]).result()
    res["method"], res["run_dir"], res["code"] = method, str(run_dir), dict(_CODE)
    res["peak_rss_mb"] = peak
    res_path.write_text(json.dumps(res, indent=1))
    print(f"{method} seed {seed}: avg {res['final_avg']:.4f} worst {res['final_worst']:.4f} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return res


def _train(base: str, mds: Path, run_dir: Path, settings: Any, seed: int, extra: Sequence[str]
           ) -> tuple[dict[str, Any], float]:
    """One run, in the fresh process :func:`_run` starts for it: (its result, the process's peak RSS in MB,
    ``ru_maxrss``: imports, training and the final evaluation). One torch thread, as the benchmark's process."""
    import torch

    from grape_stream.apps.demo_run import run_method

    torch.set_num_threads(1)
    res = run_method(base, mds=mds, out_dir=run_dir, settings=settings, seed=seed, progress=False,
                     extra_overrides=extra)
    return res, peak_rss_mb()


def _finished_run(method: str, seed: int, steps: int, mds: Path, out: Path, docs: Mapping[str, Any],
                  runs: Mapping[str, Mapping[int, Mapping[str, Any]]], extra: Sequence[str]) -> bool:
    """Whether ``method`` at ``seed`` has a result on disk with exactly the settings it would run with."""
    from grape_stream.apps.demo_run import finished_result

    try:
        plan = _plan(method, seed, steps, mds, out, docs, runs, extra)
    except SystemExit:  # a reuse method whose source runs are missing
        return False
    return finished_result(plan["run_dir"], plan["want"]) is not None


def _twin(out: Path, run_dir: Path, want: Sequence[str]) -> dict[str, Any] | None:
    """A finished run of another bench method with exactly these settings (runs are deterministic)."""
    def strip(o: Sequence[str]) -> list[str]:
        return [x for x in o if not x.startswith(("run_name=", "output_dir="))]

    key = strip(want)
    for path in sorted(out.glob("*-seed*/result.json")):
        if path.parent == run_dir:
            continue
        try:
            prev = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if "same_run_as" not in prev and strip(prev.get("overrides", [])) == key:
            return prev
    return None


def kept_runs(path: Path, steps: int, exclude: Sequence[str]) -> dict[str, dict[int, dict[str, Any]]]:
    """``--add``: the runs of the methods not retrained, as the results file holds them (same budget only)."""
    prev = json.loads(path.read_text())
    if prev.get("setting", {}).get("steps") != steps:
        raise SystemExit(f"--add: {path} holds runs of {prev.get('setting', {}).get('steps')} steps, not {steps}")
    _KEPT_SEARCH.update(prev.get("search") or {})
    # the kept runs of other trees stay joined on the evidence that joined them (one file's, or several)
    was = (prev.get("version") or {}).get("joined") or []
    _JOINED.extend(ev for ev in ([was] if isinstance(was, dict) else was) if ev not in _JOINED)
    tokens = prev["setting"]["train_tokens"]
    return {m: {int(s): {"train_tokens": tokens, **r} for s, r in by_seed.items()}
            for m, by_seed in prev.get("runs", {}).items() if m not in exclude}


_KEPT_SEARCH: dict[str, Any] = {}  # --add: the search section of the results file the kept runs come from
#: --join: a run of another library tree reproduces this table's run of the same method and seed when every
#: target's final loss is within this (nats/token). Float round-off between trees is ~1e-6 here; the seed-to-seed
#: spread of a row is ~1e-2 to 1e-1.
JOIN_TOLERANCE = 1e-4
_JOINED: list[dict[str, Any]] = []  # --join: the evidence of each file, as the results file records it


def join(runs: dict[str, dict[int, dict[str, Any]]], path: Path, steps: int,
         accept_diverged: Sequence[str] = ()) -> dict[str, Any]:
    """``--join``: another library tree's results file joins the table when it reproduces it: the file's runs
    are of one library tree, and every run both files hold (same method and seed; at least one uniform and one
    GRAPE run among them) agrees to within :data:`JOIN_TOLERANCE` on every target. Then its runs of other methods
    and seeds are added to ``runs`` (a run both hold stays this table's). Either way the evidence is returned,
    and recorded in the results.

    ``accept_diverged`` (``method:seed``): shared adaptive runs the caller accepts as diverged, not failed. Two
    trees' float round-off can grow until one domain's sample count in a batch flips, and from then on the run
    is another run. Such a run is named by hand, recorded with the step its
    weights first differ by more than the tolerance and how far apart they were before it, and does not join; the
    others must still reproduce."""
    prev = json.loads(path.read_text())
    if prev.get("setting", {}).get("steps") != steps:
        raise SystemExit(f"--join: {path} holds runs of {prev.get('setting', {}).get('steps')} steps, not {steps}")
    tokens = prev["setting"]["train_tokens"]
    other = {m: {int(s): {"train_tokens": tokens, **r} for s, r in b.items()} for m, b in prev.get("runs", {}).items()}
    trees = sorted({str((r.get("code") or {}).get("library_tree")) for b in other.values() for r in b.values()})
    both = [(m, s) for m, b in other.items() for s in sorted(b) if s in runs.get(m, {})]
    targets = _setting().targets
    diffs = {f"{m}:{s}": max(abs(float(other[m][s]["final"][t]) - float(runs[m][s]["final"][t])) for t in targets)
             for m, s in both}
    unknown = [k for k in accept_diverged if k not in diffs]
    if unknown:
        raise SystemExit(f"--accept-diverged: {', '.join(unknown)} not a run both {path} and the table hold "
                         f"(they share {', '.join(diffs) or 'none'})")
    diverged = {}
    for k in accept_diverged:
        m, s = k.split(":")
        diverged[k] = {"max_abs_diff": diffs.pop(k), **_divergence(runs[m][int(s)], other[m][int(s)])}
    joined = (len(trees) == 1 and any(k.startswith("uniform:") for k in diffs)
              and any(k.startswith("grape") for k in diffs)
              and max(diffs.values()) <= JOIN_TOLERANCE)  # one tree: what reproduces is that tree, not a mix
    added = [] if not joined else [f"{m}:{s}" for m, b in other.items() for s in sorted(b) if s not in runs.get(m, {})]
    for key in added:
        m, s = key.split(":")
        runs.setdefault(m, {})[int(s)] = other[m][int(s)]
    evidence = {"file": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path), "trees": trees,
                "reproduced": diffs, "max_abs_diff": max(diffs.values(), default=None), "tolerance": JOIN_TOLERANCE,
                "joined": joined, "added": added, **({"diverged": diverged} if diverged else {})}
    _JOINED.append(evidence)
    return evidence


def _divergence(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, Any]:
    """Where two runs of one method and seed part: for their weights (each update's alpha) and their train loss
    (the logged steps), the first step that differs by more than :data:`JOIN_TOLERANCE` and the largest
    difference before it. A train loss that jumps from round-off to 1e-2 in one step is a batch that changed."""
    def parts(a: Sequence[tuple[int, Sequence[float]]], b: Sequence[tuple[int, Sequence[float]]]
              ) -> tuple[int | None, float]:
        before = 0.0
        for (step, x), (_, y) in zip(a, b):
            d = max(abs(float(u) - float(v)) for u, v in zip(x, y))
            if d > JOIN_TOLERANCE:
                return int(step), before
            before = max(before, d)
        return None, before

    def alpha(r: Mapping[str, Any]) -> list[tuple[int, Sequence[float]]]:
        return [(p["step"], p["alpha"]) for p in r.get("trajectory") or []]

    def loss(r: Mapping[str, Any]) -> list[tuple[int, Sequence[float]]]:
        return [(s, [x]) for s, x in r.get("train_loss") or []]

    a_step, a_before = parts(alpha(ours), alpha(theirs))
    l_step, l_before = parts(loss(ours), loss(theirs))
    return {"alpha_first_differs_at_step": a_step, "alpha_max_diff_before": a_before,
            "train_loss_first_differs_at_step": l_step, "train_loss_max_diff_before": l_before}


def _joined_trees() -> list[str]:
    """The library trees whose runs joined the table (each reproduced it)."""
    return sorted({t for ev in _JOINED if ev["joined"] for t in ev["trees"]})


def _search_section(docs: Mapping[str, Any], runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, Any]:
    """The oracle search as the JSON shows it: each answer's weights, the candidates and their probe scores
    (as the search found them, with its provenance) and the candidates re-scored by ``cand_*`` runs here."""
    sec: dict[str, Any] = {k: {kk: v for kk, v in d.items() if kk != "details"}
                           | {"chosen": d["details"].get("chosen"), "criterion": d["details"].get("criterion"),
                              "candidates": [{k2: c.get(k2) for k2 in ("name", "probe_avg", "probe_worst", "weights")}
                                             for c in d["details"].get("candidates", [])] or None}
                           for k, d in docs.items() if isinstance(d, dict) and "weights" in d} or dict(_KEPT_SEARCH)
    here = [{"name": m[5:], "seed": s, "probe_avg": r["final_avg"], "probe_worst": r["final_worst"],
             "commit": (r.get("code") or {}).get("commit")}
            for m, by_seed in runs.items() if m.startswith("cand_") for s, r in sorted(by_seed.items())]
    if here:
        sec["candidates_rescored_this_version"] = {
            "criterion": "probe-split average at the full budget, seed 0", "candidates": here,
            "best": min(here, key=lambda c: c["probe_avg"])["name"]}
    return sec


def _selection(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, Any] | None:
    """Issue 32 part 2's choice among GRAPE variants, from their ``sel_*`` runs (scored on the probe split):
    the lowest mean worst-target loss, the goal the variants are for. Same seeds for every variant or none."""
    sel = {m[4:]: by_seed for m, by_seed in runs.items() if m.startswith("sel_") and by_seed}
    if not sel:
        return None
    seeds = sorted(set.intersection(*(set(b) for b in sel.values())))

    def mean(b: Mapping[int, Mapping[str, Any]], key: str) -> float | None:
        return sum(b[s][key] for s in seeds) / len(seeds) if seeds else None

    rows = {m: {"seeds": seeds, "probe_avg": mean(b, "final_avg"), "probe_worst": mean(b, "final_worst")}
            for m, b in sel.items()}
    return {"criterion": "lowest mean worst-target loss on the probe split's scoring half (GRAPE fitted on the "
                         "other half) over the seeds every variant ran",
            "variants": rows, "chosen": min(rows, key=lambda m: rows[m]["probe_worst"]) if seeds else None}


def _earlier(path: Path | None, methods: Sequence[str]) -> dict[str, Any] | None:
    """The rows of an earlier library version's results file (``--earlier``), summarised and labelled, for
    a block apart from the table: never merged with this version's rows."""
    if path is None or not path.is_file():
        return None
    prev = json.loads(path.read_text())
    rows = {m: {"n": len(st["seeds"]), "avg": st["avg"], "worst": st["worst"]}
            for m, st in prev.get("methods", {}).items()}
    return {"file": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
            "note": "an earlier library version (before the elastic stream, issue 20, for uniform / grape / doge / "
                    "regmix / oracle / crisp / grape_final_static / grape_steps; after it for the others): other "
                    "data streams per seed, mean +- std as that file states them; not comparable row by row",
            "not_rerun_here": sorted(set(rows) - set(methods)), "rows": rows}


def write(path: Path, runs: Mapping[str, Mapping[int, Mapping[str, Any]]], docs: Mapping[str, Any], args: Any,
          partial: bool) -> dict[str, Any]:
    """The results file: the table of ONE library version (the one most runs recorded, or ``--version``);
    runs of other versions listed apart; the search with its candidates; the claims."""
    main_runs = {m: r for m, r in runs.items() if not m.startswith(("cand_", "sel_"))}
    same, other, version = split_by_version(main_runs, getattr(args, "version", None),
                                            equivalent=_joined_trees())
    st = _setting()
    agg = aggregate(same, st.targets, st.sources)
    earlier = _earlier(Path(args.earlier) if getattr(args, "earlier", None) else None, list(agg))
    text = table(agg, st.targets) if agg else ""
    if earlier and text:
        def ms(x: Sequence[float], n: int) -> str:
            return f"{x[0]:.4f} +- {x[1]:.4f} (std)" if n > 1 else f"{x[0]:.4f} (n=1)"

        text += ("\n\nearlier library version, NOT re-run on this one (" + earlier["file"] + "; other data streams, "
                 "not comparable row by row with the table above):\n"
                 + "\n".join(f"{m:<20} n={r['n']}  avg {ms(r['avg'], r['n'])}  worst {ms(r['worst'], r['n'])}"
                             for m, r in earlier["rows"].items() if m in earlier["not_rerun_here"]))
    for ev in (e for e in _JOINED if e["joined"] and text):
        text += (f"\n\nincludes runs of library tree(s) {', '.join(t[:10] for t in ev['trees'])} "
                 f"({ev['file']}): they reproduce this table's {', '.join(ev['reproduced'])} to within "
                 f"{ev['max_abs_diff']:.1e} nats on every target (tolerance {ev['tolerance']:g}); added: "
                 f"{', '.join(ev['added'])}"
                 + "".join(f"; {k} accepted as diverged, not joined: its train loss first differs by more than the "
                           f"tolerance at step {d.get('train_loss_first_differs_at_step')} (by at most "
                           f"{d.get('train_loss_max_diff_before', float('nan')):.1e} before), its weights at step "
                           f"{d['alpha_first_differs_at_step']} (by at most {d['alpha_max_diff_before']:.1e} "
                           f"before), its final loss by up to {d['max_abs_diff']:.3f}"
                           for k, d in (ev.get("diverged") or {}).items()))
    commits = sorted({(r.get("code") or {}).get("commit", "unrecorded") for b in same.values() for r in b.values()})
    search_settings = {**docs["key"], **(docs.get("settings") or {})} if docs.get("key") else None
    doc = {"bench": "value", "partial": partial, "command": "python bench/value.py " + " ".join(sys.argv[1:]),
           "version": {"library_tree": version, "commits": commits, "collected_by": dict(_CODE),
                       "joined": [dict(ev) for ev in _JOINED] or None},
           "setting": {"name": st.name, "corpus": Path(args.data).name, "sources": st.sources,
                       "targets": st.targets, "vocab": VOCAB, "seq_len": SEQ_LEN, "steps": args.steps,
                       "batch": BATCH, "train_tokens": args.steps * BATCH * SEQ_LEN, "lr": LR, "model": MODEL,
                       "metric": "token-level test cross-entropy (nats/token), 256 strided test sequences per target "
                                 "(the whole test split where it holds fewer)",
                       "ci": "95% two-sided Student t interval of the mean over seeds, half-width (n - 1 df)"},
           "claims": claims(agg, search_settings=search_settings), "table": text,
           "search_settings": search_settings,
           "search": _search_section(docs, runs),
           "selection": _selection(runs),
           "methods": agg,
           "other_versions": {m: {str(s): {"code": r.get("code"), "final_avg": r["final_avg"],
                                           "final_worst": r["final_worst"]} for s, r in b.items()}
                              for m, b in other.items()},
           "earlier_version": earlier,
           "runs": {m: {str(s): {k: r[k] for k in ("final", "final_avg", "final_worst", "curve", "trajectory",
                                                     "seconds", "train_loss", "train_tokens", "steps", "code",
                                                     "peak_rss_mb", "process_peak_rss_mb", "same_run_as", "prior",
                                                     "reuse_sources")
                                  if k in r}
                        for s, r in by_seed.items()} for m, by_seed in runs.items()}}
    write_json(path, doc, default=list)
    return doc


def docs_markers(block: str) -> tuple[str, str]:
    """The lines between which docs/results.md holds a setting's table."""
    return f"<!-- {block}:begin -->", f"<!-- {block}:end -->"


DOCS_BEGIN, DOCS_END = docs_markers("value-table")


def write_docs(path: Path, doc: Mapping[str, Any], block: str = "value-table") -> None:
    """The table (and the claims it supports) between the page's markers: the page's figures are the JSON's,
    regenerated by the script, never typed by hand."""
    DOCS_BEGIN, DOCS_END = docs_markers(block)  # noqa: N806 (the module's names, for this block)
    text = path.read_text()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise SystemExit(f"{path}: no {DOCS_BEGIN} ... {DOCS_END} block to write the table into")
    v, c = doc["version"], doc["claims"]
    w = c.get("worst_target_improved_seeds") or {}
    t = c.get("targets_improved_per_seed") or {}
    g = c.get("oracle_gain_captured") or {}
    cu = (c.get("compute_to_uniform_final") or {}).get("fraction_of_uniform_steps") or {}
    lines = [DOCS_BEGIN, "",
             f"Library tree `{(v['library_tree'] or '')[:12]}` (`git rev-parse HEAD:grape_stream`), runs of commit(s) "
             + ", ".join(f"`{x[:10]}`" for x in v["commits"]) + ("; **partial** (runs still going)"
                                                                if doc["partial"] else "") + ".", "",
             "```", doc["table"], "```", ""]
    mr, mg = c.get("margin_rule") or {}, c.get("oracle_margin_in_uniform_std") or {}
    if mr:
        lines.append(f"- `margin_rule` (the oracle >= {mr['uniform_stds']:g} uniform seed-stds ahead of uniform): "
                     + "; ".join(f"{k} {mg[k]:.1f} stds, {'met' if mr['met'][k] else 'NOT met'}"
                                 for k in ("avg", "worst") if mg.get(k) is not None))
    if w:
        lines.append(f"- `worst_target_improved_seeds` (GRAPE default, worst-target test loss below uniform's seed "
                     f"mean): {w['improved']} of {w['n']}")
    if t:
        of = len(doc["setting"]["targets"])
        lines.append(f"- `targets_improved_per_seed` (of {of}, against uniform's seed mean per target): "
                     + "; ".join(f"{m} {','.join(map(str, x['per_seed'].values()))}" for m, x in t.items()))
    for k in ("avg", "worst"):
        if k in g:
            ci = "" if g[k]["ci"] is None else f" +- {g[k]['ci']:.2f}"
            lines.append(f"- oracle gain captured by GRAPE, {k}: {g[k]['mean']:.2f}{ci} (95% t, n={g[k]['n']})")
    if cu.get("n"):
        ci = "" if cu.get("ci") is None else f" +- {cu['ci']:.2f}"
        lines.append(f"- `compute_to_uniform_final` (GRAPE, probe cost included, / uniform's 400 steps): "
                     f"{cu['mean']:.2f}{ci} (n={cu['n']})")
    for prior, row in (c.get("prior_repair") or {}).items():
        parts = []
        for k in ("avg", "worst"):
            x = row.get(k)
            if x:
                ci = "" if x["ci"] is None else f" +- {x['ci']:.4f}"
                parts.append(f"{k} {x['mean']:+.4f}{ci}")
        lines.append(f"- `prior_repair` {prior} ({row.get('static', prior)}'s static run minus "
                     f"{row.get('started', 'GRAPE started from its weights')}, paired by seed; "
                     f"positive: repaired; n={len(row['seeds'])}): " + ", ".join(parts))
    if c.get("reuse"):
        lines.append("- `reuse` (training-step equivalents with the source runs or proxies counted, and their ratio to "
                     "uniform's): " + "; ".join(f"{m} {r['total_steps']:,.0f} ({r['total_of_uniform']:.2f}x)"
                                                 for m, r in c["reuse"].items()))
    lines += ["", DOCS_END]
    a, b = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    path.write_text(text[:a] + "\n".join(lines) + text[b:])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"of {list(METHODS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--proxies", type=int, default=24, help="RegMix proxies of the oracle search")
    p.add_argument("--candidates", type=int, default=1, help="best proxies retrained at the full budget")
    p.add_argument("--stage", choices=("all", "search"), default="all")
    p.add_argument("--setting", choices=sorted(SETTINGS), default="languages",
                   help="the benchmark: the demo's 13 languages (the default) or English sources against task "
                        "targets (issue 32 part 5); it sets the defaults of --data, --out, --results and --docs' block")
    p.add_argument("--out", default="", help="the runs' folder (default: the setting's, under runs/)")
    p.add_argument("--data", default="", help="the corpus (default: the setting's, under data/)")
    p.add_argument("--results", default="", help="the results file (default: the setting's, under bench/results/)")
    p.add_argument("--extra", action="append", default=[], help="extra recipe override for every method run")
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--collect", action="store_true",
                   help="train nothing: write the results from every finished run on disk (methods x seeds given)")
    p.add_argument("--add", action="store_true",
                   help="train only --methods; every other method's runs are kept from the existing --results file "
                        "(runs are deterministic: same settings, same numbers), so a new method joins the table "
                        "without retraining the oracle search, uniform and the others")
    p.add_argument("--runs", default="",
                   help="an explicit run list in priority order, e.g. uniform:0,grape:0,oracle:0,uniform:1 "
                        "(instead of --methods x --seeds, which runs method by method)")
    p.add_argument("--search-from", default="",
                   help="a JSON of an earlier oracle search (weights, settings, candidate scores, provenance) used "
                        "as this run's search instead of retraining its proxies")
    p.add_argument("--version", default=None,
                   help="the library tree (git rev-parse HEAD:grape_stream) whose runs make the table "
                        "(default: the one most runs recorded)")
    p.add_argument("--earlier", default="",
                   help="an earlier version's results file, listed apart under the table (its rows not re-run)")
    p.add_argument("--join", action="append", default=[],
                   help="another library tree's results file whose runs join the table if it reproduces it (every "
                        f"run both hold within {JOIN_TOLERANCE} nats on each target, a uniform and a GRAPE run "
                        "among them); the evidence is recorded either way. Repeat it for files of several trees: "
                        "each must reproduce the table on its own")
    p.add_argument("--accept-diverged", default="",
                   help="with --join: shared adaptive runs (method:seed, comma-separated) accepted as diverged by "
                        "round-off rather than failed; each is recorded with the step its weights part, and does not "
                        "join (the other shared runs must still reproduce)")
    p.add_argument("--docs", default="",
                   help="also write the table into this Markdown file between its '<!-- value-table:begin -->' and "
                        "'<!-- value-table:end -->' lines (docs/results.md), with the commit and the claims")
    p.add_argument("--quick", action="store_true", help="smoke run: 32 steps, seed 0, uniform + grape, 4 proxies")
    args = p.parse_args(argv)
    st = SETTINGS[args.setting]
    args.out, args.data, args.results = (args.out or str(st.out), args.data or str(st.data),
                                         args.results or str(st.results))
    if args.quick:
        args.steps, args.seeds, args.methods, args.proxies, args.candidates = 32, "0", "uniform,oracle,grape", 4, 1
        res = Path(args.results)
        args.out, args.results = args.out + "_quick", str(res.with_name(res.stem + "_quick.json"))
    import torch

    _CODE.update(code_version())
    print(f"code: {json.dumps(_CODE)}", flush=True)
    _RUN["steps"], _RUN["out"], _RUN["setting"] = args.steps, Path(args.out), st
    torch.set_num_threads(1)
    out, corpus = Path(args.out), Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    mds = prepare(out, corpus)
    pairs = [(x.split(":")[0], int(x.split(":")[1])) for x in args.runs.split(",") if x]
    methods = list(dict.fromkeys(m for m, _ in pairs)) if pairs else [m for m in args.methods.split(",") if m]
    docs: dict[str, Any] = {}
    if args.search_from:
        search_from(Path(args.search_from), out, _search_key(args.proxies, args.steps, args.candidates, mds))
    if args.stage == "search" or set(methods) & NEEDS_SEARCH or (out / "search.json").is_file():
        docs = search(out, mds, corpus, proxies=args.proxies, steps=args.steps, candidates=args.candidates,
                      fresh=args.fresh)
        print(f"oracle ({docs['oracle']['details']['chosen']}): {json.dumps(docs['oracle']['alpha'])}", flush=True)
    if args.stage == "search":
        return 0
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"unknown methods {bad}; choose from {list(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    if args.add:
        runs = kept_runs(Path(args.results), args.steps, exclude=methods)
    for other in args.join:
        ev = join(runs, Path(other), args.steps, [x for x in args.accept_diverged.split(",") if x])
        print(f"--join {other}: {'joined' if ev['joined'] else 'NOT joined'} (runs both hold: "
              f"{json.dumps(ev['reproduced'])}; largest difference {ev['max_abs_diff']}); added {ev['added']}",
              flush=True)
    for source in sorted({s for s, _ in REUSE.values()}):
        reuse = {m for m, (s, _) in REUSE.items() if s == source}
        # reuse the source runs already on disk (--collect: even when listed, the filter below plans them first)
        if reuse & set(methods) and (source not in methods or args.collect):
            for path in sorted(out.glob(f"{source}-seed*/result.json")):
                runs.setdefault(source, {})[int(path.parent.name.rsplit("seed", 1)[1])] = json.loads(path.read_text())
    order = pairs or [(m, s) for m in methods for s in seeds]  # method-major: reuse methods need their sources
    listed = len(order)
    if args.collect:  # only the runs that finished with this invocation's settings
        order = [(m, s) for m, s in order if _finished_run(m, s, args.steps, mds, out, docs, runs, args.extra)]
    for i, (m, s) in enumerate(order, 1):
        runs.setdefault(m, {})[s] = _run(m, s, args.steps, mds, out, docs, runs, args.fresh, args.extra)
        write(Path(args.results), runs, docs, args, partial=i < len(order))
    # --collect while listed runs are still training (or missing): the file says it is partial
    doc = write(Path(args.results), runs, docs, args, partial=len(order) < listed)
    print("\n" + doc["table"])
    print("\nclaims: " + json.dumps(doc["claims"], indent=1))
    print(f"wrote {args.results}")
    if args.docs:
        write_docs(Path(args.docs), doc, st.docs_block)
        print(f"wrote the table into {args.docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
