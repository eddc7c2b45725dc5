"""A model's per-sample loss, the one thing every part of grape_stream asks of a model.

One concept in three modules: the small GPT and the per-sample LM loss all parts agree on (``gpt``), the LM
head's cross-entropy in sample chunks for the fused probe (``head_loss``), and the hook through which a training
forward's per-sample loss vector reaches in-step alignments (``loss_watch``). The names users import
(``from grape_stream.models import GPT, per_sample_lm_loss, watch_losses``) live here.
"""

from grape_stream.models.gpt import (
    GPT,
    Block,
    CausalSelfAttention,
    GPTConfig,
    causal_lm_kwargs,
    lm_targets,
    no_inplace_loss_grad,
    per_sample_causal_lm_loss,
    per_sample_lm_loss,
    per_sample_lm_loss_from_full_logits,
    per_sample_lm_loss_from_logits,
)
from grape_stream.models.loss_watch import watch_losses, watching_losses

__all__ = ["GPT", "Block", "CausalSelfAttention", "GPTConfig", "causal_lm_kwargs", "lm_targets",
           "no_inplace_loss_grad", "per_sample_causal_lm_loss", "per_sample_lm_loss",
           "per_sample_lm_loss_from_full_logits", "per_sample_lm_loss_from_logits", "watch_losses", "watching_losses"]
