"""The fused Gram on real model families: exact, and no parameter on the slow exact fallback.

Fast paths match by capability (grape/gram/capabilities.py), so HF GPT-2 / Llama, a torchtitan-style
Llama and llm-foundry's MPT (LPLayerNorm, SharedEmbedding used as lookup and unembedding) all take them;
a module whose forward is not provably one of the supported functions still goes to the exact fallback,
named in the report with its reason.

"mpt" is llm-foundry's own MPTForCausalLM when ``llmfoundry`` is importable (it is not in the pinned
environment: llm-foundry 0.22 pins torch 2.7), otherwise the same faithful copy as "mpt-copy"
(grape_stream.testing.families: LPLayerNorm and SharedEmbedding forwards copied from llm-foundry 0.22.0).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _alignment_helpers import (
    lm_groups,
    one_thread,  # noqa: F401  (autouse: one torch thread)
    rel_err,
    truth_gram,
)
from grape_stream.grape.gram.capabilities import demoted_reason
from grape_stream.grape.gram.group_gram import GramInfo, group_gram
from grape_stream.testing.families import FamilySize, build_family

SIZE = FamilySize(d_model=32, n_layer=2, n_head=4, vocab=300, seq=16)
SIZES = [2, 1, 3, 2]  # K=2 domains then N=2 tasks
CASES = {
    "gpt": ("gpt", {}),
    "hf-gpt2": ("hf-gpt2", {}),
    "hf-llama": ("hf-llama", {}),
    "torchtitan-nn-rmsnorm": ("torchtitan", {"norm": "nn"}),
    "torchtitan-custom-rmsnorm": ("torchtitan", {"norm": "custom"}),
    "mpt": ("mpt", {}),
    "mpt-copy": ("mpt", {"real_mpt": False}),
}



def _fused(model: nn.Module, loss, groups, **kw) -> tuple[torch.Tensor, GramInfo]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback warns: here that is a failure
        gram, _, info = group_gram(model, loss, groups, return_info=True, **kw)
    return gram, info


def _all_param_names(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters()}  # tied weights once, as GramInfo names them


@pytest.mark.parametrize("case", list(CASES))
def test_family_is_exact_with_no_fallback(case: str) -> None:
    family, kw = CASES[case]
    model, loss, source = build_family(family, SIZE, torch.float64, seed=3, **kw)
    groups = lm_groups(SIZES, seed=3)
    want, _ = truth_gram(model, loss, groups)
    gram, info = _fused(model, loss, groups)
    assert rel_err(gram, want) <= 1e-8, source
    assert info.fallback_params == [] and info.fallback_modules == [], info.fallback_reasons
    assert set(info.fast_path) == _all_param_names(model), source
    if family == "mpt":  # SharedEmbedding: lookup rows + unembedding (a linear use of the same weight)
        wte = next(n for n in info.fast_path if n.endswith("wte.weight"))
        assert info.fast_path[wte] == "dense+rows"


@pytest.mark.parametrize("case", ["hf-llama", "mpt-copy", "torchtitan-custom-rmsnorm"])
def test_family_micro_batches_and_float32(case: str) -> None:
    family, kw = CASES[case]
    model, loss, _ = build_family(family, SIZE, torch.float64, seed=4, **kw)
    groups = lm_groups(SIZES, seed=4)
    want, _ = truth_gram(model, loss, groups)
    gram, info = _fused(model, loss, groups, micro_batch_size=3)  # groups straddle micro-batches
    assert rel_err(gram, want) <= 1e-8 and info.num_micro_batches == 3
    model32, loss32, _ = build_family(family, SIZE, torch.float32, seed=4, **kw)
    want32, _ = truth_gram(model32, loss32, groups)
    gram32, _ = _fused(model32, loss32, groups)
    assert rel_err(gram32, want32) <= 1e-4


@pytest.mark.parametrize("case", ["hf-llama", "mpt"])
def test_family_under_bf16_autocast_keeps_the_fast_path(case: str) -> None:
    """The probe runs in the training precision context: bf16 rounding inside the module is not mistaken
    for a different function (the capability check's tolerance follows the call's dtype)."""
    family, kw = CASES[case]
    model, loss, _ = build_family(family, SIZE, torch.float32, seed=8, **kw)

    def bf16_loss(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss(m, b).float()

    groups = lm_groups(SIZES, seed=8)
    want, _ = truth_gram(model, bf16_loss, groups)
    gram, info = _fused(model, bf16_loss, groups)
    assert rel_err(gram, want) <= 1e-2 and info.fallback_params == []


def test_single_sample_probe_still_verifies_capabilities() -> None:
    """One group of one sample: no layout probe is needed, the capability check still runs."""
    model, loss, _ = build_family("mpt", SIZE, torch.float64, seed=5, real_mpt=False)
    groups = lm_groups([1], seed=5)
    want, _ = truth_gram(model, loss, groups)
    gram, info = _fused(model, loss, groups)
    assert rel_err(gram, want) <= 1e-8 and info.fallback_params == []


# ---------------------------------------------------------------------------------- safety
class ScaledLinear(nn.Linear):
    """Looks like a Linear, computes F.linear with twice the weight: not a supported function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, 2 * self.weight, self.bias)


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm: x_hat * (1 + weight), affine in weight but not weight * n(x) + bias."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, 1e-6) * (1 + self.weight)


