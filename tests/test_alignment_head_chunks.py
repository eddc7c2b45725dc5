"""Our GPT's head and loss in sample chunks inside the fused probe (head_loss.py, grape/gram/head_chunks.py):
exact against one autograd.grad per group, the logits never formed for the whole probe, and the plain
path taken again when the loss is not used as the probe announced."""

from __future__ import annotations

import pytest
import torch

import grape_stream.models.head_loss as head_loss
from _alignment_helpers import (
    SEQ,
    VOCAB,
    gpt,
    lm_groups,
    one_thread,  # noqa: F401  (autouse: one torch thread)
    rel_err,
    truth_gram,
)
from grape_stream.grape.gram.group_gram import group_gram
from grape_stream.models import per_sample_lm_loss

SIZES = [3, 1, 4, 2, 5]  # K=2 domains, N=3 tasks



@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("samples_per_chunk", [1, 2, 64])  # 2: chunks straddle group boundaries
@pytest.mark.parametrize("micro", [None, 4])
def test_chunked_head_is_exact(tie: bool, samples_per_chunk: int, micro, monkeypatch) -> None:
    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", samples_per_chunk * (SEQ - 1) * VOCAB)
    model = gpt(tie_embeddings=tie)
    groups = lm_groups(SIZES)
    want, want_losses = truth_gram(model, per_sample_lm_loss, groups)
    gram, losses, info = group_gram(model, per_sample_lm_loss, groups, micro_batch_size=micro, return_info=True)
    assert rel_err(gram, want) <= 1e-10
    assert rel_err(losses, want_losses) <= 1e-12
    assert info.fallback_params == []
    if tie:
        assert info.fast_path["tok_emb.weight"] == "head+rows"
    else:
        assert info.fast_path["head.weight"] == "head" and info.fast_path["tok_emb.weight"] == "rows"
    assert info.timings["head_s"] > 0


def test_the_head_never_sees_the_whole_probe() -> None:
    """Only the one-sample layout probes call the head module; the probe's own forward goes through the
    chunks (a head call on the whole probe is what holds a tokens x vocab array)."""
    model = gpt()
    seen: list[int] = []
    handle = model.head.register_forward_hook(lambda m, args, out: seen.append(int(out.shape[0])))
    try:
        group_gram(model, per_sample_lm_loss, lm_groups(SIZES))
    finally:
        handle.remove()
    assert max(seen, default=0) < sum(SIZES)


def test_a_loss_used_otherwise_falls_back_to_the_head_hooks() -> None:
    """A per-sample loss that rescales the chunked loss sends it another gradient than announced: the
    probe reruns with the head as a plain module (its hooks) and is still exact."""

    def doubled(model, batch):
        return 2.0 * per_sample_lm_loss(model, batch)

    model = gpt()
    groups = lm_groups(SIZES)
    want, _ = truth_gram(model, doubled, groups)
    gram, _, info = group_gram(model, doubled, groups, return_info=True)
    assert rel_err(gram, want) <= 1e-10
    assert info.fast_path["tok_emb.weight"] == "dense+rows"
    assert info.timings["head_s"] == 0


def test_outside_the_probe_the_loss_is_the_plain_one() -> None:
    """With no observer installed, per_sample_lm_loss is the logits path (training, evaluation)."""
    model = gpt()
    batch = lm_groups([3])[0]
    calls: list[int] = []
    handle = model.head.register_forward_hook(lambda m, args, out: calls.append(1))
    try:
        per_sample_lm_loss(model, batch).sum().backward()
    finally:
        handle.remove()
    assert calls == [1] and model.head.weight.grad is not None


@pytest.mark.parametrize("family,head_param,label", [
    ("hf-gpt2", "transformer.wte.weight", "head+rows"),  # tied to the input embedding
    ("hf-llama", "lm_head.weight", "head"),
])
def test_transformers_causal_lm_head_in_chunks(family: str, head_param: str, label: str) -> None:
    from grape_stream.testing.families import FamilySize, build_family

    model, loss, _ = build_family(family, FamilySize(vocab=VOCAB, seq=SEQ), torch.float64, seed=2)
    groups = lm_groups(SIZES, seed=2)
    want, want_losses = truth_gram(model, loss, groups)
    gram, losses, info = group_gram(model, loss, groups, micro_batch_size=4, return_info=True)
    assert rel_err(gram, want) <= 1e-10 and rel_err(losses, want_losses) <= 1e-12
    assert info.fast_path[head_param] == label and info.fallback_params == []


