"""GrapeAlgorithm in a real Composer Trainer on real MDS shards: weights move, are logged and drive the
mixer; `.grad` and the optimizer state are untouched; a SIGKILLed run resumes onto the same trajectory;
training reads from a real S3 server; a recorded trajectory replays; bad set-ups fail clearly."""

from __future__ import annotations

import collections
import copy
import json
import os
import subprocess

import numpy as np
import pytest
import torch

import _warm
from _grape_data import SEQ, VOCAB, write_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("composer_data"))
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=160, n_val=24, n_test=16)
    return root


def tiny_recipe(data_dir: str, out: str, **sections) -> dict:
    cfg = {
        "run_name": "tiny",
        "seed": 7,
        "output_dir": os.path.join(out, "{run_name}"),
        "model": {"vocab_size": VOCAB, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64},
        "data": {"local": data_dir, "split": "train", "seq_len": SEQ, "domains": ["d0", "d1", "d2"],
                 "tasks": ["t0", "t1"], "task_local": os.path.join(data_dir, "tasks"), "eval_batch_size": 16},
        # eta_alpha = lr / mu_alpha = 1, eta_z = 10 at peak lr: visible moves in a few updates
        "algorithm": {"alpha_every": 4, "z_every": 4, "probe_domain_batch": 4, "probe_task_batch": 4,
                      "mu_alpha": 3e-3, "mu_z": 3e-4},
        "optimizer": {"lr": 3e-3},
        "scheduler": {"name": "cosine", "t_warmup": "2ba"},
        "trainer": {"max_duration": "16ba", "global_train_batch_size": 8, "eval_interval": "8ba",
                    "log_to_console": False, "device": "cpu"},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    return cfg


@pytest.fixture(scope="module")
def grape_run(data_dir, tmp_path_factory):
    """One instrumented GRAPE run shared by several tests."""
    from composer.core import Algorithm, Callback, Event
    from composer.loggers import InMemoryLogger

    from grape_stream.integrations.composer.trainer import build
    from grape_stream.recipe import load_recipe

    out = str(tmp_path_factory.mktemp("grape_run"))
    cfg = load_recipe(tiny_recipe(data_dir, out))
    snapshots: dict = {}
    checks: list = []
    batches: list = []

    class GradSnapshot(Algorithm):  # runs before GrapeAlgorithm at BATCH_END (list order)
        def match(self, event, state):
            return event == Event.BATCH_END

        def apply(self, event, state, logger):
            snapshots["grad"] = {n: p.grad.clone() for n, p in state.model.named_parameters() if p.grad is not None}
            snapshots["param"] = {n: p.detach().clone() for n, p in state.model.named_parameters()}
            opt = state.optimizers[0]
            snapshots["opt"] = {id(p): {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                                for g in opt.param_groups for p in g["params"] if p in opt.state}

    class GradCheck(Callback):  # callbacks run after the algorithms
        def batch_end(self, state, logger):
            same = all(torch.equal(p.grad, snapshots["grad"][n]) for n, p in state.model.named_parameters()
                       if p.grad is not None) and len(snapshots["grad"]) > 0
            params = all(torch.equal(p.detach(), snapshots["param"][n]) for n, p in state.model.named_parameters())
            opt = state.optimizers[0]
            ostate = all(torch.equal(v, snapshots["opt"][id(p)][k]) for g in opt.param_groups for p in g["params"]
                         if p in opt.state for k, v in opt.state[p].items() if torch.is_tensor(v))
            checks.append((int(state.timestamp.batch), same, params, ostate))

        def after_dataloader(self, state, logger):
            b = state.batch
            batches.append((int(state.timestamp.batch), b["domain"].tolist(), b["weights_version"].tolist()))

    mem = InMemoryLogger()
    built = build(cfg, extra_callbacks=[GradCheck()], extra_loggers=[mem])
    built.trainer.state.algorithms = [GradSnapshot()] + list(built.trainer.state.algorithms)
    built.trainer.fit()
    info = {"cfg": cfg, "out": os.path.join(out, "tiny"), "mem": mem, "checks": checks, "batches": batches,
            "schedule": built.mixer.weight_history, "history": copy.deepcopy(built.algorithm.controller.history),
            "built": built}
    yield info
    built.close()


def _series(mem, key):
    return [(int(ts.batch), float(v)) for ts, v in mem.data.get(key, [])]


def test_weights_move_are_logged_and_drive_the_mixer(grape_run):
    mem = grape_run["mem"]
    alpha = {d: _series(mem, f"grape/alpha/{d}") for d in ("d0", "d1", "d2")}
    assert [s for s, _ in alpha["d0"]] == [4, 8, 12, 16]
    for t in ("t0", "t1"):
        assert [s for s, _ in _series(mem, f"grape/z/{t}")] == [4, 8, 12, 16]
        assert len(_series(mem, f"grape/task_loss/{t}")) == 4
    assert _series(mem, "grape/alignment/d0/t1") and _series(mem, "grape/seconds/total")
    last = np.array([alpha[d][-1][1] for d in ("d0", "d1", "d2")])
    assert abs(last.sum() - 1) < 1e-9 and np.max(np.abs(last - 1 / 3)) > 1e-3  # moved (uniform stays at 1/3 exactly)
    # mu given without step_size: the paper's step eta = lr / mu at every update (lr from the scheduler)
    for rec in grape_run["built"].algorithm.controller.reweighter.history:
        assert rec["eta_alpha"] == pytest.approx(rec["lr"] / 3e-3) and rec["eta_z"] == pytest.approx(rec["lr"] / 3e-4)

    # The mixer switched at the batch after each update, and every batch was composed with the
    # weights of its version: systematic quotas give floor/ceil(B * alpha_k) samples per domain.
    sched = grape_run["schedule"]
    assert [e["from_batch"] for e in sched] == [0, 4, 8, 12, 16]
    np.testing.assert_allclose(sched[-1]["alpha"], last, atol=1e-12)
    by_version = {e["version"]: np.array(e["alpha"]) for e in sched}
    for step, domains, versions in grape_run["batches"]:
        assert len(set(versions)) == 1
        v = versions[0]
        assert v == step // 4  # batch b (0-based) is composed by the weights of the update after step b
        counts = np.bincount(domains, minlength=3)
        expected = 8 * by_version[v]
        assert np.all(np.abs(counts - expected) < 1 + 1e-9), (step, counts, expected)


def test_probe_leaves_grad_params_and_optimizer_state_untouched(grape_run):
    checks = grape_run["checks"]
    assert len(checks) == 16
    assert all(same and params and ostate for _, same, params, ostate in checks), checks


def test_evaluation_per_task_with_average_and_worst(grape_run):
    mem = grape_run["mem"]
    t0 = _series(mem, "metrics/t0/LanguageCrossEntropy")
    t1 = _series(mem, "metrics/t1/LanguageCrossEntropy")
    avg, worst = _series(mem, "metrics/grape/avg_log_ppl"), _series(mem, "metrics/grape/worst_log_ppl")
    assert [s for s, _ in t0] == [8, 16] and len(avg) == 2 and len(worst) == 2
    assert avg[-1][1] == pytest.approx((t0[-1][1] + t1[-1][1]) / 2, rel=1e-6)
    assert worst[-1][1] == pytest.approx(max(t0[-1][1], t1[-1][1]), rel=1e-6)
    assert _series(mem, "metrics/t0/LanguagePerplexity")[-1][1] == pytest.approx(np.exp(t0[-1][1]), rel=1e-4)


def test_trajectory_jsonl_png_and_metrics_files(grape_run):
    out = grape_run["out"]
    from grape_stream.grape.controller import load_trajectory

    meta, records = load_trajectory(os.path.join(out, "grape_trajectory.jsonl"))
    assert meta["domains"] == ["d0", "d1", "d2"] and meta["tasks"] == ["t0", "t1"]
    assert [r["step"] for r in records] == [0, 4, 8, 12, 16]
    assert records[-1]["alpha"] == grape_run["history"][-1]["alpha"]
    png = os.path.join(out, "grape_trajectory.png")
    assert os.path.getsize(png) > 10_000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"), encoding="utf-8")]
    assert any("grape/alpha/d0" in r for r in rows) and any("loss/train/total" in r for r in rows)


def test_schedule_method_replays_the_trajectory_in_a_trainer(grape_run, data_dir, tmp_path):
    from grape_stream.integrations.composer.trainer import build
    from grape_stream.recipe import load_recipe

    traj = os.path.join(grape_run["out"], "grape_trajectory.jsonl")
    cfg = load_recipe(tiny_recipe(data_dir, str(tmp_path), run_name="replay", algorithm={
        "method": "schedule", "schedule_path": traj}), ["data.tasks=[]"])
    built = build(cfg)
    try:
        built.trainer.fit()
        got = built.mixer.weight_history
    finally:
        built.close()
    want = grape_run["schedule"]
    assert [e["from_batch"] for e in got] == [e["from_batch"] for e in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a["alpha"], b["alpha"], atol=1e-12)


def _run(recipe: dict, path: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(recipe, f)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = _warm.run(os.path.join(HERE, "_grape_run.py"), path, *extra, cwd=REPO, env=env, timeout=400)
    if check and proc.returncode != 0:
        raise AssertionError(f"training subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def _losses(metrics_path: str) -> dict[int, float]:
    out = {}
    for line in open(metrics_path, encoding="utf-8"):
        row = json.loads(line)
        if "loss/train/total" in row:
            out[int(row["step"])] = row["loss/train/total"]  # a resumed run appends: the last value wins
    return out


def metric_rows(path) -> collections.Counter:
    """How many rows log each (step, metric name): a run resumed after a kill must match a straight one."""
    counts: collections.Counter = collections.Counter()
    for line in open(path, encoding="utf-8"):
        row = json.loads(line)
        counts.update((row["step"], k) for k in row if k != "step")
    return counts


def _trajectory(path: str) -> list:
    from grape_stream.grape.controller import load_trajectory

    _, records = load_trajectory(path)
    return [(r["step"], r["alpha"], r.get("z"), r.get("task_loss"), r.get("alignment")) for r in records]


def test_sigkill_then_autoresume_continues_the_same_trajectory(data_dir, tmp_path):
    trainer = {"max_duration": "16ba", "save_interval": "6ba", "autoresume": True,
               "save_folder": str(tmp_path / "{run_name}" / "ckpt")}
    base = tiny_recipe(data_dir, str(tmp_path), trainer=trainer, algorithm={"alpha_every": 3, "z_every": 3})
    straight = dict(base, run_name="straight")
    resumed = dict(base, run_name="resumed")

    _run(straight, str(tmp_path / "straight.json"))
    killed = _run(resumed, str(tmp_path / "resumed.json"), "--kill-at", "10", check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "resumed" / "ckpt"))  # the step-6 checkpoint exists
    before = _losses(str(tmp_path / "resumed" / "metrics.jsonl"))
    assert max(before) == 9  # the loss of batch index 9 (step 10) was logged: it died past the checkpoint at 6
    _run(resumed, str(tmp_path / "resumed.json"))

    a = _losses(str(tmp_path / "straight" / "metrics.jsonl"))
    b = _losses(str(tmp_path / "resumed" / "metrics.jsonl"))
    assert sorted(a) == list(range(16)) and sorted(b) == sorted(a)  # logged at the 0-based batch index
    assert [a[s] for s in sorted(a)] == [b[s] for s in sorted(a)]  # bit-identical losses, resumed or not
    # steps 6-9 ran twice, but every file the run writes holds them once, as a run never killed does
    straight_rows = metric_rows(tmp_path / "straight" / "metrics.jsonl")
    assert metric_rows(tmp_path / "resumed" / "metrics.jsonl") == straight_rows
    assert straight_rows[(7, "loss/train/total")] == 1
    ta = _trajectory(str(tmp_path / "straight" / "grape_trajectory.jsonl"))
    tb = _trajectory(str(tmp_path / "resumed" / "grape_trajectory.jsonl"))
    assert [r[0] for r in ta] == [0, 3, 6, 9, 12, 15]
    assert ta == tb


def test_trains_from_a_real_s3_server(data_dir, s3_bucket, tmp_path):
    import boto3

    from grape_stream.integrations.composer.trainer import build
    from grape_stream.recipe import load_recipe

    s3 = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    for dirpath, _, files in os.walk(data_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            s3.upload_file(path, s3_bucket, "mds/" + os.path.relpath(path, data_dir))
    remote = f"s3://{s3_bucket}/mds"
    cfg = load_recipe(tiny_recipe(data_dir, str(tmp_path), run_name="s3"), [
        f"data.remote={remote}", f"data.local={tmp_path / 'cache'}", "data.task_local=null",
        f"data.task_remote={remote}/tasks", "trainer.max_duration=24ba", "trainer.eval_interval=24ba",
    ])
    cfg["data"]["task_local"] = str(tmp_path / "task_cache")
    built = build(cfg)
    try:
        built.trainer.fit()
        sched = built.mixer.weight_history
        assert built.trainer.state.timestamp.batch.value == 24
    finally:
        built.close()
    assert [e["from_batch"] for e in sched] == [0, 4, 8, 12, 16, 20, 24]
    assert np.max(np.abs(np.array(sched[-1]["alpha"]) - 1 / 3)) > 1e-3  # moved (uniform stays at 1/3 exactly)
    assert os.path.exists(tmp_path / "cache" / "d0" / "train" / "index.json")  # really downloaded


def test_trainer_without_a_mixer_fails_with_a_clear_message(data_dir):
    from composer import Trainer

    from grape_stream.grape.tasks import TaskStream
    from grape_stream.integrations.composer import ComposerGPT, GrapeAlgorithm
    from grape_stream.models import GPT, GPTConfig

    model = ComposerGPT(GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=16, d_ff=32)))
    loader = torch.utils.data.DataLoader([{"tokens": torch.randint(1, VOCAB, (SEQ,))} for _ in range(8)], batch_size=4)
    algo = GrapeAlgorithm(tasks=[TaskStream("t0", local=os.path.join(data_dir, "tasks", "t0"))])
    trainer = Trainer(model=model, train_dataloader=loader, max_duration="2ba", algorithms=[algo], device="cpu",
                      log_to_console=False, progress_bar=False)
    with pytest.raises(RuntimeError, match="WeightedStreamingMixer"):
        trainer.fit()
    trainer.close()


def test_composer_gpt_loss_is_the_mean_per_sample_loss():
    from grape_stream.integrations.composer import ComposerGPT
    from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=16, d_ff=32))
    model = ComposerGPT(gpt)
    batch = {"tokens": torch.randint(1, VOCAB, (3, SEQ)), "loss_mask": torch.ones(3, SEQ, dtype=torch.uint8)}
    batch["loss_mask"][0, 20:] = 0
    loss = model.loss(model(batch), batch)
    assert torch.allclose(loss, per_sample_lm_loss(gpt, batch).mean(), atol=1e-6)
    assert torch.allclose(model.per_sample_loss(batch), per_sample_lm_loss(gpt, batch), atol=1e-6)



