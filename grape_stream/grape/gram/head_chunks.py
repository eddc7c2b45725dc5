"""The fused Gram's side of the chunked LM head (`grape_stream/models/head_loss.py`): the head weight's per-group
gradient built during the forward, chunk by chunk, so the probe never holds the (tokens x vocab) logits.

Why a separate path: for an LM head the module hooks would receive the logits' gradient, a (tokens x
vocab) array (5.8 GB at K=20, N=8, 4 x 256 tokens per group, vocab 50k), while the per-group gradient
it reduces to is (groups x vocab x d_model) (2.2 GB there; 1 GB at K=7, N=6). `HeadChunks` receives each
chunk's (already scaled) logit gradient and input, adds them into the per-group buffer of the current
micro-batch, and after the micro-batch's last chunk hands that buffer to the parameter's
`RowAccumulator` as one contribution: from there on the Gram arithmetic (self terms, cross terms with
the tied embedding or with earlier micro-batches, what is held) is the same as for any other use.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from grape_stream.grape.gram.accumulators import TensorContribution
from grape_stream.grape.gram.capabilities import AUTO
from grape_stream.grape.gram.hooks import FusedGramEngine

__all__ = ["HeadChunks"]


class HeadChunks:
    """A `head_loss.HeadObserver` for one `group_gram` attempt."""

    def __init__(self, engine: FusedGramEngine, group_weights: Tensor, enabled: bool) -> None:
        self.engine = engine
        self.group_weights = group_weights  # (G,) float64: the weight of each group's mean loss (1 / size)
        self.enabled = enabled
        # heads: bias-free linears, and capability-checked modules (an embedding that also unembeds: MPT)
        self.params: dict[int, nn.Parameter] = {
            id(m): ps["weight"] for _, m, kind, ps in engine.modules
            if kind in ("linear", AUTO) and set(ps) == {"weight"}
        }
        self.buf: Optional[Tensor] = None  # (G_m, vocab, d_model) per-group gradient of this micro-batch
        self.seconds = 0.0

    def wants(self, head: nn.Module) -> bool:
        e = self.engine
        return self.enabled and e.capturing and e.mode is None and e.micro is not None and id(head) in self.params

    def upstream(self) -> Tensor:
        micro = self.engine.micro
        assert micro is not None, "HeadChunks.upstream outside a micro-batch"
        return self.group_weights[micro.sample_groups]

    def quietly(self, fn: Callable[[], Any]) -> Any:
        return self.engine.quietly(fn)

    def contribute(self, head: nn.Module, d: Tensor, x: Tensor, samples: tuple[int, int], rows: int) -> None:
        t0 = time.perf_counter()
        micro = self.engine.micro
        assert micro is not None, "HeadChunks.contribute outside a micro-batch"
        a, b = samples
        with torch.autocast(device_type=d.device.type, enabled=False):
            if self.buf is None:
                self.buf = torch.zeros((len(micro.sample_segments), d.shape[1], x.shape[1]), dtype=d.dtype,
                                       device=d.device)
            for li, (sa, sb) in enumerate(micro.sample_segments):
                lo, hi = max(a, sa), min(b, sb)
                if lo < hi:  # this local group's samples inside the chunk: its token rows of d and x
                    r0, r1 = (lo - a) * rows, (hi - a) * rows
                    self.buf[li].addmm_(d[r0:r1].t(), x[r0:r1])
            if b == micro.batch_size:
                self._absorb(self.params[id(head)], micro.groups)
        self.seconds += time.perf_counter() - t0

    def _absorb(self, p: nn.Parameter, groups: Tensor) -> None:
        """The micro-batch's per-group head gradient joins the Gram like any module use's contribution."""
        buf, self.buf = self.buf, None
        assert buf is not None
        e = self.engine
        s = e.scales.get(id(p))
        if s is not None:
            buf.mul_(s)
        acc = e.accumulator(p, buf.dtype)
        acc.absorb(TensorContribution(buf, groups), e.keep_rows(p), e.gram, e.budget, label="head")
