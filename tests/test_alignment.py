"""group_gram against the slow truth (one autograd.grad per group), and the model left as it was found."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _alignment_helpers import (
    SEQ,
    Zoo,
    gpt,
    hf_gpt2,
    hf_loss,
    lm_groups,
    one_thread,  # noqa: F401  (autouse: one torch thread for these tiny models)
    rel_err,
    truth_gram,
    zoo_groups,
    zoo_loss,
)
from _gc import cycle_garbage
from grape_stream.grape.gram.group_gram import GramInfo, group_gram
from grape_stream.models import per_sample_lm_loss

SIZES = [1, 3, 2, 5, 1, 4]  # K=3 domains then N=3 tasks, 1..5 samples each



@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-8), (torch.float32, 1e-4)])
def test_gpt_tied_embeddings_exact(dtype: torch.dtype, tol: float) -> None:
    model = gpt(dtype)
    assert model.head.weight is model.tok_emb.weight
    groups = lm_groups(SIZES)
    want, want_losses = truth_gram(model, per_sample_lm_loss, groups)
    gram, losses, info = group_gram(model, per_sample_lm_loss, groups, return_info=True)
    assert gram.shape == (6, 6) and gram.dtype == torch.float64 and losses.dtype == torch.float64
    assert rel_err(gram, want) <= tol
    assert rel_err(losses, want_losses) <= tol
    assert torch.equal(gram, gram.t())
    assert info.fallback_modules == [] and info.num_micro_batches == 1
    # the tied embedding/head parameter is counted once: dense head rows + sparse embedding rows
    assert info.fast_path["tok_emb.weight"] == "head+rows"  # the head in sample chunks (head_loss.py)
    assert info.fast_path["pos_emb.weight"] == "rows"  # broadcast arange(T) embedding, expanded per sample


@pytest.mark.parametrize("micro", [1, 3, 4, 16])
def test_micro_batching_is_exact(micro: int) -> None:
    model = gpt(torch.float64, seed=1)
    groups = lm_groups(SIZES, seed=1)
    want, _ = truth_gram(model, per_sample_lm_loss, groups)
    gram, losses, info = group_gram(model, per_sample_lm_loss, groups, micro_batch_size=micro, return_info=True)
    assert info.num_micro_batches == -(-sum(SIZES) // micro)
    assert rel_err(gram, want) <= 1e-8  # groups straddling micro-batch boundaries included


@pytest.mark.parametrize("dtype,tol,micro", [(torch.float64, 1e-8, None), (torch.float64, 1e-8, 3),
                                             (torch.float32, 1e-4, None)])
def test_hf_gpt2_exact_with_conv1d_fast_path(dtype: torch.dtype, tol: float, micro) -> None:
    model = hf_gpt2(dtype)
    groups = lm_groups([2, 1, 4, 3, 2], seed=2)
    want, _ = truth_gram(model, hf_loss, groups)
    gram, _, info = group_gram(model, hf_loss, groups, micro_batch_size=micro, return_info=True)
    assert rel_err(gram, want) <= tol
    assert info.fallback_modules == []
    assert "transformer.h.0.attn.c_attn.weight" in info.fast_path  # HF Conv1D handled, not the fallback
    assert "rows" in info.fast_path["transformer.wte.weight"] and "dense" in info.fast_path["transformer.wte.weight"]


def test_fast_paths_in_odd_configurations() -> None:
    torch.manual_seed(3)
    model = Zoo().double().eval()
    groups = zoo_groups([2, 1, 3, 2])
    want, _ = truth_gram(model, zoo_loss, groups)
    for micro in (None, 3):
        gram, _, info = group_gram(model, zoo_loss, groups, micro_batch_size=micro, return_info=True)
        assert rel_err(gram, want) <= 1e-8, micro
        assert info.fallback_modules == []
    assert set(info.fast_path) >= {"norm.weight", "ln.weight", "shared.weight", "pool.weight", "emb.weight"}


def test_ghost_and_dense_forms_agree() -> None:
    """2-D inputs with few rows: the token-pair (ghost) form is cheaper and gets chosen."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5)).double()
    groups = [{"x": torch.randn(s, 64, dtype=torch.float64), "y": torch.randint(0, 5, (s,))} for s in (2, 3, 1)]

    def loss(m, b):
        return F.cross_entropy(m(b["x"]), b["y"], reduction="none")

    want, _ = truth_gram(model, loss, groups)
    ghost, _, info = group_gram(model, loss, groups, return_info=True)
    dense, _, info_dense = group_gram(model, loss, groups, ghost=False, return_info=True)
    assert info.fast_path["0.weight"] == "ghost" and info_dense.fast_path["0.weight"] == "dense"
    assert rel_err(ghost, want) <= 1e-8 and rel_err(dense, want) <= 1e-8


