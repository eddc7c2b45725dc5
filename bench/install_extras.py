"""Does each extra install, and does `[foundry]` train an llm-foundry YAML? From the registry, as a user would.

    python bench/install_extras.py            # wheel; resolve every extra; fresh venv with [foundry] + a tiny
                                              # llm-foundry train (algorithms: grape, train_loader: grape_mixture)
    python bench/install_extras.py --quick    # wheel + resolution only (about a minute), results not written
    python bench/install_extras.py --install foundry,tracking --no-hints

Prints a table extra -> resolves? installs? runs? seconds, and the versions pip picked; writes
bench/results/install_extras.json. Needs the package registry (network) and, for the install, a few GB
of disk (torch 2.7.0 with its CUDA wheels, which llm-foundry 0.22 pins).

Resolution hints (``HINTS``, constraints passed with ``-c``): none are needed now. pip used to backtrack for 13
minutes over old wandb / google-api-core releases before it found llm-foundry 0.22's solution (measured
2026-11-23); the ``[foundry]`` extra's ``protobuf<6`` bound (pyproject.toml says why) leads it there in under
a minute, as a user types the command. ``--no-hints`` is kept for a hint added later.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import common
from common import parser, write_json

REPO = str(common.REPO)
RESULTS = common.result_path("install_extras")

#: what each extra is installed together with (the issue's check: [foundry] beside llm-foundry 0.22.0);
#: "a+b" installs the extras a and b together
EXTRAS: dict[str, list[str]] = {"composer": [], "foundry": ["llm-foundry==0.22.0"], "hf": [], "lightning": [],
                                "tracking": [], "foundry+tracking": ["llm-foundry==0.22.0"]}
#: constraints that steer pip's backtracking to the solution it finds anyway (see the module docstring): none
HINTS: dict[str, list[str]] = {}
SHOWN = ("torch", "torchvision", "mosaicml", "mosaicml-streaming", "llm-foundry", "transformers", "accelerate",
         "lightning", "tensorboard", "mlflow", "mlflow-skinny", "wandb", "protobuf", "numpy")


def _run(cmd: list[str], timeout: float, **kw: Any) -> tuple[int, float, str]:
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
        return p.returncode, time.perf_counter() - t, (p.stdout + p.stderr)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, time.perf_counter() - t, out + f"\ntimed out after {timeout:.0f}s"


def _last_error(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.strip() and "is ignored" not in ln]
    errors = [ln for ln in lines if "Error" in ln or "ERROR" in ln or "error:" in ln]
    return (errors or lines or ["?"])[-1][:400]


def build_wheel(out: str) -> tuple[str, float]:
    rc, sec, log = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                         "-w", out, REPO], 600)
    wheels = glob.glob(os.path.join(out, "grape_stream-*.whl"))
    if rc != 0 or not wheels:
        raise SystemExit(f"wheel build failed: {_last_error(log)}")
    return wheels[0], sec


def _req(wheel: str, extra: str) -> str:
    return f"{wheel}[{extra.replace('+', ',')}]"


def _hint_args(extra: str, hints: bool, tmp: str) -> list[str]:
    if not hints or extra not in HINTS:
        return []
    path = os.path.join(tmp, f"hints-{extra}.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(HINTS[extra]) + "\n")
    return ["-c", path]


def resolve(wheel: str, extra: str, hints: bool, tmp: str, timeout: float) -> dict[str, Any]:
    """``pip install --dry-run --ignore-installed`` of ``wheel[extra]`` (+ its companions) against the registry."""
    report = os.path.join(tmp, f"report-{extra}.json")
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--prefer-binary",
           "--report", report, *_hint_args(extra, hints, tmp), _req(wheel, extra), *EXTRAS[extra]]
    rc, sec, out = _run(cmd, timeout)
    row: dict[str, Any] = {"resolves": rc == 0, "resolve_s": round(sec, 1),
                           "hints": HINTS.get(extra) if hints else None}
    if rc == 0:
        with open(report, encoding="utf-8") as f:
            got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(f)["install"]}
        row["versions"] = {k: got[k] for k in SHOWN if k in got}
        row["packages"] = len(got)
    else:
        row["error"] = _last_error(out)
    return row


FOUNDRY_YAML = """\
run_name: grape-foundry-tiny
seed: 7
max_seq_len: {seq}
model:
  name: mpt_causal_lm
  init_device: cpu
  d_model: 32
  n_heads: 2
  n_layers: 2
  expansion_ratio: 2
  max_seq_len: {seq}
  vocab_size: {vocab}
  attn_config: {{attn_impl: torch}}
  loss_fn: torch_crossentropy
