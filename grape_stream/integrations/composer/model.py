"""ComposerGPT (a ComposerModel for any ``tokens -> logits`` decoder) and the probe loss GRAPE uses for
Composer models, so that the alignments GRAPE measures are of the objective being trained."""

from __future__ import annotations

import sys
from typing import Any, Mapping, Optional

import torch
from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
from composer.models import ComposerModel
from torch import nn

from grape_stream.models import (
    causal_lm_kwargs,
    lm_targets,
    per_sample_causal_lm_loss,
    per_sample_lm_loss,
    per_sample_lm_loss_from_logits,
)
from grape_stream.recipe.model import HFTokensToLogits

__all__ = ["ComposerGPT", "composer_model", "composer_per_sample_loss"]


class ComposerGPT(ComposerModel):
    """A ComposerModel around any decoder ``module(tokens (B, T)) -> logits (B, T, V)``.

    The training loss is the mean over samples of the per-sample LM loss of
    :func:`grape_stream.models.per_sample_lm_loss` (padding never counts), the same loss the GRAPE probe
    differentiates, so alignments measure the objective being trained. Metrics are token-level
    cross-entropy (log-perplexity) and perplexity, honouring ``loss_mask``.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.model = module
        self.train_metrics = {"LanguageCrossEntropy": LanguageCrossEntropy()}
        self.val_metrics = {"LanguageCrossEntropy": LanguageCrossEntropy(), "LanguagePerplexity": LanguagePerplexity()}

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["tokens"].long()[:, :-1])

    def per_sample_loss_from_logits(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return per_sample_lm_loss_from_logits(logits, batch)

    def per_sample_loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """What the GRAPE probe differentiates: Tensor[B]. Through `per_sample_lm_loss` (our GPT) or
        `per_sample_causal_lm_loss` (a transformers LM), so that inside the fused probe the head runs in
        sample chunks (grape_stream/models/head_loss.py) instead of forming the logits of the whole probe."""
        if isinstance(self.model, HFTokensToLogits):
            lm = self.model.lm
            return per_sample_causal_lm_loss(lm, causal_lm_kwargs(lm, batch["tokens"].long()[:, :-1]), batch)
        return per_sample_lm_loss(self.model, batch)

    def loss(self, outputs: torch.Tensor, batch: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.per_sample_loss_from_logits(outputs, batch).mean()

    def eval_forward(self, batch: Mapping[str, torch.Tensor], outputs: Optional[Any] = None) -> torch.Tensor:
        return outputs if outputs is not None else self.forward(batch)

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        targets, mask = lm_targets(batch)
        targets = targets.clone()
        if mask is not None:
            targets[mask == 0] = -100
        metric.update(outputs, targets)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return self.train_metrics if is_train else self.val_metrics


def composer_per_sample_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Default probe loss: Tensor[B] of mean next-token cross-entropy (``loss_mask`` honoured).

    * a model with ``per_sample_loss(batch)`` (ComposerGPT) uses it;
    * another ComposerModel (llm-foundry's ComposerHFCausalLM / ComposerMPTCausalLM, Composer's
      HuggingFaceModel) is called the way its trainer calls it, with ``{"input_ids", "attention_mask"}``,
      and its logits are scored here; inside the fused probe, when it wraps a transformers causal LM
      (``.model``) whose logits are exactly ``lm_head(base_model(...)[0])``, that LM's head runs in sample
      chunks instead (:func:`grape_stream.models.per_sample_causal_lm_loss`): no logits of the whole probe;
    * a plain ``tokens -> logits`` module goes through :func:`grape_stream.models.per_sample_lm_loss`.
    """
    fn = getattr(model, "per_sample_loss", None)
    if callable(fn):
        return fn(batch)
    if isinstance(model, ComposerModel):
        # The inputs are tokens[:, :-1] (a causal LM's logits there do not depend on the last token): the
        # same shapes on both paths, which the fused probe's layout check needs.
        inputs = batch["tokens"].long()[:, :-1]
        ones = torch.ones_like(inputs)

        def forward() -> torch.Tensor:
            out = model({"input_ids": inputs, "attention_mask": ones})
            logits = out.logits if hasattr(out, "logits") else out
            return logits["logits"] if isinstance(logits, Mapping) else logits

        inner = getattr(model, "model", None)
        if isinstance(inner, nn.Module):
            return per_sample_causal_lm_loss(inner, causal_lm_kwargs(inner, inputs, attention_mask=ones), batch,
                                             forward=forward)
        return per_sample_lm_loss_from_logits(forward(), batch)
    return per_sample_lm_loss(model, batch)


def composer_model(module: torch.nn.Module) -> ComposerModel:
    """A prebuilt model as the Trainer's ComposerModel.

    A ComposerModel is used as it is (it must take the mixer's batches: ``tokens``, ``loss_mask``); a
    transformers causal LM (``PreTrainedModel``: HF Llama, llm-foundry's MPTForCausalLM, ...) is called as
    ``lm(input_ids=tokens).logits``; any other module must be ``tokens (B, T) -> logits (B, T, V)``. The
    last two train on :class:`ComposerGPT`'s per-sample LM loss, the loss GRAPE probes.
    """
    if isinstance(module, ComposerModel):
        return module
    hf = sys.modules.get("transformers")  # a PreTrainedModel instance means transformers is imported already
    if hf is not None and isinstance(module, hf.PreTrainedModel):
        module = HFTokensToLogits(module)
    return ComposerGPT(module)
