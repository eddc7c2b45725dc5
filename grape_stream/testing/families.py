"""Tiny members of the model families users pretrain, for the fused-Gram tests and bench/probe_families.py.

Each builder returns ``(model, per_sample_loss, source)`` at one common size, so the probe's fast paths
and its cost can be compared side by side: our GPT, HF GPT-2 (Conv1D, tied head), HF Llama (RMSNorm,
rotary, SwiGLU, untied head), a torchtitan-style Llama written here in plain PyTorch (RMSNorm, rotary
through complex frequencies, F.scaled_dot_product_attention) and llm-foundry's MPT (LPLayerNorm,
SharedEmbedding used as lookup and unembedding). MPT is the real ``llmfoundry`` class when that package
can be imported, otherwise `MPTStyle`, a faithful copy of the parts that matter to the probe (the
forwards of LPLayerNorm and SharedEmbedding are copied from llm-foundry 0.22.0); ``source`` says which.
Norm weights and biases are perturbed away from 1 / 0, as in a trained model, so that a wrong norm
formula cannot hide behind an identity.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grape_stream.models import (
    GPT,
    GPTConfig,
    per_sample_causal_lm_loss,
    per_sample_lm_loss,
    per_sample_lm_loss_from_logits,
)

__all__ = ["FAMILIES", "FamilySize", "LPLayerNorm", "MPTStyle", "SharedEmbedding", "TitanLlama", "build_family"]

FAMILIES = ("gpt", "hf-gpt2", "hf-llama", "torchtitan", "mpt")
PerSampleLoss = Callable[[nn.Module, Mapping[str, Tensor]], Tensor]


@dataclass(frozen=True)
class FamilySize:
    d_model: int = 32
    n_layer: int = 2
    n_head: int = 4
    vocab: int = 300
    seq: int = 16


# ---------------------------------------------------------------------------------- torchtitan-style
class RMSNorm(nn.Module):
    """The RMSNorm of the Llama reference code / older torchtitan (normalises in float32)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _freqs_cis(dim: int, end: int, theta: float = 10000.0) -> Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex64 (T, dim / 2)