tokenizer:
  name: {tokenizer}
  kwargs: {{model_max_length: {seq}}}
train_loader:
  name: grape_mixture
  domains: [d0, d1]
  local: {data}
  split: train
  seed: 3
algorithms:
  grape:
    method: grape
    alpha_every: 2
    z_every: 2
    probe_domain_batch: 4
    probe_task_batch: 4
    mu_alpha: 3.0e-3
    mu_z: 3.0e-4
    tasks:
      - {{name: t0, local: {data}/tasks/t0}}
callbacks:
  grape_trajectory: {{folder: {out}}}
loggers:
  wandb: {{project: grape-bench}}
  mlflow: {{tracking_uri: "file://{out}/mlruns", experiment_name: grape-bench}}
optimizer: {{name: decoupled_adamw, lr: 1.0e-3, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.0}}
scheduler: {{name: cosine_with_warmup, t_warmup: 1ba, alpha_f: 0.1}}
max_duration: 6ba
eval_interval: 1
global_train_batch_size: 8
device_train_microbatch_size: 8
precision: fp32
progress_bar: false
log_to_console: true
console_log_interval: 1ba
"""

RUN_SCRIPT = """\
import os, sys
sys.path.insert(0, {tests!r})
from _grape_data import SEQ, VOCAB, write_dataset
import transformers
from grape_stream.convert.tokenization import gpt2_files
data, out, tok = {data!r}, {out!r}, {tok!r}
write_dataset(data, domains=2, tasks=(1,), n_domain=96, n_val=16, n_test=8)
enc, bpe = gpt2_files()
transformers.GPT2TokenizerFast(vocab_file=str(enc), merges_file=str(bpe)).save_pretrained(tok)
with open(os.path.join(out, "train.yaml"), "w") as f:
    f.write({yaml!r}.format(seq=SEQ, vocab=VOCAB + 20, tokenizer=tok, data=data, out=out))