@pytest.mark.parametrize("kind", ["gpt", "hf", "hf-wrapper-llama", "hf-wrapper-gpt2"])
def test_composer_probe_runs_the_head_in_chunks(kind):
    """GrapeAlgorithm's default probe loss for ComposerGPT (our GPT, or a recipe's transformers LM) and for
    a ComposerModel wrapping a transformers LM (Composer's HuggingFaceModel; llm-foundry's
    ComposerHFCausalLM has the same shape) takes the chunked head inside group_gram (no logits of the
    whole probe), and stays exact."""
    from _alignment_helpers import lm_groups, rel_err, truth_gram
    from grape_stream.grape.gram.group_gram import group_gram
    from grape_stream.integrations.composer import ComposerGPT
    from grape_stream.integrations.composer.model import composer_per_sample_loss
    from grape_stream.models import GPT, GPTConfig
    from grape_stream.recipe.model import HFTokensToLogits
    from grape_stream.testing.families import FamilySize, build_family

    if kind == "gpt":
        module = GPT(GPTConfig(vocab_size=300, seq_len=16, n_layer=1, n_head=2, d_model=16, d_ff=32)).double()
        model, head = ComposerGPT(module.eval()), "model.tok_emb.weight"
    elif kind == "hf":
        lm, _, _ = build_family("hf-llama", FamilySize(vocab=300, seq=16), torch.float64, seed=1)
        model, head = ComposerGPT(HFTokensToLogits(lm).eval()), "model.lm.lm_head.weight"
    else:
        from composer.models import HuggingFaceModel

        lm, _, _ = build_family(kind.removeprefix("hf-wrapper-").replace("llama", "hf-llama").replace(
            "gpt2", "hf-gpt2"), FamilySize(vocab=300, seq=16), torch.float64, seed=1)
        model = HuggingFaceModel(lm.eval(), tokenizer=None, use_logits=True)
        head = "model.lm_head.weight" if kind.endswith("llama") else "model.transformer.wte.weight"
    groups = lm_groups([2, 3, 1, 2])
    want, _ = truth_gram(model, composer_per_sample_loss, groups)
    gram, _, info = group_gram(model, composer_per_sample_loss, groups, return_info=True)
    assert rel_err(gram, want) <= 1e-10
    assert "head" in info.fast_path[head] and info.timings["head_s"] > 0
    assert not info.fallback_params

