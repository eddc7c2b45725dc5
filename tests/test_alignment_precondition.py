"""The preconditioned Gram (Adam geometry) against explicit per-group autograd gradients, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _alignment_helpers import (
    Zoo,
    gpt,
    hf_gpt2,
    hf_loss,
    lm_groups,
    one_thread,  # noqa: F401  (autouse: one torch thread)
    rel_err,
    zoo_groups,
    zoo_loss,
)
from grape_stream.grape.gram.group_gram import group_gram
from grape_stream.models import per_sample_lm_loss

SIZES = [1, 3, 2, 5, 1, 4]



def weighted_truth(model, loss_fn, groups, weights: dict) -> torch.Tensor:
    """sum_p <g_a,p, w_p g_b,p> from one autograd.grad per group (w_p = 1 where no entry)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for batch in groups:
        grads = torch.autograd.grad(loss_fn(model, batch).mean(), params, allow_unused=True)
        flat = [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)]
        rows.append(torch.cat(flat))
    v = torch.stack(rows).double()
    w = torch.cat([weights.get(p, torch.ones_like(p)).reshape(-1) for p in params]).double()
    return (v * w) @ v.t()


def adam_like_weights(model: nn.Module, skip: tuple[str, ...] = ()) -> dict:
    """w = 1 / (sqrt(v) + eps) with a random positive second moment v, for all parameters but `skip`."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    for name, p in model.named_parameters():
        if name in skip:
            continue
        v = torch.rand(p.shape, generator=gen, dtype=torch.float64) ** 4 * 1e-2
        out[p] = (1.0 / (v.sqrt() + 1e-3)).to(p.dtype)
    return out


@pytest.mark.parametrize("micro", [None, 4])
def test_gpt_tied_preconditioned_exact(micro) -> None:
    model = gpt(torch.float64)
    groups = lm_groups(SIZES)
    weights = adam_like_weights(model, skip=("blocks.0.fc.weight", "ln_f.bias"))  # these keep w = 1
    want = weighted_truth(model, per_sample_lm_loss, groups, weights)
    gram, _, info = group_gram(model, per_sample_lm_loss, groups, precondition=weights, micro_batch_size=micro,
                               return_info=True)
    assert rel_err(gram, want) <= 1e-8
    assert info.fast_path["tok_emb.weight"] == "head+rows" and info.fallback_modules == []
    plain, _ = group_gram(model, per_sample_lm_loss, groups)
    assert rel_err(plain, want) > 1e-3  # the weight really changes the result


def test_names_and_wrapper_prefixes_select_parameters() -> None:
    model = gpt(torch.float64, seed=2)
    groups = lm_groups([2, 1, 3], seed=2)
    named = {"module.blocks.1.attn.qkv.weight": torch.full_like(model.blocks[1].attn.qkv.weight, 4.0),
             "pos_emb.weight": torch.full_like(model.pos_emb.weight, 0.25)}
    by_param = {model.blocks[1].attn.qkv.weight: named["module.blocks.1.attn.qkv.weight"],
                model.pos_emb.weight: named["pos_emb.weight"]}
    want = weighted_truth(model, per_sample_lm_loss, groups, by_param)
    assert rel_err(group_gram(model, per_sample_lm_loss, groups, precondition=named)[0], want) <= 1e-8


def test_ghost_layer_switches_to_the_weight_gradient_form() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5)).double()
    groups = [{"x": torch.randn(s, 64, dtype=torch.float64), "y": torch.randint(0, 5, (s,))} for s in (2, 3, 1)]

    def loss(m, b):
        return F.cross_entropy(m(b["x"]), b["y"], reduction="none")

    weights = adam_like_weights(model, skip=("2.weight",))
    want = weighted_truth(model, loss, groups, weights)
    gram, _, info = group_gram(model, loss, groups, precondition=weights, return_info=True)
    assert info.fast_path["0.weight"] == "dense"  # token pairs cannot carry an elementwise weight
    assert info.fast_path["2.weight"] == "ghost"  # no weight: the cheaper form stays
    assert rel_err(gram, want) <= 1e-8


def test_conv1d_norms_and_fallback_preconditioned() -> None:
    model = hf_gpt2(torch.float64)
    groups = lm_groups([2, 1, 3], seed=3)
    weights = adam_like_weights(model)
    want = weighted_truth(model, hf_loss, groups, weights)
    assert rel_err(group_gram(model, hf_loss, groups, precondition=weights)[0], want) <= 1e-8
    torch.manual_seed(5)
    zoo = Zoo(with_fallback=True).double().eval()
    zg = zoo_groups([2, 3, 1])
    zw = adam_like_weights(zoo)
    want = weighted_truth(zoo, zoo_loss, zg, zw)
    with pytest.warns(UserWarning, match="gate.gate"):
        gram, _, info = group_gram(zoo, zoo_loss, zg, precondition=zw, return_info=True, micro_batch_size=2)
    assert info.fallback_params == ["gate.gate"] and rel_err(gram, want) <= 1e-8


def test_bad_preconditioners_are_clear_errors() -> None:
    model = gpt(torch.float64)
    groups = lm_groups([1, 2])
    w = model.ln_f.weight
    with pytest.raises(ValueError, match="not a parameter"):
        group_gram(model, per_sample_lm_loss, groups, precondition={"nope.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="expected"):
        group_gram(model, per_sample_lm_loss, groups, precondition={w: torch.ones(3)})
    with pytest.raises(ValueError, match=">= 0"):
        group_gram(model, per_sample_lm_loss, groups, precondition={w: -torch.ones_like(w)})
    with pytest.raises(ValueError, match="parameters of the model"):
        group_gram(model, per_sample_lm_loss, groups, precondition={torch.ones(3): torch.ones(3)})
