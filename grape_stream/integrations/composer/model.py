"""ComposerGPT (a ComposerModel for any ``tokens -> logits`` decoder) and the probe loss GRAPE uses for
Composer models, so that the alignments GRAPE measures are of the objective being trained."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
from composer.models import ComposerModel
from torch import nn

from grape_stream.head_loss import observed_causal_lm_loss
from grape_stream.models import (
    lm_targets,
    per_sample_causal_lm_loss,
    per_sample_lm_loss,
    per_sample_lm_loss_from_logits,
)
from grape_stream.recipe.model import HFTokensToLogits

__all__ = ["ComposerGPT", "composer_per_sample_loss"]


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
        sample chunks (grape_stream/head_loss.py) instead of forming the logits of the whole probe."""
        if isinstance(self.model, HFTokensToLogits):
            kwargs = {"input_ids": batch["tokens"].long()[:, :-1], "use_cache": False}
            return per_sample_causal_lm_loss(self.model.lm, kwargs, batch)
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
        inner = getattr(model, "model", None)
        if isinstance(inner, nn.Module):
            kwargs: dict[str, Any] = {"input_ids": inputs, "attention_mask": torch.ones_like(inputs)}
            if getattr(getattr(inner, "config", None), "use_cache", None) is not None:
                kwargs["use_cache"] = False
            targets, mask = lm_targets(batch)
            chunked = observed_causal_lm_loss(inner, kwargs, targets, mask,
                                              lambda logits: per_sample_lm_loss_from_logits(logits, batch))
            if chunked is not None:
                return chunked
        out = model({"input_ids": inputs, "attention_mask": torch.ones_like(inputs)})
        logits = out.logits if hasattr(out, "logits") else out
        if isinstance(logits, Mapping):
            logits = logits["logits"]
        return per_sample_lm_loss_from_logits(logits, batch)
    return per_sample_lm_loss(model, batch)