def test_module_without_fast_path_is_exact_and_reported() -> None:
    torch.manual_seed(5)
    model = Zoo(with_fallback=True).double().eval()
    groups = zoo_groups([2, 3, 1])
    want, _ = truth_gram(model, zoo_loss, groups)
    with pytest.warns(UserWarning, match="gate.gate"):
        gram, _, info = group_gram(model, zoo_loss, groups, return_info=True)
    assert rel_err(gram, want) <= 1e-8
    assert info.fallback_modules == ["gate"] and info.fallback_params == ["gate.gate"]
    assert "Scale" in info.fallback_reasons["gate.gate"]


class FunctionalHead(nn.Module):
    """Uses the embedding weight through F.linear outside any hooked module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 8)
        self.mix = nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.mix(self.emb(tokens))), self.emb.weight)


def test_functional_use_of_a_parameter_is_caught() -> None:
    torch.manual_seed(6)
    model = FunctionalHead().double()
    groups = [{"tokens": torch.randint(0, 40, (s, 6))} for s in (2, 1, 3)]

    def loss(m, b):
        logits = m(b["tokens"][:, :-1])
        return F.cross_entropy(logits.transpose(1, 2), b["tokens"][:, 1:], reduction="none").mean(1)

    want, _ = truth_gram(model, loss, groups)
    with pytest.warns(UserWarning, match="emb.weight"):
        gram, _, info = group_gram(model, loss, groups, return_info=True)
    assert rel_err(gram, want) <= 1e-8
    assert info.fallback_params == ["emb.weight"]


def test_batch_size_equal_to_sequence_length_is_not_confused() -> None:
    """15 samples of 15 model tokens: arange(T) for pos_emb has the batch's length but is shared."""
    model = gpt(torch.float64, seed=7)
    groups = lm_groups([4, 5, 6], seed=7)  # 15 samples; the model sees SEQ - 1 = 15 tokens
    assert sum(len(g["tokens"]) for g in groups) == SEQ - 1
    want, _ = truth_gram(model, per_sample_lm_loss, groups)
    gram, _ = group_gram(model, per_sample_lm_loss, groups)
    assert rel_err(gram, want) <= 1e-8


