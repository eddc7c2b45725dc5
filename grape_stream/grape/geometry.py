"""Alignment in the optimizer's geometry: AdamW's per-coordinate step scale, read from its state.

The paper scores a domain by <g_k, h_n>, the first-order progress of task n if training moved along g_k
as SGD would. AdamW moves along g / (sqrt(v_hat) + eps) instead, so the progress it actually makes on
task n is <h_n, g_k / (sqrt(v_hat) + eps)> (issue 13, part 3). With ``geometry="adam"`` the fused Gram
weights every parameter element by w = 1 / (sqrt(v_hat) + eps), G[a, b] = sum_p <g_a,p, w_p * g_b,p>,
with v_hat = exp_avg_sq / (1 - beta2^step) bias-corrected exactly as Adam's own step does (torch
Adam/AdamW and Composer's DecoupledAdamW; AMSGrad's max_exp_avg_sq when enabled).

The weights are computed lazily, one parameter at a time, when the Gram pass asks for them
(:class:`AdamPreconditioner` is a Mapping), so no model-sized copy is held. Before the optimizer's first
step there is no v: the controller then falls back to w = 1 (SGD geometry) and says so in the record.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor, nn

from grape_stream.config.choices import Geometry, values

__all__ = ["GEOMETRIES", "AdamPreconditioner", "adam_preconditioner"]

GEOMETRIES = values(Geometry)


class AdamPreconditioner(Mapping[nn.Parameter, Tensor]):
    """parameter -> 1 / (sqrt(v_hat) + eps), computed on access from the optimizer state (no copy kept).

    A parameter the optimizer holds no state for (it never received a gradient) gets w = 1.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        self._params = params
        self._groups: dict[int, Mapping[str, Any]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._groups[id(p)] = group
        self._state = optimizer.state
        self.missing = [p for p in params if "exp_avg_sq" not in self._state.get(p, {})]

    def __getitem__(self, p: nn.Parameter) -> Tensor:
        state = self._state.get(p, {})
        if "exp_avg_sq" not in state:
            return torch.ones_like(p)
        group = self._groups[id(p)]
        beta2, eps = float(group["betas"][1]), float(group["eps"])
        step = state["step"]
        step = float(step.item() if isinstance(step, Tensor) else step)
        v = state["max_exp_avg_sq"] if group.get("amsgrad") and "max_exp_avg_sq" in state else state["exp_avg_sq"]
        denom = (v.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)  # exactly Adam's step denominator
        return denom.reciprocal_().to(p.dtype)

    def __iter__(self) -> Iterator[nn.Parameter]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def adam_preconditioner(optimizer: Any, model: nn.Module) -> tuple[AdamPreconditioner | None, str]:
    """(the preconditioner, what was used) for the model's trainable parameters.

    Returns ``(None, "sgd: ...")`` before the optimizer's first step (no second moment yet). An optimizer
    that is not of the Adam family is an error: its geometry is not AdamW's.
    """
    if optimizer is None:
        raise ValueError("geometry='adam' needs the optimizer: pass optimizer= to GrapeController.maybe_update")
    groups = getattr(optimizer, "param_groups", None)
    if not groups or not all("betas" in g and "eps" in g for g in groups):
        raise ValueError(
            f"geometry='adam' needs an Adam-family optimizer (param groups with betas and eps, state exp_avg_sq); "
            f"got {type(optimizer).__name__}"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    pre = AdamPreconditioner(optimizer, params)
    if len(pre.missing) == len(params):
        return None, "sgd: the optimizer has no second moment yet (before its first step)"
    if pre.missing:
        return pre, f"adam ({len(pre.missing)} of {len(params)} parameters without optimizer state: w = 1)"
    return pre, "adam"
