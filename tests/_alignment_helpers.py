"""Shared pieces of the alignment tests: small models, probe groups and the slow truth."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grape_stream.models import GPT, GPTConfig

VOCAB, SEQ = 300, 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Import into a test module (autouse there). These models are tiny: on a shared 2-core CI box,
    OpenMP's thread hand-offs cost more than the maths."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def truth_gram(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    groups: Sequence[Any],
    params: Optional[Sequence[nn.Parameter]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: one autograd.grad per group of its mean loss, flattened, inner products."""
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]  # parameters() dedupes tied weights
    vecs, losses = [], []
    for batch in groups:
        per_sample = loss_fn(model, batch)
        loss = per_sample.mean()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        vecs.append(
            torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])
        )
        losses.append(per_sample.detach().double().mean())
    v = torch.stack(vecs).double()
    return v @ v.t(), torch.stack(losses).double()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def gpt(dtype: torch.dtype = torch.float64, seed: int = 0, **kw: Any) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=32, d_ff=64)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg)).to(dtype).eval()


def lm_groups(sizes: Sequence[int], seed: int = 0, pad_from: Optional[int] = 11, seq: int = SEQ) -> list[dict]:
    """Token groups with a task-style loss_mask (padding after `pad_from`, varying per sample)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for s in sizes:
        tokens = torch.randint(0, VOCAB, (s, seq), generator=gen)
        mask = torch.ones(s, seq, dtype=torch.uint8)
        if pad_from is not None:
            for i in range(s):
                cut = pad_from + int(torch.randint(0, seq - pad_from, (1,), generator=gen))
                mask[i, cut:] = 0
                tokens[i, cut:] = 0
        groups.append({"tokens": tokens, "loss_mask": mask})
    return groups


def hf_gpt2(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32)
    return GPT2LMHeadModel(cfg).to(dtype).eval()


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    tokens = batch["tokens"].long()
    logits = model(input_ids=tokens[:, :-1]).logits
    targets = tokens[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    ce = ce.view(targets.shape)
    m = batch["loss_mask"][:, 1:].to(ce.dtype)
    return (ce * m).sum(1) / m.sum(1).clamp_min(1.0)


class Scale(nn.Module):
    """A module type without a fast path: a learned per-feature gate (goes through the fallback)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tanh(self.gate)


class Zoo(nn.Module):
    """Every fast path in odd configurations: 2-D and 3-D Linear inputs, bias-free Linear, RMSNorm,
    bias-free LayerNorm, Embedding with padding_idx, a Linear called twice (weight reuse), a
    broadcast (batch-less) embedding, and optionally a fallback module."""

    def __init__(self, with_fallback: bool = False, d: int = 16, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(12, d)
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.ln = nn.LayerNorm(d, bias=False)
        self.shared = nn.Linear(d, d)
        self.nobias = nn.Linear(d, d, bias=False)
        self.pool = nn.Linear(d, 8)  # 2-D input (B, d)
        self.out = nn.Linear(8, 3)
        self.gate = Scale(d) if with_fallback else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.emb(tokens) + self.pos(torch.arange(t, device=tokens.device))
        x = self.norm(x)
        x = torch.tanh(self.shared(x))
        x = x + self.shared(self.ln(x))  # the same module (and weight) a second time
        if self.gate is not None:
            x = self.gate(x)
        x = self.nobias(x).mean(dim=1)
        return self.out(torch.tanh(self.pool(x)))


def zoo_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["tokens"]), batch["label"], reduction="none")


def zoo_groups(sizes: Sequence[int], seed: int = 0, vocab: int = 50, t: int = 12) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in sizes:
        tokens = torch.randint(0, vocab, (s, t), generator=gen)
        tokens[:, -2:] = 0  # padding_idx rows never get gradient
        out.append({"tokens": tokens, "label": torch.randint(0, 3, (s,), generator=gen)})
    return out