def test_params_subset() -> None:
    model = gpt(torch.float64, seed=8)
    groups = lm_groups([2, 3, 2], seed=8)
    subset = [model.blocks[1].fc.weight, model.ln_f.bias, model.tok_emb.weight]
    want, _ = truth_gram(model, per_sample_lm_loss, groups, params=subset)
    flags = [p.requires_grad for p in model.parameters()]
    gram, _, info = group_gram(model, per_sample_lm_loss, groups, params=subset, return_info=True)
    assert rel_err(gram, want) <= 1e-8
    assert set(info.fast_path) == {"blocks.1.fc.weight", "ln_f.bias", "tok_emb.weight"}
    assert [p.requires_grad for p in model.parameters()] == flags
    # frozen parameters are excluded by default
    model.blocks[0].fc.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    want, _ = truth_gram(model, per_sample_lm_loss, groups, params=params)
    gram, _ = group_gram(model, per_sample_lm_loss, groups)
    assert rel_err(gram, want) <= 1e-8
    assert model.blocks[0].fc.weight.requires_grad is False


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_model_left_as_found(mode: str) -> None:
    model = gpt(torch.float32, seed=9)  # dropout = 0, so train mode is still deterministic
    model.train(mode == "train")
    model.blocks[0].attn.eval()  # a mixed-mode model stays mixed
    params = list(model.parameters())
    for i, p in enumerate(params):
        if i % 2 == 0:
            p.grad = torch.randn_like(p)
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    grad_objs = [p.grad for p in params]
    values = [p.detach().clone() for p in params]
    modes = {n: m.training for n, m in model.named_modules()}
    opt = torch.optim.AdamW(params, lr=1e-3)
    groups = lm_groups([2, 3], seed=9)
    group_gram(model, per_sample_lm_loss, groups, micro_batch_size=3)
    for p, g, obj, v in zip(params, grads, grad_objs, values):
        assert p.grad is obj
        assert (g is None and p.grad is None) or torch.equal(p.grad, g)
        assert torch.equal(p.detach(), v)
        assert type(p) is nn.Parameter and p.requires_grad
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert not opt.state
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert all(type(p) is nn.Parameter for p in m._parameters.values() if p is not None)


class _Recorder(nn.Module):
    """Keeps a weak reference to its last output, to see whether the autograd graph outlived the call."""

    def __init__(self) -> None:
        super().__init__()
        self.last = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        self.last = weakref.ref(y)
        return y


def test_no_graph_kept_alive_and_hooks_removed_on_error() -> None:
    model = gpt(torch.float32, seed=10)
    rec = _Recorder()
    model.ln_f = nn.Sequential(model.ln_f, rec)
    groups = lm_groups([2, 2], seed=10)
    group_gram(model, per_sample_lm_loss, groups)
    gc.collect()
    assert rec.last is not None and rec.last() is None

    flags = [p.requires_grad for p in model.parameters()]
    calls = {"n": 0}

    def exploding(m, b):
        calls["n"] += 1
        out = per_sample_lm_loss(m, b)
        if calls["n"] >= 4:  # after the layout probe, in the real pass
            m.head(torch.zeros(3, 5))  # raises inside the head's forward, while its weight is swapped out
        return out

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        group_gram(model, exploding, lm_groups([2, 2], seed=11, seq=12, pad_from=8))
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert all(type(p) is nn.Parameter for p in m._parameters.values() if p is not None)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert model.head.weight is model.tok_emb.weight


def test_clear_errors() -> None:
    model = gpt(torch.float32, seed=12)
    good = lm_groups([2, 2], seed=12)
    short = lm_groups([2], seed=12, seq=10, pad_from=5)
    with pytest.raises(ValueError, match=r"groups\[1\]\['tokens'\] has shape \(2, 10\)"):
        group_gram(model, per_sample_lm_loss, [good[0], short[0]])
    with pytest.raises(ValueError, match="empty"):
        group_gram(model, per_sample_lm_loss, [good[0], {k: v[:0] for k, v in good[1].items()}])
    with pytest.raises(ValueError, match="keys"):
        group_gram(model, per_sample_lm_loss, [good[0], {"tokens": good[1]["tokens"]}])
    with pytest.raises(ValueError, match="one loss per sample"):
        group_gram(model, lambda m, b: per_sample_lm_loss(m, b).mean(), good)
    with pytest.raises(ValueError, match="non-empty list"):
        group_gram(model, per_sample_lm_loss, [])
    with pytest.raises(ValueError, match="micro_batch_size"):
        group_gram(model, per_sample_lm_loss, good, micro_batch_size=0)
    with pytest.raises(ValueError, match="parameters of the model"):
        group_gram(model, per_sample_lm_loss, good, params=[nn.Parameter(torch.zeros(3))])
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).train()
    batch = [{"x": torch.randn(3, 4)}, {"x": torch.randn(2, 4)}]
    with pytest.raises(ValueError, match="batch statistics"):
        group_gram(bn, lambda m, b: m(b["x"]).squeeze(1), batch)


