"""The small GPT-style decoder and the per-sample LM loss every part of grape_stream agrees on.

The model is deliberately plain (pre-LayerNorm blocks, tied embeddings, SDPA attention) so that the
alignment engine's fast paths (Linear, Embedding, LayerNorm) cover every parameter, and so the demo
trains in minutes on CPU. Users with their own model only need a `per_sample_loss(model, batch)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from grape_stream.config import DecoderShape
from grape_stream.models.head_loss import (
    SOFTMAX_ELEMENTS,
    current_head_observer,
    observed_causal_lm_loss,
    observed_head_loss,
)
from grape_stream.models.loss_watch import watch_losses


@dataclass
class GPTConfig(DecoderShape):
    """Defaults are the paper's "tiny proxy" (2 layers, 8 heads, d=256, hidden 512, ctx 512). The architecture
    fields are :class:`~grape_stream.config.DecoderShape`'s, which the recipe's ``model`` section shares."""

    vocab_size: int = 50257
    seq_len: int = 512

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
        return self.head(self.hidden(tokens))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states (B, T, d_model), before the head: what a chunked head loss starts from."""
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def lm_targets(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next-token targets (B, T-1) and their loss mask (or None) for logits of ``tokens[:, :-1]``."""
    tokens = batch["tokens"].long()
    mask = batch.get("loss_mask") if hasattr(batch, "get") else None
    return tokens[:, 1:], None if mask is None else mask[:, 1:]


#: token rows per chunk of the cross-entropy: about 2^22 logits (16 MiB in fp32) at a time, so the
#: softmax passes run in cache instead of streaming (tokens x vocab) arrays through memory several times
#: (the same size as the probe's chunked head uses for its element-wise passes)
_CE_CHUNK_ELEMENTS = SOFTMAX_ELEMENTS


#: False inside :func:`no_inplace_loss_grad`: the loss's backward must leave the logits intact.
_INPLACE_GRAD_OK: contextvars.ContextVar[bool] = contextvars.ContextVar("grape_stream_inplace_loss_grad", default=True)


@contextlib.contextmanager
def no_inplace_loss_grad() -> Iterator[None]:
    """Losses built inside keep their logits through the backward, so the graph can be backpropagated more
    than once (``retain_graph=True``: the exact per-group fallback of the fused Gram, per-group reference
    gradients). Outside it, an owned logits tensor takes its own gradient in place (one array at the peak)."""
    token = _INPLACE_GRAD_OK.set(False)
    try:
        yield
    finally:
        _INPLACE_GRAD_OK.reset(token)


class _LeanCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy that never materialises more than the logits and one chunk.

    F.cross_entropy keeps the log-softmax (tokens x vocab) for its backward, which then allocates the
    gradient of the log-probabilities and of the logits: 3-4 (tokens x vocab) arrays at the peak, the bulk
    of an LM step's memory at a 50k vocabulary. Here the forward keeps the logits and one logsumexp per
    token; the backward forms softmax - onehot chunk by chunk, either into a new tensor or, with
    `inplace=True` (the caller owns the logits and nothing else reads them), into the logits' own storage:
    one (tokens x vocab) array in all. Same arithmetic as log_softmax + nll, to rounding.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, inplace: bool) -> torch.Tensor:
        n, v = logits.shape
        step = max(1, _CE_CHUNK_ELEMENTS // max(1, v))
        lse = torch.empty(n, dtype=logits.dtype, device=logits.device)
        for a in range(0, n, step):
            lse[a : a + step] = torch.logsumexp(logits[a : a + step], dim=1)
        ce = lse - logits.gather(1, targets.unsqueeze(1)).squeeze(1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.inplace, ctx.step = inplace, step
        return ce

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_ce: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        out = logits if ctx.inplace else torch.empty_like(logits)
        step, n = ctx.step, logits.shape[0]
        minus_one = torch.full((min(step, n), 1), -1.0, dtype=logits.dtype, device=logits.device)
        for a in range(0, n, step):
            b = min(n, a + step)
            z = out[a:b]
            torch.sub(logits[a:b], lse[a:b].unsqueeze(1), out=z)
            z.exp_()
            z.scatter_add_(1, targets[a:b].unsqueeze(1), minus_one[: b - a])
            z.mul_(grad_ce[a:b].unsqueeze(1))
        return out, None, None


def per_sample_lm_loss_from_logits(
    logits: torch.Tensor, batch: Mapping[str, torch.Tensor], *, inplace_grad: bool = False
) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample, Tensor[B], from logits (B, T-1, V) of ``tokens[:, :-1]``.

    The optional ``batch["loss_mask"]`` (B, T) marks which tokens count as prediction targets (task samples
    are padded; padding must never count). A sample with no counted target contributes 0 rather than NaN.
    Shared by the plain model, the Composer wrapper and the GRAPE probe so all three score the same loss.
    The cross-entropy keeps only the logits for its backward (`_LeanCrossEntropy`); `inplace_grad=True`
    lets the backward overwrite them with their gradient (only when the caller never reads them again).
    """
    targets, mask = lm_targets(batch)
    owned = inplace_grad
    if logits.dtype in (torch.float16, torch.bfloat16):  # half-precision logits: softmax in float32
        logits, owned = logits.float(), True  # a private copy: its storage can take the gradient
    flat = logits.reshape(-1, logits.shape[-1])
    inplace = owned and flat.is_contiguous() and _INPLACE_GRAD_OK.get()
    ce = _LeanCrossEntropy.apply(flat, targets.reshape(-1), inplace).view(targets.shape)
    return _watched_sample_means(ce, mask)


def _watched_sample_means(ce: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Each sample's mean over its counted token losses (0 with none), shown to the loss watcher with the token
    losses behind it (in-step alignments and the loss-driven methods read them)."""
    if mask is None:
        return watch_losses(ce.mean(dim=1), ce)
    m = mask.to(ce.dtype)
    return watch_losses((ce * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0), ce, m)


def per_sample_lm_loss_from_full_logits(logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """:func:`per_sample_lm_loss_from_logits` for logits of every position, (B, T, V) of ``tokens`` (what an HF
    causal LM returns for ``input_ids=tokens``): the last position's target is ignored rather than its logits
    sliced off, so the (B, T, V) array is never copied -- the way HF's own causal-LM loss pads its labels."""
    tokens = batch["tokens"].long()
    targets = torch.cat([tokens[:, 1:], tokens.new_full((tokens.shape[0], 1), -100)], dim=1).to(logits.device)
    if logits.dtype in (torch.float16, torch.bfloat16):  # half-precision logits: softmax in float32
        logits = logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                         reduction="none").view(targets.shape)[:, :-1]
    return _watched_sample_means(ce, lm_targets(batch)[1])


def per_sample_lm_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample: Tensor[B] (see per_sample_lm_loss_from_logits).

    `batch["tokens"]` is (B, T) integer ids; the optional `batch["loss_mask"]` (B, T) marks counted targets.
    For our `GPT` the logits are the head's fresh output, read by nothing else, so the loss's backward
    writes their gradient into them (one tokens x vocab array at the peak instead of 3-4). Inside the fused
    probe (an observer installed, `head_loss.py`) our GPT's logits are never formed whole: the head and
    the loss run in sample chunks and the head's per-group gradient goes to the probe.
    """
    tokens = batch["tokens"].long()[:, :-1]
    if isinstance(model, GPT):
        observer = current_head_observer(model.head)
        if observer is not None:
            targets, mask = lm_targets(batch)
            return observed_head_loss(model.hidden(tokens), model.head, targets, mask, observer,
                                      lambda logits: per_sample_lm_loss_from_logits(logits, batch, inplace_grad=True))
    logits = model(tokens)
    return per_sample_lm_loss_from_logits(logits, batch, inplace_grad=isinstance(model, GPT))


def causal_lm_kwargs(model: nn.Module, input_ids: torch.Tensor, **extra: Any) -> dict[str, Any]:
    """Keyword arguments of a probe's call of a transformers-style causal LM: the KV cache off where the
    model's config has one (a probe never decodes)."""
    kwargs: dict[str, Any] = {"input_ids": input_ids, **extra}
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs["use_cache"] = False
    return kwargs


def per_sample_causal_lm_loss(
    model: nn.Module, kwargs: dict[str, Any], batch: Mapping[str, torch.Tensor],
    forward: Optional[Callable[[], Any]] = None,
) -> torch.Tensor:
    """Per-sample loss (as above) of a model called as ``model(**kwargs)`` returning logits or an output with
    ``.logits`` (any HF ``*ForCausalLM``; ``kwargs["input_ids"]`` = ``tokens[:, :-1]``). Inside the fused
    probe a transformers causal LM whose logits are exactly ``lm_head(base_model(...)[0])`` runs its head
    in sample chunks (`head_loss.py`): no tokens x vocab array. ``forward`` replaces ``model(**kwargs)``
    on the plain path (a wrapper called the way its trainer calls it)."""
    targets, mask = lm_targets(batch)
    chunked = observed_causal_lm_loss(model, kwargs, targets, mask,
                                      lambda logits: per_sample_lm_loss_from_logits(logits, batch))
    if chunked is not None:
        return chunked
    out = model(**kwargs) if forward is None else forward()
    return per_sample_lm_loss_from_logits(out if isinstance(out, torch.Tensor) else out.logits, batch)
