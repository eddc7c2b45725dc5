"""The demo's setting, which is also the value benchmark's (``bench/value.py`` imports it from here): one
definition of the pool, the targets, the tokenizer, the model and the budget.

- **Pool**: all 13 languages of the bundled corpus (``data/demo``) as source domains: six high-resource ones
  (en fr de es ru it, ~0.9M tokens each) and the *small* training splits of the seven low-resource targets
  (tr da ca pl nl uk pt, 110-160k tokens each): most of the pool is irrelevant to the targets, a little is
  very relevant, so the mixture matters (the best static mixture is ~20 uniform seed-stds ahead of uniform).
- **Targets**: the seven low-resource languages; the methods see their ``probe`` split, every reported
  figure is on their ``test`` split.
- **Tokenizer**: a 4,096-id byte-level BPE trained on the 13 source training splits.
- **Model and budget**: the ``demo-cpu`` recipe's GPT at 4 layers, d=128, 4 heads (1.3M parameters),
  128-token sequences, batch 32, 400 steps (1.64M training tokens), AdamW lr 1e-3, 10% warm-up; an alpha/z
  update (and a test-curve point) every steps/16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from grape_stream.apps.demo_corpus import ensure_converted
from grape_stream.apps.demo_settings import DEMO, DemoSettings
from grape_stream.config import AlgorithmConfig

__all__ = ["BATCH", "DATA", "LR", "MODEL", "SEQ_LEN", "SOURCES", "STEPS", "TARGETS", "VOCAB", "overrides",
           "QUICK_STEPS", "data_overrides", "pool_settings", "prepare", "quick_settings", "reference_lines",
           "reference_path", "update_interval"]

SOURCES = ("en", "fr", "de", "es", "ru", "it", "tr", "da", "ca", "pl", "nl", "uk", "pt")
TARGETS = ("tr", "da", "ca", "pl", "nl", "uk", "pt")
VOCAB, SEQ_LEN, STEPS, BATCH, LR = 4096, 128, 400, 32, 1e-3
QUICK_STEPS = 48  # --quick
MODEL = [f"model.vocab_size={VOCAB}", "model.n_layer=4", "model.n_head=4", "model.d_model=128", "model.d_ff=512"]


def data_overrides(sources: Sequence[str], targets: Sequence[str]) -> list[str]:
    """The recipe's data section at this setting: sequence length, the domains, the targets, the eval batch."""
    return [f"data.seq_len={SEQ_LEN}", f"data.domains=[{','.join(sources)}]", f"data.tasks=[{','.join(targets)}]",
            "data.eval_batch_size=64"]


DATA = data_overrides(SOURCES, TARGETS)


def overrides() -> list[str]:
    """The recipe overrides of this setting (model and data) that every run adds to the demo's own."""
    return [*MODEL, *DATA]


def update_interval(steps: int) -> int:
    """Training steps between two alpha/z updates (and two test-curve points) at a budget of ``steps``."""
    return max(steps // 16, 1)


def pool_settings(steps: int = STEPS) -> DemoSettings:
    """The runner's settings at a budget of ``steps``: GRAPE's step rule is the library's default (trust region),
    the final figure a strided subset of 256 test sequences per target (the whole split costs minutes)."""
    every = update_interval(steps)
    lib = AlgorithmConfig()
    return DEMO.replace(steps=steps, global_batch=BATCH, lr=LR, warmup=max(steps // 10, 1), update_every=every,
                        curve_every=every, curve_samples=48, final_eval=False, final_samples=256,
                        probe_domain_batch=8, probe_task_batch=8, eval_batch_size=64,
                        mu_alpha=lib.mu_alpha, mu_z=lib.mu_z, clip_norm=None, model_data=tuple(overrides()))


def prepare(out: Path, corpus: Path, *, sources: Sequence[str] = SOURCES,
            domain_field: str = "lang") -> tuple[Path, bool]:
    """Train the BPE on the sources' training splits (once: ``out/tokenizer.json`` is reused) and convert the
    corpus with it into ``out/mds`` (converted again when the tokenizer or the corpus changed: the fingerprint
    holds the tokenizer's hash). ``runs/demo/mds`` is the ``demo-cpu`` recipe's ``data.local``, so the recipe
    trains on what ``make demo`` converted. Another corpus at this setting's tokenizer size and sequence length
    (the value benchmark's English one) names its own ``sources`` and ``domain_field``. Returns (MDS directory,
    did any work)."""
    from grape_stream.convert.train_tokenizer import corpus_texts, train_bpe

    tok = out / "tokenizer.json"
    trained = not tok.is_file()
    if trained:
        files = [str(corpus / "train" / f"{s}.jsonl.zst") for s in sources]
        train_bpe(corpus_texts(files), VOCAB, tok)
    mds = out / "mds"
    _, converted = ensure_converted(corpus, mds, seq_len=SEQ_LEN, progress=False, tokenizer=str(tok),
                                    domain_field=domain_field)
    return mds, trained or converted


def quick_settings(steps: int = QUICK_STEPS) -> DemoSettings:
    """``--quick``: the same setting at a smoke-test budget, with fewer curve points and a smaller final subset."""
    return pool_settings(steps).replace(update_every=max(steps // 6, 1), curve_every=max(steps // 4, 1),
                                        curve_samples=32, final_samples=96)


def reference_path() -> Path:
    """The value benchmark's committed results (``bench/results/value.json`` in the repository)."""
    return Path(__file__).resolve().parents[2] / "bench" / "results" / "value.json"


def reference_lines(methods: Sequence[str], seed: int | None = None, path: Path | None = None) -> list[str]:
    """Where a run at the benchmark's exact settings sits, read from the benchmark's JSON: the seed means of
    ``methods`` with n and their 95% t interval, the benchmark's run at ``seed`` (same seed and overrides) and
    the best static mixture's (found by its search on the probe split, not retrained here). Only a file that
    records the library version its runs ran on is read (rows of an older format mixed data streams): [] when
    the file is absent, of the older format, or holds none of the methods."""
    path = reference_path() if path is None else path
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        agg, version = doc["methods"], doc["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    rows: list[tuple[str, Mapping[str, Any]]] = [(m, agg[m]) for m in methods if m in agg]
    if "oracle" in agg:
        rows.append(("best static", agg["oracle"]))
    if not rows:
        return []
    commits = ",".join(c[:10] for c in version.get("commits", []))
    lines = [f"The value benchmark at these exact settings (bench/results/{path.name}, commit {commits}; "
             "mean +- 95% t interval over its seeds, n seeds):"]
    for name, st in rows:
        seeds = list(st["seeds"])
        at = (f"; seed {seed}: average {st['avg']['values'][seeds.index(seed)]:.4f}"
              if name != "best static" and seed in seeds else "")
        lines.append(f"  {name:<12} average {_ci(st['avg'])}   worst {_ci(st['worst'])}   (n={len(seeds)}{at})")
    if "oracle" in agg:
        search = doc.get("search_settings") or {}
        chosen = (doc.get("search", {}).get("oracle") or {}).get("chosen")
        how = f"{search['proxies']}-proxy RegMix search" if search.get("proxies") else "RegMix-style search"
        lines.append(f"  best static = the fixed mixture the benchmark's {how} found on the probe split"
                     + (f" ({chosen}'s weights)" if chosen else "") + ", trained at this budget; not run by the demo.")
    return lines


def _ci(st: Mapping[str, Any]) -> str:
    """'mean +- half-width', or 'mean (n=1)' (one run has no interval)."""
    return f"{st['mean']:.4f} (n=1)" if st.get("ci") is None else f"{st['mean']:.4f} +- {st['ci']:.4f}"