def test_info_and_losses() -> None:
    model = gpt(torch.float64, seed=13)
    groups = lm_groups([3, 1, 2], seed=13)
    gram, losses, info = group_gram(model, per_sample_lm_loss, groups, return_info=True)
    assert isinstance(info, GramInfo)
    assert info.group_sizes == [3, 1, 2] and info.world_size == 1
    assert {"forward_s", "backward_s", "total_s"} <= set(info.timings)
    for i, g in enumerate(groups):
        with torch.no_grad():
            assert abs(float(per_sample_lm_loss(model, g).mean()) - float(losses[i])) < 1e-12
    assert (torch.linalg.eigvalsh(gram) > -1e-10 * gram.abs().max()).all()  # a Gram matrix is PSD
    out = group_gram(model, per_sample_lm_loss, groups)
    assert isinstance(out, tuple) and len(out) == 2


def test_runs_under_autocast_at_full_precision() -> None:
    """The probe may run in the training precision context; our own arithmetic stays in fp32."""
    model = gpt(torch.float32, seed=14)
    groups = lm_groups([2, 3, 1], seed=14)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = truth_gram(model, per_sample_lm_loss, groups)  # itself computed with bf16 matmuls
        gram, _ = group_gram(model, per_sample_lm_loss, groups, micro_batch_size=4)
    assert gram.dtype == torch.float64
    assert rel_err(gram, want) <= 1e-2


class Layouts(nn.Module):
    """A flattened (B*T, d) head input (attributable: a view of a batch-first tensor) and a
    sequence-first (T, B, d) Linear input (not attributable: exact fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.seq_first = nn.Linear(8, 8)
        self.head = nn.Linear(8, 30)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        x = self.emb(tokens)
        x = x + torch.tanh(self.seq_first(x.transpose(0, 1))).transpose(0, 1)
        return self.head(x.reshape(b * t, 8)).view(b, t, 30)


def test_flattened_rows_and_sequence_first_layouts() -> None:
    torch.manual_seed(15)
    model = Layouts().double()
    groups = [{"tokens": torch.randint(0, 30, (s, 7))} for s in (2, 3, 1, 2)]

    def loss(m, b):
        logits = m(b["tokens"][:, :-1])
        return F.cross_entropy(logits.transpose(1, 2), b["tokens"][:, 1:], reduction="none").mean(1)

    want, _ = truth_gram(model, loss, groups)
    with pytest.warns(UserWarning, match="seq_first"):
        gram, _, info = group_gram(model, loss, groups, return_info=True)
    assert rel_err(gram, want) <= 1e-8
    assert set(info.fallback_params) == {"seq_first.weight", "seq_first.bias"}
    assert info.fast_path["head.weight"] == "dense"  # flattened rows proven sample-major


@pytest.mark.parametrize("micro", [None, 4])
def test_a_probe_leaves_no_cycle_for_the_collector(micro) -> None:
    """A hooked call's record and its output's autograd node must not form a reference cycle (the node holds the
    tensor hook, whose closure holds the record, which held the node): each probe's graph stayed resident until a
    full collection, and GRAPE's process grew by ~7 MB a training step on the value benchmark (docs/results.md,
    "Memory"). With the collector off and DEBUG_SAVEALL, what a collection finds is exactly what only it frees."""
    from grape_stream.grape.gram.contributions import Use

    model = gpt(torch.float32)
    groups = lm_groups(SIZES)
    group_gram(model, per_sample_lm_loss, groups, micro_batch_size=micro)  # layouts learnt, caches filled
    with cycle_garbage(Use) as cyclic:
        for _ in range(3):
            group_gram(model, per_sample_lm_loss, groups, micro_batch_size=micro)
    assert cyclic == [], f"{len(cyclic)} hooked-call records were only freed by the cycle collector"
