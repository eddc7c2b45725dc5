"""Multiple-choice accuracy by option log-likelihood, as lm-evaluation-harness scores ARC, SciQ, ...:
for each item the context is ``"Question: <q>\\nAnswer:"`` and each option the continuation
``" <option>"``; the model picks the option with the highest log-likelihood.

Two scores, as the harness reports them: ``acc`` (sum of the continuation's token log-probabilities)
and ``acc_norm`` (that sum divided by the continuation's length in bytes, which removes the bias
towards short options).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["choice_accuracy", "option_logprobs"]


@torch.no_grad()
def option_logprobs(logits_fn: Callable[[torch.Tensor], torch.Tensor], contexts: Sequence[Sequence[int]],
                    continuations: Sequence[Sequence[int]], *, batch_size: int = 64,
                    max_len: int | None = None) -> list[float]:
    """Sum of log p(continuation | context) for each pair. ``logits_fn(tokens[B, T]) -> logits[B, T, V]``
    (causal: right padding does not change earlier positions). With ``max_len`` the context is cut from
    the left so that context + continuation fits."""
    out: list[float] = []
    pairs = list(zip(contexts, continuations))
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i:i + batch_size]
        seqs, spans = [], []
        for ctx, cont in chunk:
            if not cont:
                raise ValueError("an option tokenised to nothing")
            ids = list(ctx) + list(cont)
            if max_len is not None and len(ids) > max_len:
                ids = ids[len(ids) - max_len:]
            seqs.append(ids)
            spans.append((len(ids) - len(cont), len(ids)))
        width = max(len(s) for s in seqs)
        tokens = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            tokens[r, :len(s)] = torch.tensor(s, dtype=torch.long)
        logp = torch.log_softmax(logits_fn(tokens).float(), dim=-1)
        for r, (a, b) in enumerate(spans):
            tgt = tokens[r, a:b]
            out.append(float(logp[r, a - 1:b - 1].gather(-1, tgt.unsqueeze(-1)).sum()))
    return out


def choice_accuracy(logits_fn: Callable[[torch.Tensor], torch.Tensor], encode: Callable[[str], Sequence[int]],
                    items: Sequence[Mapping[str, Any]], *, batch_size: int = 64,
                    max_len: int | None = None) -> dict[str, float]:
    """``acc`` and ``acc_norm`` over items ``{"question", "choices", "label"}`` (chance = 1/len(choices))."""
    if not items:
        raise ValueError("no multiple-choice items to score")
    ctxs, conts = [], []
    for it in items:
        ctx = encode(f"Question: {it['question']}\nAnswer:")
        for opt in it["choices"]:
            ctxs.append(ctx)
            conts.append(encode(" " + str(opt)))
    lp = option_logprobs(logits_fn, ctxs, conts, batch_size=batch_size, max_len=max_len)
    acc = acc_norm = 0
    pos = 0
    for it in items:
        n = len(it["choices"])
        scores = lp[pos:pos + n]
        norm = [s / max(1, len((" " + str(o)).encode("utf-8"))) for s, o in zip(scores, it["choices"])]
        acc += int(max(range(n), key=scores.__getitem__) == int(it["label"]))
        acc_norm += int(max(range(n), key=norm.__getitem__) == int(it["label"]))
        pos += n
    return {"acc": acc / len(items), "acc_norm": acc_norm / len(items), "items": float(len(items))}
