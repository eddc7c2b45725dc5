"""The LM head and its cross-entropy in sample chunks, for the fused probe: no (tokens x vocab) array.

Why: at a 50k vocabulary the logits of a probe (K+N groups x samples x sequence) and their gradient are
most of the fused pass's memory (5.8 GB at K=20, N=8, 4 x 256 tokens per group), while everything the
probe needs from them is small: the loss of each sample, the gradient reaching the hidden states
((tokens x d_model)), and the head weight's per-group gradient. When an observer (the fused Gram's
`grape/gram/head_chunks.py`) is installed with :func:`observing_lm_head`, :func:`observed_head_loss`
computes all three chunk by chunk in the forward, then drops each chunk:

* per chunk of samples: logits = x W^T, logsumexp, cross-entropy, u = softmax - onehot, u W (kept:
  tokens x d_model), and u scaled by the gradient each sample's loss *will* receive (the observer knows
  it: the probe backpropagates sum_i w_i loss_i), handed to the observer with x;
* the backward only scales the kept u W by the gradient that actually arrives, and checks that it is
  the one announced (:class:`HeadGradientMismatch` otherwise, and the probe reruns on the plain path).

The head weight's own gradient is therefore never formed by autograd (the observer takes it per group):
the weight enters detached. Used for our GPT (:func:`grape_stream.models.per_sample_lm_loss`) and for
transformers causal LMs (:func:`observed_causal_lm_loss`, via ``models.per_sample_causal_lm_loss``):
models whose embedding is called before their head (the probe's tied-weight bookkeeping relies on it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import weakref
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

__all__ = ["SOFTMAX_ELEMENTS", "HeadGradientMismatch", "HeadObserver", "current_head_observer",
           "observed_causal_lm_loss", "observed_head_loss", "observing_lm_head"]

#: logits elements per chunk (whole samples; at least one sample): 256 MiB in fp32. Large enough that the
#: three matmuls per chunk run at full speed
CHUNK_ELEMENTS = 1 << 26
#: logits elements per element-wise pass (softmax, onehot, scaling): 16 MiB, so that they run in cache
SOFTMAX_ELEMENTS = 1 << 22


class HeadObserver(Protocol):
    """What the fused probe provides to take the head's per-group gradient chunk by chunk."""

    def wants(self, head: nn.Module) -> bool:
        """Whether this call of `head` should take the chunked path (the probe's run mode, a fast-path head)."""
        ...

    def upstream(self) -> Tensor:
        """(B,) the gradient each per-sample loss of the current forward will receive."""
        ...

    def contribute(self, head: nn.Module, d: Tensor, x: Tensor, samples: tuple[int, int], rows: int) -> None:
        """d (n, vocab): the logits' gradient of samples [a, b) (`rows` token rows each); x (n, d_model)."""
        ...

    def quietly(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (an extra forward) unseen by the probe's hooks."""
        ...


class HeadGradientMismatch(RuntimeError):
    """The per-sample losses received another gradient than the observer announced (the loss was used
    in some other way than sum_i w_i loss_i): the per-group head gradients formed in the forward are wrong."""


_OBSERVER: contextvars.ContextVar[Optional[HeadObserver]] = contextvars.ContextVar(
    "grape_stream_head_observer", default=None)


@contextlib.contextmanager
def observing_lm_head(observer: HeadObserver) -> Iterator[None]:
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def current_head_observer(head: nn.Module) -> Optional[HeadObserver]:
    """The installed observer when it wants this head (a bias-free Linear), else None."""
    obs = _OBSERVER.get()
    if obs is None or getattr(head, "bias", None) is not None or not obs.wants(head):
        return None
    return obs


class _ObservedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, targets: Tensor, tok_w: Tensor, weight: Tensor, head: nn.Module,
                observer: HeadObserver) -> Tensor:
        b, t, dm = h.shape
        v = weight.shape[0]
        announced = observer.upstream().to(h.dtype)
        losses = torch.empty(b, dtype=h.dtype, device=h.device)
        uw = torch.empty((b, t, dm), dtype=h.dtype, device=h.device)
        step = max(1, CHUNK_ELEMENTS // max(1, t * v))
        rows_in_cache = max(1, SOFTMAX_ELEMENTS // v)
        with torch.no_grad():
            for a in range(0, b, step):
                e = min(b, a + step)
                x = h[a:e].reshape(-1, dm)
                tgt = targets[a:e].reshape(-1, 1)
                scale = (announced[a:e, None] * tok_w[a:e]).reshape(-1, 1)
                u = x @ weight.t()  # (n, V) logits; below softmax - onehot, then scaled, in the same storage
                ce = torch.empty(u.shape[0], dtype=u.dtype, device=u.device)
                for r in range(0, u.shape[0], rows_in_cache):  # the element-wise passes on cache-sized rows
                    z, zt = u[r : r + rows_in_cache], tgt[r : r + rows_in_cache]
                    lse = torch.logsumexp(z, dim=1, keepdim=True)
                    ce[r : r + rows_in_cache] = lse.squeeze(1) - z.gather(1, zt).squeeze(1)
                    z.sub_(lse).exp_()
                    z.scatter_add_(1, zt, torch.full_like(zt, -1, dtype=z.dtype))
                torch.mm(u, weight, out=uw[a:e].view(-1, dm))
                for r in range(0, u.shape[0], rows_in_cache):
                    u[r : r + rows_in_cache].mul_(scale[r : r + rows_in_cache])
                losses[a:e] = (ce.view(e - a, t) * tok_w[a:e]).sum(1)
                observer.contribute(head, u, x, (a, e), t)
                del u, ce
        ctx.save_for_backward(uw, tok_w, announced)
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None, None, None]:
        uw, tok_w, announced = ctx.saved_tensors
        if not torch.allclose(grad, announced, rtol=1e-6, atol=0.0):
            raise HeadGradientMismatch(
                "the per-sample losses received another gradient than the fused probe announced")
        return uw * (grad[:, None] * tok_w).unsqueeze(-1), None, None, None, None, None


def observed_head_loss(h: Tensor, head: nn.Module, targets: Tensor, mask: Optional[Tensor],
                       observer: HeadObserver, from_logits: Callable[[Tensor], Tensor],
                       call: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """Per-sample mean next-token cross-entropy of the logits h W^T, W = `head.weight` (the same loss as
    `models.per_sample_lm_loss_from_logits`), with the head's gradient handed to `observer`.

    h: (B, T, d_model) hidden states before the head; targets: (B, T) token ids; mask: (B, T) counted
    targets or None. Half-precision hidden states (or autocast) are scored the plain way,
    ``from_logits(call(h))`` (``call`` defaults to ``head``; an unembedding embedding passes its own):
    the chunked softmax runs at the hidden states' precision.
    """
    if h.dtype not in (torch.float32, torch.float64) or torch.is_autocast_enabled(h.device.type):
        return from_logits((call or head)(h))
    if mask is None:
        tok_w = torch.full(targets.shape, 1.0 / targets.shape[1], dtype=h.dtype, device=h.device)
    else:
        m = mask.to(h.dtype)
        tok_w = m / m.sum(dim=1, keepdim=True).clamp_min(1.0)
    w = head.weight
    assert isinstance(w, Tensor), "the head's weight is a tensor"
    weight = w.detach().to(h.dtype)
    return _ObservedHeadLoss.apply(h, targets.long(), tok_w, weight, head, observer)


#: transformers model -> whether its logits are exactly lm_head(base_model(...)[0]) (checked once)
_SPLIT_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _unembedding(head: nn.Module) -> Optional[Callable[[Tensor], Tensor]]:
    """How output embeddings turn hidden states into logits, when that is F.linear(x, W): a bias-free
    nn.Linear, or an embedding that unembeds with its own weight (llm-foundry's SharedEmbedding,
    ``forward(x, unembed=True)``, MPT's tied head). None otherwise. (:func:`_split_is_exact` checks it.)"""
    if type(head) is nn.Linear:
        return head if head.bias is None else None
    if isinstance(head, nn.Embedding) and "unembed" in inspect.signature(type(head).forward).parameters:
        return functools.partial(head, unembed=True)
    return None


def _hf_split(model: nn.Module) -> Optional[tuple[nn.Module, nn.Module, Callable[[Tensor], Tensor]]]:
    """(base model, head module, how the head is called) of a transformers ``*ForCausalLM``, duck-typed
    (no import). The base is ``base_model``, or ``transformer`` where ``base_model`` is the model itself
    (llm-foundry's MPTForCausalLM)."""
    get_head, base = getattr(model, "get_output_embeddings", None), getattr(model, "base_model", None)
    if base is model:
        base = getattr(model, "transformer", None)
    if not callable(get_head) or not isinstance(base, nn.Module) or base is model:
        return None
    head = get_head()
    call = _unembedding(head) if isinstance(head, nn.Module) else None
    return None if call is None else (base, head, call)


def _split_is_exact(model: nn.Module, base: nn.Module, head: nn.Module, call: Callable[[Tensor], Tensor],
                    kwargs: dict[str, Any], observer: HeadObserver) -> bool:
    """Once per model, on one sample: are the model's logits call(base(...)[0]), and is that F.linear(h, W)
    of the head's weight, bitwise? A model that scales, soft-caps or biases its logits after the head
    (Gemma 2, Cohere, MPT with logit_scale, ...) fails and keeps the plain path: the chunked loss would
    score other logits."""
    ok = _SPLIT_CHECKED.get(model)
    if ok is None:
        one = {k: v[:1] if isinstance(v, Tensor) else v for k, v in kwargs.items()}

        def both() -> bool:
            with torch.no_grad():
                out = model(**one)
                full = out if isinstance(out, Tensor) else out.logits
                hidden = base(**one)[0]
                part = call(hidden)
                weight = head.weight
                assert isinstance(weight, Tensor)
                linear = torch.nn.functional.linear(hidden, weight)
            return full.shape == part.shape and bool(torch.equal(full, part)) and bool(torch.equal(part, linear))

        ok = bool(observer.quietly(both))
        _SPLIT_CHECKED[model] = ok
    return ok


def observed_causal_lm_loss(model: nn.Module, kwargs: dict[str, Any], targets: Tensor, mask: Optional[Tensor],
                            from_logits: Callable[[Tensor], Tensor]) -> Optional[Tensor]:
    """Inside the fused probe, the chunked-head loss of a transformers causal LM called as
    ``model(**kwargs)``; None when the plain path applies (no probe, no plain Linear head, or logits that
    are not exactly head(base(...)[0])). ``from_logits`` scores half-precision hidden states (see
    :func:`observed_head_loss`)."""
    split = _hf_split(model)
    if split is None:
        return None
    base, head, call = split
    observer = current_head_observer(head)
    if observer is None or not _split_is_exact(model, base, head, call, kwargs, observer):
        return None
    return observed_head_loss(base(**kwargs)[0], head, targets, mask, observer, from_logits, call)

