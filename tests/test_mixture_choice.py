"""Multiple-choice scoring by option log-likelihood: against a slow token-by-token computation on a real
(small, randomly initialised) GPT, and accuracy on items whose answer a hand-built model knows."""

from __future__ import annotations

import math

import pytest
import torch

from grape_stream.mixture.choice import choice_accuracy, option_logprobs
from grape_stream.models import GPT, GPTConfig


def test_option_logprobs_match_a_slow_prefix_by_prefix_computation() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, seq_len=32, n_layer=1, n_head=2, d_model=16, d_ff=32)).eval()
    ctxs = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    conts = [[10, 11], [12, 13, 14], [15]]
    fast = option_logprobs(model, ctxs, conts, batch_size=2)
    for ctx, cont, got in zip(ctxs, conts, fast):
        want, prefix = 0.0, list(ctx)
        for tok in cont:  # one forward pass per continuation token, reading the last position only
            with torch.no_grad():
                logits = model(torch.tensor([prefix]))[0, -1].double()
            want += float(torch.log_softmax(logits, -1)[tok])
            prefix.append(tok)
        assert got == pytest.approx(want, abs=1e-4)
    # cutting the context from the left to fit max_len keeps the continuation whole
    cut = option_logprobs(model, [[5, 6, 7, 8, 9]], [[15]], max_len=3)[0]
    with torch.no_grad():
        ref = float(torch.log_softmax(model(torch.tensor([[8, 9]]))[0, -1].double(), -1)[15])
    assert cut == pytest.approx(ref, abs=1e-4)


def _char_model(prefer: dict[int, int], vocab: int = 128):
    """A bigram 'model' over bytes: after byte a it puts log-odds 5 on byte prefer[a]."""
    def logits(tokens: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*tokens.shape, vocab)
        for a, b in prefer.items():
            out[..., b] += 5.0 * (tokens == a).float()
        return out
    return logits


def test_choice_accuracy_acc_and_length_normalised_acc_norm() -> None:
    def encode(s: str) -> list[int]:
        return list(s.encode())

    # after ':' the model expects ' ', after ' ' it expects 'y': the option "y" wins, the others lose
    model = _char_model({ord(":"): ord(" "), ord(" "): ord("y")})
    items = [{"question": "q1", "choices": ["n", "y", "m"], "label": 1},
             {"question": "q2", "choices": ["y", "n", "m"], "label": 0},
             {"question": "q3", "choices": ["y", "n", "m"], "label": 2}]
    res = choice_accuracy(model, encode, items)
    assert res["acc"] == pytest.approx(2 / 3) and res["acc_norm"] == pytest.approx(2 / 3) and res["items"] == 3
    # a long option loses on the summed log-likelihood but can win once normalised by its length
    long_items = [{"question": "q", "choices": ["yyyyyyyy", "n"], "label": 0}]
    model = _char_model({ord(":"): ord(" "), ord(" "): ord("y"), ord("y"): ord("y")})
    res = choice_accuracy(model, encode, long_items)
    assert res["acc_norm"] == 1.0
    lp = option_logprobs(model, [encode("Question: q\nAnswer:")] * 2, [encode(" yyyyyyyy"), encode(" n")])
    assert (lp[0] > lp[1]) == (res["acc"] == 1.0) and all(math.isfinite(v) for v in lp)
    with pytest.raises(ValueError, match="no multiple-choice items"):
        choice_accuracy(model, encode, [])