@pytest.mark.parametrize("family", ["mpt", "hf-llama"])
def test_a_prebuilt_model_trains_with_grape_on_the_fused_probe(data_dir, tmp_path, family):
    """build(cfg, model=...): a decoder the recipe cannot name (the MPT copy, a plain tokens -> logits
    module; HF Llama, a transformers PreTrainedModel) trains in a real Composer fit with method=grape, the
    probe uses the per_sample_loss given to build, every parameter takes a fast path (no fallback warning)
    and GRAPE's weights move."""
    import warnings

    from grape_stream.integrations.composer import build, composer_per_sample_loss
    from grape_stream.recipe import load_recipe
    from grape_stream.testing.families import FamilySize, build_family

    model, _, source = build_family(family, FamilySize(d_model=32, n_layer=2, n_head=2, vocab=VOCAB, seq=SEQ),
                                    dtype=torch.float32, seed=3, real_mpt=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []

    def loss(m, batch):
        calls.append(len(batch["tokens"]))
        return composer_per_sample_loss(m, batch)

    cfg = load_recipe(tiny_recipe(data_dir, str(tmp_path), trainer={"max_duration": "8ba", "eval_interval": "100ba"}))
    built = build(cfg, model=model.train(), per_sample_loss=loss)
    assert built.describe()["model"].startswith(f"prebuilt {type(model).__name__}")
    assert built.model.model is model or built.model.model.lm is model  # plain module, or HF causal LM adapted
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", message="group_gram")
            built.trainer.fit()
        history = built.algorithm.controller.history
    finally:
        built.close()
    assert not [str(w.message) for w in caught if "exact fallback" in str(w.message)], source
    updates = [r for r in history if not r.get("initial")]
    assert [r["step"] for r in updates] == [4, 8]
    assert len(calls) >= 2 and sum(calls) >= 2 * (3 + 2) * 4  # K=3 + N=2 groups of 4 samples, per update
    alpha = np.array(updates[-1]["alpha"])
    assert abs(alpha.sum() - 1) < 1e-9 and np.max(np.abs(alpha - 1 / 3)) > 1e-4
    assert all(np.isfinite(np.array(r["alignment"])).all() for r in updates)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())  # it trained
