"""A Composer callback that scores multiple-choice items with the trained model at the end of fit
(:func:`grape_stream.mixture.choice.choice_accuracy`): the benchmark's accuracy column."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from composer.core import Callback, State
from composer.loggers import Logger

from grape_stream.mixture.choice import choice_accuracy

__all__ = ["ChoiceAccuracy"]


class ChoiceAccuracy(Callback):
    """``items``: per target, ``{"question", "choices", "label"}`` dicts; ``encode``: text -> token ids (the
    corpus's tokenizer). After fit, ``scores[target] = {"acc", "acc_norm", "items"}``."""

    def __init__(self, items: Mapping[str, Sequence[Mapping[str, Any]]], encode: Callable[[str], Sequence[int]],
                 *, max_len: int | None = None, batch_size: int = 64) -> None:
        self.items = {k: list(v) for k, v in items.items()}
        self.encode = encode
        self.max_len = max_len
        self.batch_size = batch_size
        self.scores: dict[str, dict[str, float]] = {}

    def fit_end(self, state: State, logger: Logger) -> None:
        model = state.model
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                for name, items in self.items.items():
                    self.scores[name] = choice_accuracy(lambda t: model({"tokens": t}), self.encode, items,
                                                        batch_size=self.batch_size, max_len=self.max_len)
        finally:
            model.train(was)
