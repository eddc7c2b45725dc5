"""The recipe's decoder as ``module(tokens) -> logits``: GPT, or a transformers causal LM built from a
config (no download). transformers is imported only for ``model.kind: hf``."""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from torch import nn

from grape_stream.config import DecoderShape, ModelConfig, RecipeConfig, field_names
from grape_stream.models import GPT, GPTConfig
from grape_stream.recipe.schema import as_recipe

__all__ = ["HFTokensToLogits", "build_model"]


class HFTokensToLogits(nn.Module):
    """Adapts a transformers causal LM to ``tokens -> logits`` (what per_sample_lm_loss expects)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, use_cache=False).logits


def _hf_config(m: ModelConfig, vocab_size: int, seq_len: int) -> Any:
    from transformers import AutoConfig

    src = m.hf_config
    assert src is not None, "validate() requires model.hf_config for model.kind=hf"
    overrides = dict(m.hf_overrides)
    if os.path.isdir(src):
        config = AutoConfig.from_pretrained(src, local_files_only=True, **overrides)
    else:
        config = AutoConfig.for_model(src, **overrides)
    if "vocab_size" not in overrides:
        config.vocab_size = vocab_size
    for attr in ("n_positions", "max_position_embeddings"):
        if hasattr(config, attr) and attr not in overrides:
            setattr(config, attr, seq_len)
    return config


def build_model(cfg: RecipeConfig | Mapping[str, Any], *, vocab_size: int, seq_len: int,
                device: Any = None) -> nn.Module:
    """The recipe's decoder. ``device="meta"`` builds it without allocating memory (dry runs)."""
    m = as_recipe(cfg).model
    ctx = torch.device(device) if device is not None else torch.device("cpu")
    if m.kind == "gpt":
        shape = {name: getattr(m, name) for name in field_names(DecoderShape)}
        gcfg = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, **shape)
        with ctx:
            return GPT(gcfg)
    from transformers import AutoModelForCausalLM

    config = _hf_config(m, vocab_size, seq_len)
    with ctx:
        return HFTokensToLogits(AutoModelForCausalLM.from_config(config))
