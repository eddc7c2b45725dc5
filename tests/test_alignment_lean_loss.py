"""The LM loss's lean cross-entropy (one tokens x vocab array at the peak) against F.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _alignment_helpers import SEQ, VOCAB, gpt, lm_groups, rel_err, truth_gram
from grape_stream.grape.gram.group_gram import group_gram
from grape_stream.models import (
    GPT,
    GPTConfig,
    no_inplace_loss_grad,
    per_sample_lm_loss,
    per_sample_lm_loss_from_full_logits,
    per_sample_lm_loss_from_logits,
)


def reference(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    targets, mask = batch["tokens"][:, 1:].long(), batch["loss_mask"][:, 1:]
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    m = mask.to(ce.dtype)
    return (ce * m).sum(1) / m.sum(1).clamp_min(1.0)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_values_and_gradients_match_cross_entropy(inplace: bool, dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setattr("grape_stream.models.gpt._CE_CHUNK_ELEMENTS", 7 * 300)  # several chunks, a ragged last one
    batch = lm_groups([3], seed=4, seq=12)[0]
    base = torch.randn(3, 11, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    weights = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float32 if dtype != torch.float64 else dtype)
    want_in = base.clone().to(dtype).requires_grad_(True)
    want = reference(want_in, batch)
    (want * weights).sum().backward()
    got_in = base.clone().to(dtype).requires_grad_(True)
    logits = got_in * 1  # a fresh non-leaf the loss may overwrite
    got = per_sample_lm_loss_from_logits(logits, batch, inplace_grad=inplace)
    (got * weights).sum().backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    assert got.dtype == want.dtype and rel_err(got.detach(), want.detach()) <= tol
    assert rel_err(got_in.grad, want_in.grad) <= tol
    if inplace and dtype == torch.float64:
        assert torch.equal(logits.detach(), got_in.grad)  # the logits' storage now holds their gradient


@pytest.mark.parametrize("sizes", [[2, 1, 3, 2], [3, 3, 3]])  # unequal and equal group sizes
def test_gpt_probe_with_in_place_loss_gradient_is_exact(sizes: list[int]) -> None:
    model = gpt(torch.float64, seed=3)
    groups = lm_groups(sizes, seed=3)
    want, want_losses = truth_gram(model, per_sample_lm_loss, groups)
    logits = model(groups[0]["tokens"][:, :-1])
    ref = reference(logits, groups[0])
    assert rel_err(per_sample_lm_loss(model, groups[0]).detach(), ref.detach()) <= 1e-12
    gram, losses = group_gram(model, per_sample_lm_loss, groups)
    assert rel_err(gram, want) <= 1e-8 and rel_err(losses, want_losses) <= 1e-12


class _TemperedGPT(GPT):
    """Our GPT plus a logit temperature: a parameter no fast path knows (exact per-group fallback), on a
    model whose loss takes its logits' gradient in place."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.temperature = torch.nn.Parameter(torch.tensor(1.3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.temperature


@pytest.mark.parametrize("micro", [None, 3])
def test_exact_fallback_beside_the_in_place_loss_gradient(micro) -> None:
    """The fallback backpropagates the same graph once per group: the in-place logits gradient must wait."""
    torch.manual_seed(5)
    model = _TemperedGPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=32, d_ff=64))
    model = model.to(torch.float64).eval()
    groups = lm_groups([2, 1, 3], seed=5)
    want, want_losses = truth_gram(model, per_sample_lm_loss, groups)
    gram, losses, info = group_gram(model, per_sample_lm_loss, groups, micro_batch_size=micro, return_info=True)
    assert info.fallback_params == ["temperature"]
    assert rel_err(gram, want) <= 1e-8 and rel_err(losses, want_losses) <= 1e-12
    # outside the fused Gram the loss still writes the logits' gradient in place (one array at the peak)
    logits = model(groups[0]["tokens"][:, :-1]).detach().requires_grad_()
    owned = logits * 1.0
    per_sample_lm_loss_from_logits(owned, groups[0], inplace_grad=True).sum().backward()
    with no_inplace_loss_grad():
        kept = logits * 1.0
        per_sample_lm_loss_from_logits(kept, groups[0], inplace_grad=True).sum().backward(retain_graph=True)
    assert torch.equal(kept.detach(), logits.detach())  # kept still holds the logits ...
    assert not torch.equal(owned.detach(), logits.detach())  # ... owned holds their gradient


@pytest.mark.parametrize("masked", [True, False])
def test_full_logits_give_the_sliced_logits_loss_and_token_losses(masked: bool) -> None:
    """An HF causal LM's logits of every position (the last one's target ignored) score what the logits of
    tokens[:, :-1] score: per-sample losses, their gradients, and the per-token losses a watcher (DoReMi) sees."""
    from grape_stream.models.loss_watch import watching_losses

    batch = lm_groups([3], seed=5, seq=12)[0]
    if not masked:
        batch = {k: v for k, v in batch.items() if k != "loss_mask"}
    base = torch.randn(3, 12, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    weights = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)

    class Tokens:
        def __init__(self) -> None:
            self.seen: list = []

        def watch_tokens(self, token_losses, mask) -> None:
            self.seen.append((token_losses.detach().clone(), None if mask is None else mask.clone()))

        def watch(self, losses) -> None:
            pass

    runs = []
    for full in (False, True):
        x = base.clone().requires_grad_(True)
        watcher = Tokens()
        with watching_losses(watcher):
            got = (per_sample_lm_loss_from_full_logits(x, batch) if full
                   else per_sample_lm_loss_from_logits(x[:, :-1], batch))
        (got * weights).sum().backward()
        runs.append((got.detach(), x.grad, watcher.seen[0]))
    (want, want_grad, (want_tok, want_mask)), (got, got_grad, (got_tok, got_mask)) = runs
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-15)
    assert not got_grad[:, -1].any()  # the last position predicts nothing
    torch.testing.assert_close(got_tok, want_tok, rtol=1e-12, atol=0)
    assert (got_mask is None) == (want_mask is None) == (not masked)