from llmfoundry.command_utils import train_from_yaml
import grape_stream
print("grape_stream from", grape_stream.__file__)
train_from_yaml(os.path.join(out, "train.yaml"), [])
"""


def install_and_run(wheel: str, extra: str, hints: bool, root: str, timeout: float) -> dict[str, Any]:
    """A fresh venv with ``wheel[extra]``; for ``foundry``, a tiny llm-foundry train with GRAPE in it."""
    venv = os.path.join(root, f"venv-{extra}")
    row: dict[str, Any] = {}
    rc, sec, out = _run([sys.executable, "-m", "venv", venv], 300)
    py = os.path.join(venv, "bin", "python")
    cmd = [py, "-m", "pip", "install", "-q", "--prefer-binary", *_hint_args(extra, hints, root),
           _req(wheel, extra), *EXTRAS[extra]]
    rc, sec2, out = _run(cmd, timeout) if rc == 0 else (rc, 0.0, out)
    row.update(installs=rc == 0, install_s=round(sec + sec2, 1))
    if rc != 0:
        row["error"] = _last_error(out)
        return row
    check = "import grape_stream.integrations.composer.algorithm as a; print(a.GrapeAlgorithm)"
    if extra != "foundry":
        rc, sec, out = _run([py, "-c", check], 300)
        row.update(runs=rc == 0, run_s=round(sec, 1), run_what="import GrapeAlgorithm")
        return row if rc == 0 else {**row, "error": _last_error(out)}
    work = os.path.join(root, "foundry-run")
    os.makedirs(work, exist_ok=True)
    script = RUN_SCRIPT.format(tests=os.path.join(REPO, "tests"), data=os.path.join(work, "data"), out=work,
                               tok=os.path.join(work, "tokenizer"), yaml=FOUNDRY_YAML)
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_DIR=work, PYTHONPATH="")
    rc, sec, out = _run([py, "-c", script], timeout, env=env, cwd=work)
    traj = os.path.join(work, "grape_trajectory.jsonl")
    updates = sum(1 for _ in open(traj, encoding="utf-8")) - 1 if os.path.exists(traj) else 0
    row.update(runs=rc == 0 and updates > 0, run_s=round(sec, 1),
               run_what="llm-foundry train_from_yaml, 6 batches, loggers wandb (offline) + mlflow (file store)",
               trajectory_lines=updates, summary_printed="GRAPE run summary" in out,
               artifacts={"mlflow": glob.glob(os.path.join(work, "mlruns", "*", "*", "artifacts", "grape", "*")),
                          "wandb": glob.glob(os.path.join(work, "wandb", "offline-run-*", "files", "grape_*"))})
    row["artifacts"] = {k: sorted(os.path.basename(p) for p in v) for k, v in row["artifacts"].items()}
    lines = out.splitlines()
    row["update_lines"] = [ln for ln in lines if ln.startswith("GRAPE update") and " done in " in ln]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("GRAPE run summary")), None)
    end = next((i for i, ln in enumerate(lines) if start is not None and i > start and ln.startswith("plots:")), None)
    row["summary"] = lines[start:end + 1] if start is not None and end is not None else []
    if not row["runs"]:
        row["error"] = _last_error(out)
    return row


def _cell(row: dict[str, Any], ok: str, sec: str) -> str:
    if ok not in row:
        return "-"
    return f"{'yes' if row[ok] else 'NO'} ({row.get(sec, 0):.0f}s)"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.split("\n")[0], None, quick="wheel + resolution only; nothing written without --out")
    ap.add_argument("--out", default=None, help=f"JSON results (default, full runs: {RESULTS})")
    ap.add_argument("--extras", default=",".join(EXTRAS), help="extras to resolve (comma-separated)")
    ap.add_argument("--install", default="foundry", help="extras to install in a fresh venv and run ('' for none)")
    ap.add_argument("--no-hints", action="store_true", help="plain pip resolution, without HINTS")
    ap.add_argument("--workdir", default=None, help="where venvs go (default: a temporary directory, removed)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per resolve / install / run")
    args = ap.parse_args(argv)
    extras = [e for e in args.extras.split(",") if e]
    install = [] if args.quick else [e for e in args.install.split(",") if e]
    hints = not args.no_hints
    with tempfile.TemporaryDirectory(prefix="grape-extras-", dir=args.workdir) as tmp:
        wheel, wheel_s = build_wheel(tmp)
        rows: dict[str, dict[str, Any]] = {}
        for extra in extras:
            rows[extra] = resolve(wheel, extra, hints, tmp, args.timeout)
            if extra in install and rows[extra]["resolves"]:
                rows[extra].update(install_and_run(wheel, extra, hints, tmp, args.timeout))
            print(f"{extra}: {json.dumps(rows[extra])}", flush=True)
    print(f"\nwheel built in {wheel_s:.1f}s: {os.path.basename(wheel)}")
    print(f"{'extra':<10} {'resolves?':<12} {'installs?':<12} {'runs?':<12} versions pip picked")
    for extra, row in rows.items():
        v = row.get("versions", {})
        shown = " ".join(f"{k}={v[k]}" for k in ("torch", "mosaicml", "mosaicml-streaming", "llm-foundry",
                                                  "transformers", "lightning", "wandb", "mlflow-skinny",
                                                  "tensorboard") if k in v)
        print(f"{extra:<10} {_cell(row, 'resolves', 'resolve_s'):<12} {_cell(row, 'installs', 'install_s'):<12} "
              f"{_cell(row, 'runs', 'run_s'):<12} {shown or row.get('error', '')}")
    out = args.out or (None if args.quick else RESULTS)
    if out:
        write_json(out, {"python": sys.version.split()[0], "wheel_s": round(wheel_s, 1), "hints": hints,
                         "extras": rows, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=2)
        print(f"wrote {out}")
    return 0 if all(r["resolves"] and r.get("runs", True) for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
