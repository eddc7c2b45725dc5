"""GrapeController against independent computations, on real MDS data and the real mixer.

The controller's update is checked against a slow, explicit computation (one autograd gradient per probe
group, flattened, inner products, a freshly built reweighter); `.grad` must stay bit-identical; the state
must survive torch.save/torch.load(weights_only=True) and continue identically; a recorded trajectory
must replay; FSDP must be refused with a clear message.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from _grape_data import SEQ, VOCAB, write_dataset
from grape_stream.config.choices import Signal
from grape_stream.grape.controller import GrapeController, filter_reweighter_options, load_trajectory
from grape_stream.grape.reweighting import build_reweighter
from grape_stream.grape.tasks import TaskStream, probe_indices
from grape_stream.models import GPT, GPTConfig, per_sample_lm_loss

DOMAINS = ["d0", "d1", "d2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("ctl_data"))
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=128, n_val=24, n_test=16)
    return root


_OPEN: list = []


@pytest.fixture(autouse=True)
def _close_mixers():
    yield
    while _OPEN:
        _OPEN.pop().close()


def _mixer(root: str, **kw):
    from grape_stream.mixing.mixer import DomainStream, WeightedStreamingMixer

    m = WeightedStreamingMixer(
        domains=[DomainStream(d, local=os.path.join(root, d), split="train") for d in DOMAINS],
        batch_size=8, seed=kw.pop("seed", 0), **kw,
    )
    _OPEN.append(m)
    return m


def _tasks(root: str) -> list[TaskStream]:
    return [TaskStream(f"t{i}", local=os.path.join(root, "tasks", f"t{i}")) for i in range(2)]


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=32, d_ff=64))


def _explicit_gram(model, groups):
    params = [p for p in model.parameters() if p.requires_grad]
    vecs, losses = [], []
    for g in groups:
        loss = per_sample_lm_loss(model, g).mean()
        grads = torch.autograd.grad(loss, params)
        vecs.append(torch.cat([x.reshape(-1) for x in grads]).double())
        losses.append(loss.item())
    V = torch.stack(vecs)
    return (V @ V.T).numpy(), np.array(losses)


def test_update_matches_explicit_gradients_and_reweighter(data_dir):
    mixer = _mixer(data_dir)
    ctl = GrapeController(mixer, _tasks(data_dir), method="grape", alpha_every=5, z_every=5,
                          probe_domain_batch=4, probe_task_batch=4, seed=3, mu_alpha=1e-3, mu_z=5e-4)
    model = _model()
    assert ctl.maybe_update(model, 3, lr=1e-3) is None  # not due
    groups = ctl.probe_batches(5)
    rec = ctl.maybe_update(model, 5, lr=1e-3)
    assert rec is not None and rec["step"] == 5

    gram, losses = _explicit_gram(model, groups)
    ref = build_reweighter("grape", num_domains=3, num_tasks=2, mu_alpha=1e-3, mu_z=5e-4)
    alpha, z = ref.update(gram, losses[3:], 1e-3)
    np.testing.assert_allclose(np.array(rec["alignment"]), gram[:3, 3:], rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(rec["task_loss"], losses[3:], rtol=1e-5)
    np.testing.assert_allclose(rec["alpha"], alpha, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(rec["z"], z, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(mixer.weights, rec["alpha"], rtol=0, atol=1e-12)
    assert not np.allclose(rec["alpha"], 1 / 3)  # the weights moved

    # Probes are a function of (seed, step): the same on a second call, different at another step.
    again = ctl.probe_batches(5)
    for a, b in zip(groups, again):
        assert torch.equal(a["tokens"], b["tokens"])
    assert not torch.equal(ctl.probe_batches(10)[3]["tokens"], groups[3]["tokens"])


def test_probe_leaves_grad_and_mode_untouched(data_dir):
    mixer = _mixer(data_dir)
    ctl = GrapeController(mixer, _tasks(data_dir), alpha_every=1, z_every=1, probe_domain_batch=4,
                          probe_task_batch=4, mu_alpha=1e-3, mu_z=5e-4)
    model = _model()
    model.train()
    batch = {"tokens": torch.randint(1, VOCAB, (4, SEQ))}
    per_sample_lm_loss(model, batch).mean().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng_before = torch.get_rng_state()
    assert ctl.maybe_update(model, 1, lr=1e-3) is not None
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n  # bit-identical
        assert torch.equal(p.detach(), params_before[n]), n
    assert model.training
    assert torch.equal(torch.get_rng_state(), rng_before)  # the probe does not advance the training RNG


def test_state_dict_weights_only_roundtrip_continues_identically(data_dir, tmp_path):
    model = _model()
    kw = dict(method="grape_ema", alpha_every=2, z_every=2, probe_domain_batch=4, probe_task_batch=4, seed=1,
              mu_alpha=1e-3, mu_z=5e-4)
    a = GrapeController(_mixer(data_dir), _tasks(data_dir), **kw)
    for step in (1, 2, 3, 4):
        a.maybe_update(model, step, lr=1e-3)
    path = tmp_path / "ctl.pt"
    torch.save(a.state_dict(), path)
    state = torch.load(path, weights_only=True)

    b = GrapeController(_mixer(data_dir), _tasks(data_dir), **kw)
    b.load_state_dict(state)
    ra, rb = a.maybe_update(model, 6, lr=1e-3), b.maybe_update(model, 6, lr=1e-3)
    assert ra["alpha"] == rb["alpha"] and ra["z"] == rb["z"]
    assert [r["step"] for r in b.history] == [0, 2, 4, 6]

    kw_doge = {k: v for k, v in kw.items() if k != "mu_z"}
    c = GrapeController(_mixer(data_dir), _tasks(data_dir), **{**kw_doge, "method": "doge"})
    with pytest.raises(ValueError, match="method"):
        c.load_state_dict(state)


def test_alpha_and_z_on_different_periods(data_dir):
    ctl = GrapeController(_mixer(data_dir), _tasks(data_dir), alpha_every=2, z_every=3, probe_domain_batch=4,
                          probe_task_batch=4, mu_alpha=1e-3, mu_z=5e-4)
    model = _model()
    r2 = ctl.maybe_update(model, 2, lr=1e-3)
    assert r2["updated"] == {"alpha": True, "z": False} and r2["z"] == [0.5, 0.5]
    r3 = ctl.maybe_update(model, 3, lr=1e-3)
    assert r3["updated"] == {"alpha": False, "z": True}
    assert r3["alpha"] == r2["alpha"] and r3["z"] != [0.5, 0.5]
    assert ctl.maybe_update(model, 5, lr=1e-3) is None


def test_uniform_draws_no_probe_and_keeps_weights(data_dir):
    mixer = _mixer(data_dir, weights=[0.5, 0.3, 0.2])
    ctl = GrapeController(mixer, [], method="uniform", alpha_every=2, z_every=2)
    assert ctl.signal.kind is Signal.none
    rec = ctl.maybe_update(_model(), 2, lr=1e-3)
    assert rec["alpha"] == pytest.approx([1 / 3] * 3) and "alignment" not in rec
    np.testing.assert_allclose(mixer.weights, [1 / 3] * 3)  # the controller's initial weights win


def test_schedule_replays_a_recorded_trajectory(data_dir, tmp_path):
    model = _model()
    rec_ctl = GrapeController(_mixer(data_dir), _tasks(data_dir), alpha_every=2, z_every=2, probe_domain_batch=4,
                              probe_task_batch=4, mu_alpha=1e-3, mu_z=5e-4)
    for step in range(1, 7):
        rec_ctl.maybe_update(model, step, lr=1e-3)
    path = rec_ctl.write_trajectory(tmp_path / "traj.jsonl")
    meta, records = load_trajectory(path)
    assert meta["domains"] == DOMAINS and [r["step"] for r in records] == [0, 2, 4, 6]

    for stretch in (1.0, 2.0):
        mixer = _mixer(data_dir)
        rep = GrapeController(mixer, [], method="schedule", schedule_path=path, schedule_stretch=stretch)
        seen = {}
        for step in range(1, 13):
            if rep.maybe_update(model, step, lr=1e-3) is not None:
                seen[step] = list(mixer.weights)
        assert sorted(seen) == [int(r["step"] * stretch) for r in records[1:]]
        for r in records[1:]:
            np.testing.assert_allclose(seen[int(r["step"] * stretch)], r["alpha"], atol=1e-12)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"type": "meta", "domains": ["x", "y", "z"]}) + "\n" + json.dumps(records[1]) + "\n")
    with pytest.raises(ValueError, match="recorded for domains"):
        GrapeController(_mixer(data_dir), [], method="schedule", schedule_path=bad)


def test_option_filtering_and_errors(data_dir):
    kept, dropped = filter_reweighter_options("uniform", {"mu_alpha": 1e-4, "mu_z": 1.5e-5}, strict=False)
    assert kept == {} and set(dropped) == {"mu_alpha", "mu_z"}
    with pytest.raises(TypeError, match="mu_alfa"):
        filter_reweighter_options("grape", {"mu_alfa": 1.0}, strict=False)
    with pytest.raises(ValueError, match="target task"):
        GrapeController(_mixer(data_dir), [], method="grape")
    with pytest.raises(ValueError, match="alpha_every"):
        GrapeController(_mixer(data_dir), _tasks(data_dir), alpha_every=0)


def test_task_probe_indices_are_deterministic_and_rank_disjoint():
    a = probe_indices(100, 8, seed=1, key=(5, 0))
    assert np.array_equal(a, probe_indices(100, 8, seed=1, key=(5, 0)))
    assert not np.array_equal(a, probe_indices(100, 8, seed=1, key=(6, 0)))
    r0 = probe_indices(100, 8, seed=1, key=(5, 0), rank=0, world_size=2, disjoint=True)
    r1 = probe_indices(100, 8, seed=1, key=(5, 0), rank=1, world_size=2, disjoint=True)
    assert not set(r0) & set(r1)
    small = probe_indices(5, 4, seed=0, key=1, rank=1, world_size=2, disjoint=True)  # wraps: all used first
    assert len(small) == 4 and set(small) <= set(range(5))


def test_task_stream_errors(tmp_path):
    with pytest.raises(ValueError, match="probe split and the test split"):
        TaskStream("x", local=str(tmp_path), split="validation", test_split="validation")
    with pytest.raises(FileNotFoundError, match="task 'x'"):
        TaskStream("x", local=str(tmp_path)).dataset()


def _fsdp_worker(rank: int, port: int, data_dir: str, q) -> None:
    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
        from torch.distributed.fsdp import fully_shard

        model = _model()
        fully_shard(model)
        ctl = GrapeController(_mixer(data_dir), _tasks(data_dir), alpha_every=1, z_every=1, probe_domain_batch=2,
                              probe_task_batch=2)
        rec = ctl.maybe_update(model, 1, lr=1e-3)
        q.put(f"updated: alpha sums to {sum(rec['alpha']):.12f}, {len(rec['alignment'])} domains aligned")
    except BaseException as exc:  # report, never hang the parent
        q.put(f"worker failed: {exc!r}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_controller_probes_an_fsdp2_model_as_it_is(data_dir):
    """An FSDP2 (fully_shard) model goes to the controller as it is: the probe runs unit by unit on the sharded
    model (grape/gram/sharding.py; exactness against the unsharded computation: tests/test_fsdp_gram.py)."""
    import torch.multiprocessing as mp

    from _parallel import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_fsdp_worker, args=(0, port, data_dir, q))
    p.start()
    msg = q.get(timeout=120)
    p.join(60)
    assert msg.startswith("updated: alpha sums to 1.000000000000"), msg


def test_checkpoint_keeps_a_bounded_history_and_the_trajectory_stays_whole(data_dir, tmp_path, monkeypatch):
    import grape_stream.grape.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "CHECKPOINT_HISTORY", 2)
    model = _model()
    kw = dict(alpha_every=2, z_every=2, probe_domain_batch=4, probe_task_batch=4, seed=3, mu_alpha=1e-3, mu_z=5e-4)
    a = GrapeController(_mixer(data_dir), _tasks(data_dir), **kw)
    resumed_path = tmp_path / "resumed.jsonl"
    for step in range(1, 9):
        if a.maybe_update(model, step, lr=1e-3) is not None:
            a.write_trajectory(resumed_path)
    state = torch.load(_saved(a.state_dict(), tmp_path), weights_only=True)
    assert state["format"] == "grape_stream.controller/2"
    assert [r["step"] for r in state["history"]] == [6, 8] and state["history_dropped"] == 3
    assert len(state["reweighter"]["history"]) == 1  # the reweighter keeps only its last record

    b = GrapeController(_mixer(data_dir), _tasks(data_dir), **kw)
    b.load_state_dict(state)
    ra, rb = a.maybe_update(model, 10, lr=1e-3), b.maybe_update(model, 10, lr=1e-3)
    assert ra["alpha"] == rb["alpha"]
    b.write_trajectory(resumed_path)
    _, records = load_trajectory(a.write_trajectory(tmp_path / "straight.jsonl"))
    _, resumed = load_trajectory(resumed_path)
    assert [r["step"] for r in resumed] == [0, 2, 4, 6, 8, 10]
    assert [r["alpha"] for r in resumed] == [r["alpha"] for r in records]


def test_old_integer_state_format_still_loads(data_dir, tmp_path):
    model = _model()
    kw = dict(method="grape", alpha_every=2, z_every=2, probe_domain_batch=4, probe_task_batch=4, seed=1,
              mu_alpha=1e-3, mu_z=5e-4)
    a = GrapeController(_mixer(data_dir), _tasks(data_dir), **kw)
    for step in (1, 2, 3, 4):
        a.maybe_update(model, step, lr=1e-3)
    old = a.state_dict()
    old["format"] = 1  # the layout before the bounded history: no history_dropped, reweighter kept everything
    old.pop("history_dropped")
    old["reweighter"]["options"]["history_limit"] = None
    b = GrapeController(_mixer(data_dir), _tasks(data_dir), **kw)
    b.load_state_dict(old)
    ra, rb = a.maybe_update(model, 6, lr=1e-3), b.maybe_update(model, 6, lr=1e-3)
    assert ra["alpha"] == rb["alpha"] and ra["z"] == rb["z"]
    with pytest.raises(ValueError, match="format"):
        b.load_state_dict({**old, "format": 7})


def test_metrics_dict_for_any_logger(data_dir):
    ctl = GrapeController(_mixer(data_dir), _tasks(data_dir), alpha_every=1, z_every=1, probe_domain_batch=4,
                          probe_task_batch=4, mu_alpha=1e-3, mu_z=5e-4)
    rec = ctl.maybe_update(_model(), 1, lr=1e-3)
    m = ctl.metrics(rec)
    assert ctl.metrics() == m
    assert m["grape/alpha/d1"] == rec["alpha"][1] and m["grape/z/t0"] == rec["z"][0] and m["grape/lr"] == 1e-3
    assert m["grape/alignment/d2/t1"] == rec["alignment"][2][1] and m["grape/task_loss/t1"] == rec["task_loss"][1]
    assert m["grape/seconds/total"] == rec["seconds"]["total"]
    assert not any(k.startswith("grape/alignment/") for k in ctl.metrics(rec, alignment=False))
    assert all(isinstance(v, float) for v in m.values())


def _saved(state, tmp_path):
    path = tmp_path / "ctl.pt"
    torch.save(state, path)
    return path
