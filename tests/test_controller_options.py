"""The controller's options beyond the paper, against independent slow computations on real MDS data.

``geometry="adam"``: the Gram must equal the one of explicit per-group autograd gradients weighted by
AdamW's 1 / (sqrt(v_hat) + eps), with v_hat computed here from the optimizer's state by hand (float64
model, 1e-8). ``probe_rse``: the full Gram assembled from half-probes must equal the explicit Gram of the
whole groups, the measured relative standard error must equal the formula evaluated on explicit vectors,
the size rule must move the next probe, and all of it must survive a weights-only checkpoint exactly.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from _grape_data import SEQ, VOCAB, write_dataset
from grape_stream.grape.controller import GrapeController
from grape_stream.grape.probe_size import ProbeSizer, relative_standard_error
from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss

DOMAINS = ["d0", "d1", "d2"]
K, N = 3, 2


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("ctl_opt_data"))
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=128, n_val=24, n_test=16)
    return root


_OPEN: list = []


@pytest.fixture(autouse=True)
def _close_mixers():
    yield
    while _OPEN:
        _OPEN.pop().close()


def _controller(root: str, **kw) -> GrapeController:
    from grape_stream.grape.tasks import TaskStream
    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

    m = WeightedStreamingMixer(domains=[DomainStream(d, local=os.path.join(root, d), split="train") for d in DOMAINS],
                               batch_size=8, seed=0)
    _OPEN.append(m)
    tasks = [TaskStream(f"t{i}", local=os.path.join(root, "tasks", f"t{i}")) for i in range(N)]
    opts = dict(method="grape", alpha_every=1, z_every=1, probe_domain_batch=4, probe_task_batch=4, seed=3,
                mu_alpha=1e-3, mu_z=5e-4)
    return GrapeController(m, tasks, **{**opts, **kw})


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=32, d_ff=64)).double()


def _trained(steps: int, amsgrad: bool = False) -> tuple[GPT, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, amsgrad=amsgrad)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        per_sample_lm_loss(model, {"tokens": torch.randint(1, VOCAB, (4, SEQ), generator=g)}).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _grad_vectors(model, groups) -> tuple[torch.Tensor, np.ndarray]:
    params = [p for p in model.parameters() if p.requires_grad]
    vecs, losses = [], []
    for g in groups:
        loss = per_sample_lm_loss(model, g).mean()
        vecs.append(torch.cat([x.reshape(-1) for x in torch.autograd.grad(loss, params)]).double())
        losses.append(loss.item())
    return torch.stack(vecs), np.array(losses)


def _adam_weights(model, opt, amsgrad: bool = False) -> torch.Tensor:
    """1 / (sqrt(v / (1 - beta2^t)) + eps), flattened in parameter order, from the state by hand."""
    out = []
    for p in model.parameters():
        st = opt.state[p]
        t = int(st["step"])
        v = st["max_exp_avg_sq"] if amsgrad else st["exp_avg_sq"]
        out.append((1.0 / (torch.sqrt(v.double() / (1.0 - 0.95**t)) + 1e-8)).reshape(-1))
    return torch.cat(out)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_geometry_equals_explicit_preconditioned_gradients(data_dir, amsgrad):
    model, opt = _trained(3, amsgrad)
    ctl = _controller(data_dir, geometry="adam")
    groups = [{k: v for k, v in g.items()} for g in ctl.probe_batches(5)]
    rec = ctl.maybe_update(model, 5, lr=1e-3, optimizer=opt)
    assert rec["geometry"] == "adam"
    V, losses = _grad_vectors(model, groups)
    w = _adam_weights(model, opt, amsgrad)
    want = ((V * w) @ V.T).numpy()
    got_align, got_diag = np.array(rec["alignment"]), np.array(rec["gram_diag"])
    np.testing.assert_allclose(got_align, want[:K, K:], rtol=1e-8, atol=0)
    np.testing.assert_allclose(got_diag, np.diag(want), rtol=1e-8, atol=0)
    np.testing.assert_allclose(rec["task_loss"], losses[K:], rtol=1e-10)
    plain = (V @ V.T).numpy()
    assert np.max(np.abs(want[:K, K:] - plain[:K, K:]) / np.abs(plain[:K, K:])) > 0.1  # not the SGD Gram


def test_adam_geometry_before_the_first_step_falls_back_to_sgd_and_says_so(data_dir):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = _controller(data_dir, geometry="adam")
    groups = ctl.probe_batches(1)
    rec = ctl.maybe_update(model, 1, lr=1e-3, optimizer=opt)
    assert rec["geometry"].startswith("sgd: the optimizer has no second moment yet")
    V, _ = _grad_vectors(model, groups)
    np.testing.assert_allclose(np.array(rec["alignment"]), (V @ V.T).numpy()[:K, K:], rtol=1e-8, atol=0)


def test_adam_geometry_errors_are_one_clear_line(data_dir):
    model = _model()
    ctl = _controller(data_dir, geometry="adam")
    with pytest.raises(ValueError, match="geometry='adam' needs the optimizer"):
        ctl.maybe_update(model, 1, lr=1e-3)
    with pytest.raises(ValueError, match="needs an Adam-family optimizer.*got SGD"):
        ctl.maybe_update(model, 2, lr=1e-3, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="geometry must be 'sgd'"):
        _controller(data_dir, geometry="lion")


def _reference_rse(model, groups, alpha, z) -> tuple[np.ndarray, float]:
    """Explicit vectors: the whole groups' Gram, and sigma / S of the centred GRAPE domain score."""
    whole, _ = _grad_vectors(model, groups)
    halves = [[{k: v[: len(v) // 2] for k, v in g.items()} for g in groups],
              [{k: v[len(v) // 2:] for k, v in g.items()} for g in groups]]

    def score(V: torch.Tensor, losses: np.ndarray) -> np.ndarray:
        A = (V[:K] @ V[K:].T).numpy()
        return (A / losses[K:][None, :]) @ z

    b_parts = [score(*_grad_vectors(model, h)) for h in halves]
    b = score(whole, _grad_vectors(model, groups)[1])
    c = [x - x.mean() for x in (b, *b_parts)]
    noise = np.mean((c[1] - c[2]) ** 2) / 4
    return (whole @ whole.T).numpy(), noise, max(np.mean(c[0] ** 2) - noise, 0.0)


def test_probe_size_from_variance_matches_explicit_computation_and_resumes_exactly(data_dir, tmp_path):
    model, _ = _trained(20)
    kw = dict(probe_rse=0.05, probe_batch_bounds=[2, 16])
    ctl = _controller(data_dir, **kw)
    groups = ctl.probe_batches(1)
    assert [len(g["tokens"]) for g in groups] == [4] * (K + N)
    alpha0, z0 = ctl.alpha, ctl.z
    rec = ctl.maybe_update(model, 1, lr=1e-3)
    want_gram, noise, signal = _reference_rse(model, groups, alpha0, z0)
    np.testing.assert_allclose(np.array(rec["alignment"]), want_gram[:K, K:], rtol=1e-8, atol=1e-12)
    assert rec["probe_batch"] == [4, 4]
    assert rec["probe_noise_var"] == pytest.approx(noise, rel=1e-6) and noise > 0
    assert rec["probe_signal_var"] == pytest.approx(signal, rel=1e-6, abs=1e-12 * noise)
    # random tokens: no signal above the noise here, so the rse is inf (None in the record) and the probe grows
    want_rse = math.sqrt(noise / signal) if signal > 0 else math.inf
    assert rec["probe_rse"] == (None if math.isinf(want_rse) else pytest.approx(want_rse, rel=1e-6))
    factor = min(2.0, max(0.5, (want_rse / 0.05) ** 2))
    expect = min(16, max(2, 2 * round(4 * factor / 2)))
    assert rec["next_probe_batch"] == [expect, expect] and expect != 4
    assert [len(g["tokens"]) for g in ctl.probe_batches(2)] == [expect] * (K + N)

    ctl.maybe_update(model, 2, lr=1e-3)
    torch.save(ctl.state_dict(), tmp_path / "ctl.pt")
    resumed = _controller(data_dir, **kw)
    resumed.load_state_dict(torch.load(tmp_path / "ctl.pt", weights_only=True))
    a, b = ctl.maybe_update(model, 3, lr=1e-3), resumed.maybe_update(model, 3, lr=1e-3)
    assert a["probe_batch"] == b["probe_batch"] and a["next_probe_batch"] == b["next_probe_batch"]
    assert a["alpha"] == b["alpha"] and a["z"] == b["z"] and a["probe_rse"] == b["probe_rse"]


def test_probe_size_rule_and_its_bounds():
    s = ProbeSizer(0.5, 8, 4, bounds=(4, 32))
    assert s.next_sizes(1.0) == (16, 8)  # (1.0 / 0.5)^2 = 4, limited to 2x per update
    assert s.next_sizes(0.5) == (16, 8)  # on target: unchanged
    assert s.next_sizes(0.3) == (8, 4)  # 0.36: shrink, but by at most 2x, and kept >= 4
    assert s.next_sizes(0.4) == (6, 4)  # 0.64 (rounded to even)
    assert s.next_sizes(math.inf) == (12, 8)  # no signal left: grow
    assert s.next_sizes(100.0) == (24, 16) and s.next_sizes(100.0) == (32, 32)  # capped at the upper bound
    for bad, fragment in [({"target_rse": 0}, "probe_rse must be a number > 0"),
                          ({"bounds": (3, 8)}, "two even numbers"),
                          ({"domain_batch": 7}, "probe_domain_batch must be even")]:
        args = {"target_rse": 0.5, "domain_batch": 8, "task_batch": 4, "bounds": (4, 32), **bad}
        with pytest.raises(ValueError, match=fragment):
            ProbeSizer(**args)


def test_relative_standard_error_by_hand():
    # centred halves [1, -1] and [1.2, -1.2]: sigma^2 = mean(0.2^2) / 4 = 0.01; b = [1.1, -1.1] (+ a shift the
    # softmax ignores): S^2 = 1.21 - 0.01 = 1.2
    rse, noise, signal = relative_standard_error(np.array([3.1, 0.9]), np.array([1.0, -1.0]), np.array([2.2, -0.2]))
    assert noise == pytest.approx(0.01) and signal == pytest.approx(1.2) and rse == pytest.approx(math.sqrt(0.01 / 1.2))
    assert relative_standard_error(np.zeros(3), np.ones(3), np.array([0.0, 1.0, 2.0]))[0] == math.inf


def test_defaults_record_nothing_new(data_dir):
    ctl = _controller(data_dir)
    rec = ctl.maybe_update(_model(), 1, lr=1e-3)
    assert not {"geometry", "probe_rse", "probe_batch"} & set(rec) and "probe_size" not in ctl.state_dict()
    assert not {"geometry", "probe_rse"} & set(ctl.meta())


def test_recipe_fields_reach_the_controller(data_dir):
    from grape_stream.integrations.composer.algorithm import GrapeAlgorithm
    from grape_stream.recipe import load_config

    cfg = load_config("demo-cpu", ["algorithm.geometry=adam", "algorithm.probe_rse=0.3",
                                   "algorithm.probe_batch_bounds=[2,16]", "algorithm.options.alignment=cosine",
                                   "algorithm.options.gram_ema=0.5", "algorithm.options.alpha_ema=0.2"])
    algo = GrapeAlgorithm(cfg.algorithm)  # the recipe's typed section, handed over as it is
    c = algo.config
    assert c is cfg.algorithm
    assert (c.probe_mode, c.geometry, c.probe_rse, c.probe_batch_bounds) == ("sharded", "adam", 0.3, [2, 16])
    assert {k: algo.reweighter_options[k] for k in ("alignment", "gram_ema", "alpha_ema")} == \
        {"alignment": "cosine", "gram_ema": 0.5, "alpha_ema": 0.2}
    ctl = _controller(data_dir, config=cfg.algorithm, probe_domain_batch=4, probe_task_batch=4)  # where they act
    assert ctl.probe.meta() == {"geometry": "adam", "probe_rse": 0.3, "probe_batch_bounds": [2, 16]}
    assert {k: ctl.reweighter.options[k] for k in ("alignment", "gram_ema", "alpha_ema")} == \
        {"alignment": "cosine", "gram_ema": 0.5, "alpha_ema": 0.2}
    plain = GrapeAlgorithm(load_config("demo-cpu", []).algorithm)  # defaults = the paper: nothing new is passed
    assert (plain.config.geometry, plain.config.probe_rse) == ("sgd", None)
    assert not {"alignment", "gram_ema", "alpha_ema"} & set(plain.reweighter_options)


@pytest.mark.integration
def test_sigkill_then_autoresume_with_every_option_continues_the_same_trajectory(tmp_path):
    """Composer Trainer, SIGKILL past a checkpoint, autoresume: with Adam geometry, the probe-size rule, cosine
    alignments and both EMAs on, the resumed run's losses and trajectory equal the uninterrupted run's."""
    from test_composer import _losses, _run, tiny_recipe

    data = str(tmp_path / "data")
    write_dataset(data, domains=3, tasks=(0, 2), n_domain=160, n_val=24, n_test=16)
    trainer = {"max_duration": "16ba", "save_interval": "6ba", "autoresume": True,
               "save_folder": str(tmp_path / "{run_name}" / "ckpt")}
    algorithm = {"alpha_every": 3, "z_every": 3, "geometry": "adam", "probe_rse": 0.3, "probe_batch_bounds": [2, 8],
                 "options": {"alignment": "cosine", "gram_ema": 0.5, "alpha_ema": 0.3}}
    base = tiny_recipe(data, str(tmp_path), trainer=trainer, algorithm=algorithm)
    _run(dict(base, run_name="straight"), str(tmp_path / "straight.json"))
    killed = _run(dict(base, run_name="resumed"), str(tmp_path / "resumed.json"), "--kill-at", "10", check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    _run(dict(base, run_name="resumed"), str(tmp_path / "resumed.json"))

    a = _losses(str(tmp_path / "straight" / "metrics.jsonl"))
    b = _losses(str(tmp_path / "resumed" / "metrics.jsonl"))
    assert sorted(a) == list(range(16)) and [a[s] for s in sorted(a)] == [b[s] for s in sorted(a)]
    from grape_stream.grape.controller import load_trajectory

    keys = ("step", "alpha", "z", "alignment", "geometry", "probe_batch", "probe_rse", "next_probe_batch")
    paths = [str(tmp_path / run / "grape_trajectory.jsonl") for run in ("straight", "resumed")]
    ta, tb = ([tuple(r.get(k) for k in keys) for r in load_trajectory(p)[1]] for p in paths)
    assert [r[0] for r in ta] == [0, 3, 6, 9, 12, 15] and ta == tb
    assert {r[4] for r in ta[1:]} == {"adam"} and all(r[5] is not None for r in ta[1:])