class DetachedNorm(nn.Module):
    """Output equals weight * n(x) exactly, but the weight gets no gradient: only the VJP check sees it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, 1e-6) * self.weight.detach()


class SquaredNorm(nn.Module):
    """weight**2 * n(x) with weight = 1: the output matches weight * n(x), the gradient does not."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],)) * self.weight**2


class Odd(nn.Module):
    def __init__(self, d: int = 16, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.gemma, self.detached, self.squared = GemmaNorm(d), DetachedNorm(d), SquaredNorm(d)
        self.scaled = ScaledLinear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x = torch.tanh(self.scaled(self.gemma(x)))
        return self.head(self.squared(self.detached(x)))


def _odd_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["tokens"][:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), batch["tokens"][:, 1:], reduction="none").mean(1)


def test_unproven_forwards_take_the_exact_fallback_and_are_reported() -> None:
    torch.manual_seed(6)
    model = Odd().double().eval()
    groups = [{"tokens": torch.randint(0, 50, (s, 10))} for s in (2, 3, 1)]
    want, _ = truth_gram(model, _odd_loss, groups)
    for attempt in range(2):  # the first call demotes them; the second goes straight to the fallback
        with pytest.warns(UserWarning, match="exact fallback") as rec:
            gram, _, info = group_gram(model, _odd_loss, groups, return_info=True)
        assert rel_err(gram, want) <= 1e-8, attempt
        assert info.fallback_modules == ["detached", "gemma", "scaled", "squared"], attempt
        assert set(info.fast_path) == {"emb.weight", "head.weight", "head.bias"}
        for name in ("gemma.weight", "scaled.weight", "scaled.bias", "detached.weight", "squared.weight"):
            assert "does not compute a supported function" in info.fallback_reasons[name], (name, info.fallback_reasons)
        assert "scaled" in str(rec[0].message) and "GemmaNorm" in str(rec[0].message)
    assert demoted_reason(model.scaled) is not None and demoted_reason(model.head) is None


class TwoFaced(nn.Module):
    """A weight used by one call as a Linear and by another in an unsupported way (weight * x, 2-D)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x: torch.Tensor, odd: bool = False) -> torch.Tensor:
        return torch.tanh(x @ self.weight) * self.weight.sum(0) if odd else F.linear(x, self.weight)


class TwoFacedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.two = TwoFaced()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.two(self.two(x), odd=True))


def test_one_unproven_call_demotes_the_whole_module() -> None:
    torch.manual_seed(7)
    model = TwoFacedModel().double()
    groups = [{"x": torch.randn(s, 5, 8, dtype=torch.float64), "y": torch.randint(0, 3, (s,))} for s in (2, 1, 2)]

    def loss(m, b):
        return F.cross_entropy(m(b["x"]).mean(1), b["y"], reduction="none")

    want, _ = truth_gram(model, loss, groups)
    with pytest.warns(UserWarning, match="two.weight"):
        gram, _, info = group_gram(model, loss, groups, return_info=True)
    assert rel_err(gram, want) <= 1e-8
    assert info.fallback_params == ["two.weight"] and "TwoFaced" in info.fallback_reasons["two.weight"]


class TransposedLinear(nn.Module):
    """A Conv1D-like layer (weight in x out) that is not HF's class; symmetric at first, so the linear
    and transposed forms give the same output and only the VJP check tells them apart."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        a = torch.randn(d, d)
        self.weight = nn.Parameter((a + a.t()) / (2 * d))
        self.bias = nn.Parameter(torch.randn(d) / d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


def test_transposed_linear_by_capability_even_when_symmetric() -> None:
    torch.manual_seed(9)
    model = nn.Sequential(TransposedLinear(), nn.Tanh(), nn.Linear(8, 3)).double()
    groups = [{"x": torch.randn(s, 4, 8, dtype=torch.float64), "y": torch.randint(0, 3, (s,))} for s in (2, 1, 3)]

    def loss(m, b):
        return F.cross_entropy(m(b["x"]).mean(1), b["y"], reduction="none")

    want, _ = truth_gram(model, loss, groups)
    gram, info = _fused(model, loss, groups)
    assert rel_err(gram, want) <= 1e-8 and info.fallback_params == []
    assert set(info.fast_path) == {"0.weight", "0.bias", "2.weight", "2.bias"}