def test_logits_changed_after_the_head_keep_the_plain_path() -> None:
    """A causal LM that scales its logits after lm_head (as Cohere and Gemma 2 do) fails the one-sample
    check, so the probe scores the model's own logits through the head's hooks."""
    from grape_stream.models import per_sample_causal_lm_loss
    from grape_stream.testing.families import FamilySize, build_family

    lm, _, _ = build_family("hf-llama", FamilySize(vocab=VOCAB, seq=SEQ), torch.float64, seed=2)

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm
            self.base_model = lm.model

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm.lm_head

        def forward(self, **kwargs):
            return 2.0 * self.lm(**kwargs).logits

    model = Scaled()

    def loss(m, batch):
        return per_sample_causal_lm_loss(m, {"input_ids": batch["tokens"].long()[:, :-1]}, batch)

    groups = lm_groups(SIZES, seed=2)
    want, _ = truth_gram(model, loss, groups)
    gram, _, info = group_gram(model, loss, groups, return_info=True)
    assert rel_err(gram, want) <= 1e-10
    assert info.fast_path["lm.lm_head.weight"] == "dense" and info.timings["head_s"] == 0


class _MPTTransformer(torch.nn.Module):
    """MPTModel's call shape over the MPT copy's layers: input_ids -> (last_hidden_state,)."""

    def __init__(self, mpt: torch.nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.blocks, self.norm_f = mpt.wte, mpt.wpe, mpt.blocks, mpt.norm_f

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return (self.norm_f(x),)


class _MPTForCausalLM(torch.nn.Module):
    """llm-foundry 0.22 MPTForCausalLM's interface (what the probe sees of it): ``transformer``, the tied
    SharedEmbedding as output embeddings (unembedding with ``wte(x, True)``), ``base_model`` the model
    itself (MPT's base_model_prefix names no attribute), and an optional ``logit_scale``."""

    def __init__(self, logit_scale=None) -> None:
        super().__init__()
        from grape_stream.testing.families import FamilySize, build_family

        mpt, _, _ = build_family("mpt", FamilySize(vocab=VOCAB, seq=SEQ), torch.float64, seed=3, real_mpt=False)
        self.transformer = _MPTTransformer(mpt)
        self.logit_scale = logit_scale

    @property
    def base_model(self) -> torch.nn.Module:
        return self

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.transformer.wte

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        from types import SimpleNamespace

        logits = self.transformer.wte(self.transformer(input_ids)[0], True)
        return SimpleNamespace(logits=logits if self.logit_scale is None else logits * self.logit_scale)


@pytest.mark.parametrize("logit_scale,label", [(None, "head+rows"), (0.5, "dense+rows")])
def test_mpt_tied_shared_embedding_head_in_chunks(logit_scale, label) -> None:
    """llm-foundry's MPT: the head is the input embedding unembedding with its own weight
    (SharedEmbedding(x, unembed=True)) and the base is ``transformer``. Its head runs in chunks and the Gram
    stays exact; with a logit_scale the one-sample check keeps the plain path (exact through the hooks)."""
    from grape_stream.models import per_sample_causal_lm_loss

    model = _MPTForCausalLM(logit_scale).eval()

    def loss(m, batch):
        return per_sample_causal_lm_loss(m, {"input_ids": batch["tokens"].long()[:, :-1]}, batch)

    groups = lm_groups(SIZES, seed=4)
    want, want_losses = truth_gram(model, loss, groups)
    for micro in (None, 4):
        gram, losses, info = group_gram(model, loss, groups, micro_batch_size=micro, return_info=True)
        assert rel_err(gram, want) <= 1e-10 and rel_err(losses, want_losses) <= 1e-12
        assert info.fast_path["transformer.wte.weight"] == label and info.fallback_params == []
        assert (info.timings["head_s"] > 0) == (logit_scale is None)