def _rotary(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, hd / 2)
    out = torch.view_as_real(xc * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return out.type_as(x)


class _TitanBlock(nn.Module):
    def __init__(self, d: int, n_head: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.n_head = n_head
        self.attention_norm, self.ffn_norm = norm(d), norm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (m(h).view(b, t, self.n_head, d // self.n_head) for m in (self.wq, self.wk, self.wv))
        q, k = _rotary(q, freqs_cis), _rotary(k, freqs_cis)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TitanLlama(nn.Module):
    """A Llama in torchtitan's style: tok_embeddings, layers of (attention_norm, wq/wk/wv/wo with rotary
    from a complex ``freqs_cis`` buffer, ffn_norm, SwiGLU w1/w2/w3), norm, untied output."""

    def __init__(self, size: FamilySize, norm: str = "nn") -> None:
        super().__init__()
        make: Callable[[int], nn.Module] = (lambda d: nn.RMSNorm(d, eps=1e-6)) if norm == "nn" else RMSNorm
        self.tok_embeddings = nn.Embedding(size.vocab, size.d_model)
        self.layers = nn.ModuleList(_TitanBlock(size.d_model, size.n_head, make) for _ in range(size.n_layer))
        self.norm = make(size.d_model)
        self.output = nn.Linear(size.d_model, size.vocab, bias=False)
        self.register_buffer("freqs_cis", _freqs_cis(size.d_model // size.n_head, 2 * size.seq), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


# ---------------------------------------------------------------------------------- MPT-style copy
def _cast_if_autocast_enabled(t: Tensor) -> Tensor:
    """As llm-foundry's: ``torch.is_autocast_enabled()`` without a device is CUDA autocast only."""
    if torch.is_autocast_enabled():
        return t.to(dtype=torch.get_autocast_dtype(t.device.type))
    return t


class LPLayerNorm(nn.LayerNorm):
    """llm-foundry 0.22.0 ``LPLayerNorm``: a LayerNorm subclass whose forward runs in the autocast dtype."""

    def forward(self, x: Tensor) -> Tensor:
        w = _cast_if_autocast_enabled(self.weight) if self.weight is not None else None
        b = _cast_if_autocast_enabled(self.bias) if self.bias is not None else None
        with torch.autocast(enabled=False, device_type=x.device.type):
            return F.layer_norm(_cast_if_autocast_enabled(x), self.normalized_shape, w, b, self.eps)


class SharedEmbedding(nn.Embedding):
    """llm-foundry 0.22.0 ``SharedEmbedding``: one weight for the lookup and (``unembed=True``) the head."""

    def forward(self, input: Tensor, unembed: bool = False) -> Tensor:  # noqa: A002 - llm-foundry's name
        if unembed:
            return F.linear(input, self.weight)
        return super().forward(input)


class _MPTBlock(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.norm_1, self.norm_2 = LPLayerNorm(d), LPLayerNorm(d)
        self.Wqkv, self.out_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up_proj, self.down_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.n_head, -1).transpose(1, 2) for y in self.Wqkv(self.norm_1(x)).chunk(3, -1))
        x = x + self.out_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.down_proj(F.gelu(self.up_proj(self.norm_2(x)), approximate="none"))


class MPTStyle(nn.Module):
    """MPT's shape: SharedEmbedding wte (lookup, then unembedding of the output), learned wpe of
    arange(T), pre-LPLayerNorm blocks (Wqkv, out_proj, up_proj, down_proj) and norm_f."""

    def __init__(self, size: FamilySize) -> None:
        super().__init__()
        self.wte = SharedEmbedding(size.vocab, size.d_model)
        self.wpe = nn.Embedding(size.seq, size.d_model)
        self.blocks = nn.ModuleList(_MPTBlock(size.d_model, size.n_head) for _ in range(size.n_layer))
        self.norm_f = LPLayerNorm(size.d_model)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.wte(self.norm_f(x), True)


# ---------------------------------------------------------------------------------- builders
def _lm_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Per-sample loss of a model called as ``model(tokens) -> logits``."""
    return per_sample_lm_loss_from_logits(model(batch["tokens"].long()[:, :-1]), batch)


def _hf_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Per-sample loss of a model called as ``model(input_ids=tokens).logits`` (HF, llm-foundry)."""
    return per_sample_causal_lm_loss(model, {"input_ids": batch["tokens"].long()[:, :-1]}, batch)


def llmfoundry_available() -> bool:
    return importlib.util.find_spec("llmfoundry") is not None


def _real_mpt(size: FamilySize) -> nn.Module:
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    cfg = MPTConfig(d_model=size.d_model, n_heads=size.n_head, n_layers=size.n_layer, expansion_ratio=4,
                    max_seq_len=size.seq, vocab_size=size.vocab, attn_config={"attn_impl": "torch"},
                    init_device="cpu")
    return MPTForCausalLM(cfg)


def _hf(name: str, size: FamilySize) -> nn.Module:
    import transformers as tf

    if name == "hf-gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=size.n_layer, n_embd=size.d_model, n_head=size.n_head,
                                                vocab_size=size.vocab, n_positions=size.seq))
    cfg = tf.LlamaConfig(vocab_size=size.vocab, hidden_size=size.d_model, intermediate_size=2 * size.d_model,
                         num_hidden_layers=size.n_layer, num_attention_heads=size.n_head,
                         num_key_value_heads=max(1, size.n_head // 2), max_position_embeddings=size.seq,
                         tie_word_embeddings=False)
    return tf.LlamaForCausalLM(cfg)


def build_family(
    name: str, size: Optional[FamilySize] = None, dtype: torch.dtype = torch.float64, seed: int = 0,
    real_mpt: Optional[bool] = None, **kw: Any,
) -> tuple[nn.Module, PerSampleLoss, str]:
    """(model in eval mode and `dtype`, its per-sample loss, where its code comes from).

    ``real_mpt``: None = llm-foundry's MPT when importable, else the copy; True / False force one.
    ``kw`` goes to the torchtitan-style model (``norm="nn"`` for nn.RMSNorm, ``"custom"`` for its own).
    """
    size = size or FamilySize()
    torch.manual_seed(seed)
    loss: PerSampleLoss = _hf_loss
    if name == "gpt":
        model: nn.Module = GPT(GPTConfig(vocab_size=size.vocab, seq_len=size.seq, n_layer=size.n_layer,
                                         n_head=size.n_head, d_model=size.d_model, d_ff=4 * size.d_model))
        loss, source = per_sample_lm_loss, "grape_stream.models.GPT"
    elif name in ("hf-gpt2", "hf-llama"):
        model = _hf(name, size)
        source = f"transformers {type(model).__name__}"
    elif name == "torchtitan":
        model, loss = TitanLlama(size, **kw), _lm_loss
        source = f"torchtitan-style Llama ({kw.get('norm', 'nn')} RMSNorm)"
    elif name == "mpt":
        use_real = llmfoundry_available() if real_mpt is None else real_mpt
        if use_real:
            model, source = _real_mpt(size), "llmfoundry MPTForCausalLM"
        else:
            model, loss, source = MPTStyle(size), _lm_loss, "MPT-style copy (llm-foundry not importable)"
    else:
        raise ValueError(f"unknown model family {name!r}; expected one of {FAMILIES}")
    # .double() / .float() cast floating tensors only (Module.to(dtype) would drop freqs_cis' imaginary part)
    model = {torch.float64: model.double, torch.float32: model.float}.get(dtype, lambda: model.to(dtype))()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm weights / biases: away from the identity, as after training
                p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p))
    return model.eval(), loss, source
