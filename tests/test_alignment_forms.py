"""The per-layer cost model: token-pair ("ghost") and per-group weight-gradient ("dense") forms chosen in
one call by each layer's shape, both exact in float64 (plain, micro-batched, preconditioned)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _alignment_helpers import rel_err, truth_gram
from grape_stream.grape.gram.group_gram import group_gram


class TwoShapes(nn.Module):
    """A per-token layer over many rows (dense is cheaper), then pooled layers over one row per sample
    with a large weight (token pairs are cheaper)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Linear(6, 5)  # 40 rows per sample, 30 weights: dense
        self.wide = nn.Linear(5, 48)
        self.big = nn.Linear(48, 48)  # 1 row per sample, 2304 weights: ghost

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.tok(x)).mean(1)
        return self.big(torch.tanh(self.wide(h))).pow(2).mean(1)


def loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["x"])


@pytest.mark.parametrize("micro", [None, 2])
def test_cost_model_picks_each_form_and_both_are_exact(micro) -> None:
    torch.manual_seed(11)
    model = TwoShapes().double()
    gen = torch.Generator().manual_seed(11)
    groups = [{"x": torch.randn(s, 40, 6, dtype=torch.float64, generator=gen)} for s in (2, 1, 3)]
    want, _ = truth_gram(model, loss, groups)
    gram, _, info = group_gram(model, loss, groups, micro_batch_size=micro, return_info=True)
    assert info.fast_path["tok.weight"] == "dense" and info.fast_path["big.weight"] == "ghost"
    assert rel_err(gram, want) <= 1e-8
    # a preconditioned layer cannot use token pairs: the same layer switches form and stays exact
    w = torch.rand(48, 48, dtype=torch.float64, generator=gen) + 0.5
    pre, _, info = group_gram(model, loss, groups, micro_batch_size=micro, precondition={model.big.weight: w},
                              return_info=True)
    assert info.fast_path["big.weight"] == "dense"
    params = [p for p in model.parameters()]
    vecs = []
    for b in groups:
        grads = torch.autograd.grad(loss(model, b).mean(), params)
        vecs.append(torch.cat([(g * w if p is model.big.weight else g).reshape(-1) for g, p in zip(grads, params)]))
    plain = []
    for b in groups:
        plain.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss(model, b).mean(), params)]))
    assert rel_err(pre, torch.stack(vecs) @ torch.stack(plain).t()) <= 1e-8
