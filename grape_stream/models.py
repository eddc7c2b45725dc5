"""A small GPT-style decoder and the per-sample LM loss every part of grape_stream agrees on.

The model is deliberately plain (pre-LayerNorm blocks, tied embeddings, SDPA attention) so that the
alignment engine's fast paths (Linear, Embedding, LayerNorm) cover every parameter, and so the demo
trains in minutes on CPU. Users with their own model only need a `per_sample_loss(model, batch)`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from grape_stream.config import ModelConfig

_RECIPE = ModelConfig()


@dataclass
class GPTConfig:
    """Defaults are the paper's "tiny proxy" (2 layers, 8 heads, d=256, hidden 512, ctx 512)."""

    vocab_size: int = 50257
    seq_len: int = 512
    n_layer: int = _RECIPE.n_layer  # the architecture defaults are the recipe's (grape_stream.config), stated once
    n_head: int = _RECIPE.n_head
    d_model: int = _RECIPE.d_model
    d_ff: int = _RECIPE.d_ff
    dropout: float = _RECIPE.dropout
    tie_embeddings: bool = _RECIPE.tie_embeddings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (y.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """Decoder-only LM: tokens (B, T) int -> logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        # GPT-2's scaled init of residual projections keeps early training stable at any depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "out.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def lm_targets(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next-token targets (B, T-1) and their loss mask (or None) for logits of ``tokens[:, :-1]``."""
    tokens = batch["tokens"].long()
    mask = batch.get("loss_mask") if hasattr(batch, "get") else None
    return tokens[:, 1:], None if mask is None else mask[:, 1:]


def per_sample_lm_loss_from_logits(logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample, Tensor[B], from logits (B, T-1, V) of ``tokens[:, :-1]``.

    The optional ``batch["loss_mask"]`` (B, T) marks which tokens count as prediction targets (task samples
    are padded; padding must never count). A sample with no counted target contributes 0 rather than NaN.
    Shared by the plain model, the Composer wrapper and the GRAPE probe so all three score the same loss.
    """
    targets, mask = lm_targets(batch)
    if logits.dtype in (torch.float16, torch.bfloat16):  # half-precision logits: softmax in float32
        logits = logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none").view(
        targets.shape
    )
    if mask is None:
        return ce.mean(dim=1)
    m = mask.to(ce.dtype)
    return (ce * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def per_sample_lm_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample: Tensor[B] (see per_sample_lm_loss_from_logits).

    `batch["tokens"]` is (B, T) integer ids; the optional `batch["loss_mask"]` (B, T) marks counted targets.
    """
    return per_sample_lm_loss_from_logits(model(batch["tokens"].long()[:, :-1]), batch)
