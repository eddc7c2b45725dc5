"""Where an update's numbers come from: one capability per method class, one resolver per config, one source per
controller, and checkpoints written with the entries older releases wrote (``instep``, ``training_losses``) load
and drive the next update. Real MDS shards and the real mixer; the expected weights computed here by hand."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

from _grape_data import write_dataset
from grape_stream.config import AlgorithmConfig
from grape_stream.config.choices import Signal
from grape_stream.errors import ConfigError
from grape_stream.grape.algorithm_config import check_algorithm, signal_source
from grape_stream.grape.controller import GrapeController
from grape_stream.grape.instep_gram import STEP_GRAM_FORMAT, StepGramMode
from grape_stream.grape.instep_mode import InstepMode
from grape_stream.grape.loss_mode import LossMode
from grape_stream.grape.probe_signal import ProbeSignal, QuietSignal
from grape_stream.grape.reweighting import (
    REWEIGHTERS,
    DomainLosses,
    Reweighter,
    build_reweighter,
    method_needs_probe,
    method_signal,
    register,
)
from grape_stream.grape.tasks import TaskStream

DOMAINS = ["d0", "d1", "d2"]
#: the methods that do not read the probe, by name (every other registered method probes)
NOT_PROBING = {"uniform": Signal.none, "static": Signal.none, "rnb": Signal.step_gram,
               "doremi": Signal.training_losses, "odm": Signal.training_losses, "ado": Signal.training_losses}
#: the entries a controller's state had before grape.signal (a source's own entry comes on top)
OLD_KEYS = {"format", "method", "domains", "tasks", "reweighter", "schedule_index", "num_updates", "history",
            "history_dropped"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("signal_data"))
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=64, n_val=16, n_test=8)
    return root


@pytest.fixture
def mixers():
    opened: list = []
    yield opened
    for m in opened:
        m.close()


def _controller(root: str, mixers: list, tasks: bool = True, **kw) -> GrapeController:
    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

    m = WeightedStreamingMixer(domains=[DomainStream(d, local=os.path.join(root, d), split="train") for d in DOMAINS],
                               batch_size=8, seed=0)
    mixers.append(m)
    ts = [TaskStream(f"t{i}", local=os.path.join(root, "tasks", f"t{i}")) for i in range(2)] if tasks else []
    return GrapeController(m, ts, **kw)


# ---------------------------------------------------------------------------------------------------- the resolver
@pytest.mark.parametrize("method", list(REWEIGHTERS))
def test_the_resolver_agrees_with_each_registered_class(method):
    want = NOT_PROBING.get(method, Signal.probe)
    assert REWEIGHTERS[method].signal is want
    assert signal_source(AlgorithmConfig(method=method)) is want
    assert method_signal(method) is want and method_needs_probe(method) == (want is Signal.probe)
    steps = AlgorithmConfig(method=method, alignments="steps")
    if want is Signal.training_losses:  # refused: these read losses, not alignments
        with pytest.raises(ConfigError, match="alignments: steps does not apply"):
            check_algorithm(steps)
    else:  # steps turns the probe into step alignments; a method that reads no probe keeps its own signal
        check_algorithm(steps)
        assert signal_source(steps) is (Signal.step_alignments if want is Signal.probe else want)


def test_schedule_is_replay_and_the_capabilities():
    assert signal_source(AlgorithmConfig(method="schedule", schedule_path="t.jsonl")) is Signal.replay
    table = {s: (s.probes_tasks, s.reads_step_gradients, s.reads_training_losses, s.watches_steps) for s in Signal}
    assert table == {Signal.none: (False, False, False, False), Signal.probe: (True, False, False, False),
                     Signal.step_alignments: (True, True, False, True), Signal.step_gram: (False, True, False, True),
                     Signal.training_losses: (False, False, True, True), Signal.replay: (False, False, False, False)}


def test_a_class_with_the_old_flags_is_refused_naming_signal():
    class _Old(Reweighter):
        method = "old_flags_test"
        needs_training_losses = True

    with pytest.raises(TypeError, match="signal = Signal"):
        register(_Old)
    assert "old_flags_test" not in REWEIGHTERS


# ---------------------------------------------------------------------------------------------------- the controller
@pytest.mark.parametrize("kw, source", [
    ({"method": "grape"}, ProbeSignal), ({"method": "doge"}, ProbeSignal), ({"method": "uniform"}, QuietSignal),
    ({"method": "grape", "alignments": "steps"}, InstepMode), ({"method": "rnb"}, StepGramMode),
    ({"method": "odm"}, LossMode),
])
def test_the_controller_builds_the_resolved_source_without_holding_itself(data_dir, mixers, kw, source):
    ctl = _controller(data_dir, mixers, **kw)
    assert type(ctl.signal) is source and ctl.signal.kind is signal_source(ctl.config)
    assert all(v is not ctl for v in vars(ctl.signal).values())  # no back-reference: explicit parts only
    parts = getattr(ctl.signal, "parts", None)
    if parts is not None:
        assert parts.reweighter is ctl.reweighter and list(parts.domain_names) == DOMAINS
        assert all(v is not ctl for v in vars(parts).values())


def test_a_probing_method_without_tasks_is_refused(data_dir, mixers):
    with pytest.raises(ConfigError, match="needs at least one target task"):
        _controller(data_dir, mixers, tasks=False, method="grape", alignments="steps")
    assert _controller(data_dir, mixers, tasks=False, method="rnb").signal.kind is Signal.step_gram


# ---------------------------------------------------------------------------------------------------- old checkpoints
def test_an_old_training_losses_entry_loads_and_drives_the_update(data_dir, mixers):
    ctl = _controller(data_dir, mixers, tasks=False, method="odm", alpha_every=4)
    fresh = ctl.state_dict()
    assert set(fresh) == OLD_KEYS | {"training_losses"}
    totals = torch.tensor([[6.0, 2.0, 9.0], [3.0, 1.0, 4.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    old = {**fresh, "training_losses": {"totals": totals, "steps": 3}}  # the entry as LossMode has always written it
    ctl.load_state_dict(old)
    loaded = ctl.signal.state_dict()
    assert torch.equal(loaded["totals"], totals) and loaded["steps"] == 3
    rec = ctl.maybe_update(nn.Linear(2, 2), 4, lr=1e-3)
    assert rec is not None and rec["domain_loss"] == [2.0, 2.0, 2.25] and rec["loss_steps"] == 3
    want = build_reweighter("odm", 3, 1)
    want.update_from_losses(DomainLosses(loss=np.array([2.0, 2.0, 2.25]), samples=np.array([3.0, 1.0, 4.0]),
                                         steps=3), 1e-3, step=4)
    np.testing.assert_allclose(rec["alpha"], want.alpha, rtol=1e-12)
    assert float(ctl.signal.state_dict()["totals"].abs().sum()) == 0.0  # the interval starts again


def test_an_old_instep_entry_of_rnb_loads_and_drives_the_update(data_dir, mixers):
    ctl = _controller(data_dir, mixers, tasks=False, method="rnb", alpha_every=4, alignment_steps=2)
    fresh = ctl.state_dict()
    assert set(fresh) == OLD_KEYS | {"instep"}
    sums = {"w": torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 1.0], [2.0, 2.0, 0.0]], dtype=torch.float64)}
    weights = torch.tensor([2.0, 1.0, 4.0], dtype=torch.float64)
    old = {**fresh, "instep": {"format": STEP_GRAM_FORMAT, "observed_steps": 2, "weights": weights,
                               "samples": torch.tensor([2.0, 1.0, 4.0], dtype=torch.float64), "sums": sums}}
    ctl.load_state_dict(old)
    assert torch.equal(ctl.signal.state_dict()["sums"]["w"], sums["w"])  # kept by name until a model is seen
    rec = ctl.maybe_update(nn.Linear(2, 2), 4, lr=1e-3)
    a = sums["w"].numpy() / weights.numpy()[:, None]
    gram = a @ a.T
    np.testing.assert_allclose(rec["domain_gram"], gram, rtol=1e-12)
    exponent = ctl.reweighter.options["rnb_lambda"] * gram.mean(axis=1) / np.linalg.norm(gram.mean(axis=1))
    np.testing.assert_allclose(rec["alpha"], np.exp(exponent) / np.exp(exponent).sum(), rtol=1e-10)


def test_an_old_instep_entry_of_step_alignments_loads(data_dir, mixers):
    ctl = _controller(data_dir, mixers, method="grape", alignments="steps", alpha_every=4, z_every=4,
                      alignment_steps=2)
    fresh = ctl.state_dict()
    assert set(fresh) == OLD_KEYS | {"instep"}
    totals = {k: torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) * (i + 1)
              for i, k in enumerate(("sums", "weights", "samples", "sq", "cross", "wsq"))}
    ctl.load_state_dict({**fresh, "instep": {"engine": None, "observed_steps": 1, "totals": totals}})
    got = ctl.signal.state_dict()
    assert got["observed_steps"] == 1 and all(torch.equal(got["totals"][k], v) for k, v in totals.items())
    b, _ = ctl.signal.domain_scores()  # type: ignore[attr-defined]  # (InstepMode's own)
    np.testing.assert_allclose(b, [0.5, 0.5, 0.5])
    assert ctl.meta()["alignments"] == "steps" and ctl.meta()["alignment_steps"] == 2
