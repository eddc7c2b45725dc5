"""In-step alignments against the definition: one autograd.grad per domain of the same batch, float64.

Each test runs a real training backward through StepAlignments.observe and compares the accumulated
per-domain alignments with the explicit per-domain gradients (<= 1e-10 relative), and the parameters'
``.grad`` with an ordinary backward (the step trains exactly as without the hooks, to rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _alignment_helpers import (
    VOCAB,
    Zoo,
    gpt,
    lm_groups,
    one_thread,  # noqa: F401  (autouse: one torch thread)
    zoo_groups,
    zoo_loss,
)
from _gc import cycle_garbage
from _instep_helpers import directions, observed_step, rel, truth
from grape_stream.errors import ConfigError
from grape_stream.grape.gram.batches import concat
from grape_stream.grape.gram.instep import StepAlignments
from grape_stream.models import per_sample_lm_loss
from grape_stream.testing.families import FamilySize, build_family

K = 3


def _lm_batch(n: int = 10, seed: int = 0, domains: list[int] | None = None) -> dict:
    batch = concat(lm_groups([n], seed=seed))  # task-style masks: samples count different numbers of tokens
    batch["domain"] = torch.tensor(domains or [2, 0, 1, 0, 2, 2, 1, 0, 0, 2][:n])
    return batch


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _plain_grads(model: nn.Module, loss_fn, batch: dict) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn(model, batch).mean().backward()
    out = _grads(model)
    model.zero_grad(set_to_none=True)
    return out


def _check(model: nn.Module, loss_fn, batch: dict, micro: int | None = None, watch: bool = False,
           tol: float = 1e-10) -> StepAlignments:
    dirs = directions(model)
    want = truth(model, loss_fn, batch, batch["domain"], dirs, K)
    ref = _plain_grads(model, loss_fn, batch)
    sa = StepAlignments(model, loss_fn, K)
    sa.set_directions(dirs)
    observed_step(sa, model, loss_fn, batch, micro=micro, watch=watch)
    assert rel(sa.alignments(), want) <= tol
    for got, r in zip(_grads(model), ref):
        assert float((got - r).abs().max()) <= tol / 100 * max(float(r.abs().max()), 1e-30)
    counts = torch.bincount(batch["domain"], minlength=K).double()
    assert torch.equal(sa.samples.cpu(), counts)
    torch.testing.assert_close(sa.weights.cpu(), counts / counts.sum(), rtol=1e-14, atol=0)
    model.zero_grad(set_to_none=True)
    return sa


def test_tied_gpt_unsorted_batch_is_exact_and_trains_as_usual() -> None:
    _check(gpt(), per_sample_lm_loss, _lm_batch())


def test_sorted_batch_takes_views_and_a_missing_domain_is_nan() -> None:
    sa = _check(gpt(), per_sample_lm_loss, _lm_batch(6, domains=[0, 0, 0, 2, 2, 2]))
    assert torch.isnan(sa.alignments()[1]).all() and sa.samples[1] == 0


@pytest.mark.parametrize("micro", [1, 3, 4])
def test_micro_batches_accumulate_exactly(micro: int) -> None:
    _check(gpt(seed=1), per_sample_lm_loss, _lm_batch(seed=3), micro=micro)


@pytest.mark.parametrize("family", ["hf-gpt2", "hf-llama", "torchtitan", "mpt"])
def test_model_families_are_exact(family: str) -> None:
    model, loss, _ = build_family(family, FamilySize(d_model=32, n_layer=2, n_head=4, vocab=VOCAB, seq=16),
                                  torch.float64, seed=2, real_mpt=False)
    # HF Llama's RMSNorm and torchtitan's rotary embedding compute in float32 even in a float64 model: another
    # order of summation in the
    # backward (one identity node per hooked call) moves their gradients, .grad included, by float32 rounding.
    _check(model, loss, _lm_batch(seed=4), tol=1e-6 if family in ("hf-llama", "torchtitan") else 1e-10)


def test_every_fast_path_with_an_explicitly_watched_loss() -> None:
    torch.manual_seed(0)
    model = Zoo().double()
    batch = concat(zoo_groups([9], seed=2))
    batch["domain"] = torch.tensor([1, 1, 0, 2, 0, 1, 2, 2, 0])
    _check(model, zoo_loss, batch, micro=5, watch=True)


def test_state_round_trip_continues_the_sums() -> None:
    model = gpt(seed=5)
    batch = _lm_batch(seed=6)
    sa = StepAlignments(model, per_sample_lm_loss, K)
    sa.set_directions(directions(model))
    observed_step(sa, model, per_sample_lm_loss, batch)
    state = sa.state_dict()
    again = StepAlignments(model, per_sample_lm_loss, K)
    again.load_state_dict(state)
    observed_step(sa, model, per_sample_lm_loss, batch)
    observed_step(again, model, per_sample_lm_loss, batch)
    assert torch.equal(sa.sums, again.sums) and torch.equal(sa.weights, again.weights)


# ---------------------------------------------------------------------------------------------- refusals
class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = gpt()
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float64))  # no fast path

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens) * self.scale


class _Stray(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = gpt()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.inner.hidden(tokens)
        return F.linear(h, self.inner.tok_emb.weight)  # the embedding's weight outside its module


def _observe_once(model: nn.Module, batch: dict, loss=None) -> None:
    sa = StepAlignments(model, per_sample_lm_loss, K)
    sa.set_directions(directions(model, 1))
    with sa.observe(batch):
        (loss or per_sample_lm_loss)(model, batch).mean().backward()


def test_refusals_are_one_line() -> None:
    batch = _lm_batch()
    cases = {
        "no exact per-sample form for scale": lambda: _observe_once(_Gated(), batch),
        "used outside its module's forward": lambda: _observe_once(_Stray(), batch),
        "not a watched per-sample loss": lambda: _observe_once(
            gpt(), batch, lambda m, b: F.cross_entropy(m(b["tokens"][:, :-1]).transpose(1, 2), b["tokens"][:, 1:],
                                                         reduction="none").mean(1)),
        "torch.compile": lambda: StepAlignments(torch.compile(gpt()), per_sample_lm_loss, K),
        "normalises with batch statistics": lambda: StepAlignments(nn.Sequential(nn.BatchNorm1d(3)).train(),
                                                                   per_sample_lm_loss, K),
        "no 'domain' column": lambda: _observe_once(gpt(), {"tokens": batch["tokens"]}),
    }
    for needle, call in cases.items():
        with pytest.raises(ConfigError) as err:
            call()
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_activation_checkpointing_is_refused_after_the_step() -> None:
    from torch.utils.checkpoint import checkpoint

    from grape_stream.models import Block

    model = gpt()
    for block in model.blocks:
        block.forward = (lambda b: (lambda x: checkpoint(Block.forward, b, x, use_reentrant=False)))(block)
    with pytest.raises(ConfigError, match="ran during the backward"):
        _observe_once(model, _lm_batch())


def test_an_observed_step_leaves_no_cycle_for_the_collector() -> None:
    """Each hooked call's record must not form a reference cycle with its autograd node: a cycle kept every
    observed step's graph (its saved activations live on the C++ side) resident until a full collection, and
    grape_steps grew by ~22 MB a step to 9 GB on the value benchmark (docs/results.md, "Memory")."""
    from grape_stream.grape.gram.instep import _StepUse

    model = gpt()
    batch = _lm_batch()
    sa = StepAlignments(model, per_sample_lm_loss, K)
    sa.set_directions(directions(model))
    with cycle_garbage(_StepUse) as cyclic:
        for _ in range(3):
            observed_step(sa, model, per_sample_lm_loss, batch)
            model.zero_grad(set_to_none=True)
    assert cyclic == [], f"{len(cyclic)} hooked-call records were only freed by the cycle collector"
