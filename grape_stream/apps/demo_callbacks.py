"""The two callbacks that watch a demo run: a test-loss curve on a fixed strided subset of each target's
test split, and a tqdm progress bar (train loss, current test average, heaviest source weight)."""

from __future__ import annotations

import sys
import time
from typing import Any, Mapping, Sequence

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from torch.nn import functional as F
from tqdm.auto import tqdm

from grape_stream.apps.demo_settings import DemoSettings
from grape_stream.grape.tasks import collate_task_samples

__all__ = ["Progress", "TestCurve", "strided_indices"]


def strided_indices(n_total: int, n: int) -> list[int]:
    """n indices spread over the whole split (the test files are ordered by source document, so the
    first n samples would all come from one documentation package)."""
    n = min(n, n_total)
    return sorted({int(round(i * (n_total - 1) / max(n - 1, 1))) for i in range(n)})


class TestCurve(Callback):
    """Token-level test cross-entropy of each target on a fixed strided subset, every few steps."""

    __test__ = False  # not a pytest class

    def __init__(self, settings: DemoSettings) -> None:
        self.settings = settings
        self.tasks: list[Any] = []
        self.batches: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.final_batches: dict[str, list[dict[str, torch.Tensor]]] | None = None
        self.steps: list[int] = []
        self.loss: dict[str, list[float]] = {}
        self.final: dict[str, float] = {}
        self.final_step: int | None = None
        self.eval_seconds = 0.0

    def prepare(self, tasks: Sequence[Any]) -> None:
        s = self.settings
        self.tasks = list(tasks)
        self.batches = self._subset(s.curve_samples)
        self.final_batches = None if s.final_eval else self._subset(s.final_samples)
        self.loss = {t.name: [] for t in self.tasks}

    def _subset(self, n: int) -> dict[str, list[dict[str, torch.Tensor]]]:
        out = {}
        for t in self.tasks:
            ds = t.dataset(t.test_split)
            samples = [ds[i] for i in strided_indices(ds.num_samples, n)]
            bs = self.settings.eval_batch_size
            out[t.name] = [collate_task_samples(samples[i:i + bs]) for i in range(0, len(samples), bs)]
        return out

    @torch.no_grad()
    def _ce(self, state: State, subset: Mapping[str, list[dict[str, torch.Tensor]]]) -> dict[str, float]:
        t0 = time.perf_counter()
        model = state.model
        was = model.training
        model.eval()
        out = {}
        try:
            for name, batches in subset.items():
                tot, cnt = 0.0, 0.0
                for b in batches:
                    logits = model(b)
                    tgt = b["tokens"].long()[:, 1:]
                    m = b["loss_mask"][:, 1:].to(torch.float64)
                    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1),
                                         reduction="none").view(tgt.shape).double()
                    tot += float((ce * m).sum())
                    cnt += float(m.sum())
                out[name] = tot / max(cnt, 1.0)
        finally:
            model.train(was)
        self.eval_seconds += time.perf_counter() - t0
        return out

    def _measure(self, state: State) -> None:
        for name, v in self._ce(state, self.batches).items():
            self.loss[name].append(v)
        self.steps.append(int(state.timestamp.batch))

    def fit_start(self, state: State, logger: Logger) -> None:
        self._measure(state)

    def batch_end(self, state: State, logger: Logger) -> None:
        step = int(state.timestamp.batch)
        if step % self.settings.curve_every == 0 or step == self.settings.steps:
            self._measure(state)
        if step == self.settings.steps and self.final_batches is not None:
            self.final, self.final_step = self._ce(state, self.final_batches), step

    def eval_after_all(self, state: State, logger: Logger) -> None:
        vals = {}
        for t in self.tasks:
            metric = state.eval_metrics.get(t.name, {}).get("LanguageCrossEntropy")
            if metric is not None:
                vals[t.name] = float(metric.compute())
        if vals:
            self.final, self.final_step = vals, int(state.timestamp.batch)

    def latest_avg(self) -> float | None:
        if not self.steps:
            return None
        return sum(v[-1] for v in self.loss.values()) / max(len(self.loss), 1)


class Progress(Callback):
    """One tqdm bar per run: train loss, the current test average and the heaviest source weight."""

    def __init__(self, curve: TestCurve, method: str, *, progress: bool, position: str,
                 line: int | None = None) -> None:
        self.curve = curve
        self.line = line  # the bar's terminal line when runs share the terminal (None: tqdm's own choice)
        self.method = method
        self.progress = progress
        self.position = position
        self.bar: Any = None
        self.train_loss: list[tuple[int, float]] = []

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.progress:
            self.bar = tqdm(total=self.curve.settings.steps, desc=f"{self.position} {self.method:<11}", unit="step",
                            leave=True, dynamic_ncols=True, file=sys.stderr, position=self.line)

    def batch_end(self, state: State, logger: Logger) -> None:
        step = int(state.timestamp.batch)
        loss = float(state.loss.detach()) if isinstance(state.loss, torch.Tensor) else float("nan")
        if step % 5 == 0 or step == 1:
            self.train_loss.append((step, loss))
        if self.bar is None:
            return
        post = {"train": f"{loss:.3f}"}
        avg = self.curve.latest_avg()
        if avg is not None:
            post["test avg"] = f"{avg:.3f}"
        algo = next((a for a in state.algorithms if type(a).__name__ == "GrapeAlgorithm"), None)
        ctl = getattr(algo, "controller", None)
        if ctl is not None and self.method != "uniform":
            k = int(ctl.alpha.argmax())
            post["top source"] = f"{ctl.domain_names[k]} {ctl.alpha[k]:.2f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
