"""Reweighters: turn one Gram matrix of probe gradients into new domain weights alpha and task weights z.

    r = build_reweighter("grape", num_domains=K, num_tasks=N)
    alpha, z = r.update(gram, task_losses, lr)

Layout: ``base`` (the Reweighter class: checks, clipping, log-space steps, history, state), ``options``
(option checks and the paper's defaults PAPER_MU_ALPHA / PAPER_MU_Z), ``gram_input`` (reading, checking,
clipping the Gram), ``noise`` (options beyond the paper: cosine alignments, Gram / alpha EMA), ``state`` (exact
JSON forms),
``registry`` (the one method list and the functions that read it), and one file per method family:
``fixed`` (uniform, static), ``doge`` (doge, doge_pcgrad, the PCGrad coefficient math), ``grape``
(grape, grape_gap, grape_ema). docs/reweighting.md has the equations as implemented.

Adding a method: write one file here with a ``Reweighter`` subclass decorated with ``@register``
(class attributes ``method``, ``description``, ``options_accepted``, ``needs_probe``, ``moves_alpha`` /
``moves_z``, and ``_alignments``), then add one import line to the ``isort: off`` block below (its
position there is the method's position in every listing). The recipe's method choices, the
controller's methods and option filtering all read the registry.
"""

from __future__ import annotations

from grape_stream.grape.reweighting.base import GRAM_ASYMMETRY_RTOL, Reweighter
from grape_stream.grape.reweighting.options import PAPER_MU_ALPHA, PAPER_MU_Z
from grape_stream.grape.reweighting.registry import (
    REWEIGHTERS,
    all_options,
    available_methods,
    build_reweighter,
    method_description,
    method_needs_probe,
    method_options,
    register,
    reweighter_from_state_dict,
)
from grape_stream.grape.reweighting.state import STATE_FORMAT

# The method files. Their import order is the registry's order, i.e. the order methods are listed
# everywhere (recipe choices, docs, demo), so the import sorter must leave this block alone.
# isort: off
from grape_stream.grape.reweighting.fixed import StaticReweighter, UniformReweighter
from grape_stream.grape.reweighting.doge import (
    DogePCGradReweighter,
    DogeReweighter,
    pcgrad_coefficients,
    pcgrad_task_orders,
)
from grape_stream.grape.reweighting.grape import GrapeEmaReweighter, GrapeGapReweighter, GrapeReweighter
# isort: on

__all__ = [
    "GRAM_ASYMMETRY_RTOL",
    "PAPER_MU_ALPHA",
    "PAPER_MU_Z",
    "REWEIGHTERS",
    "STATE_FORMAT",
    "DogePCGradReweighter",
    "DogeReweighter",
    "GrapeEmaReweighter",
    "GrapeGapReweighter",
    "GrapeReweighter",
    "Reweighter",
    "StaticReweighter",
    "UniformReweighter",
    "all_options",
    "available_methods",
    "build_reweighter",
    "method_description",
    "method_needs_probe",
    "method_options",
    "pcgrad_coefficients",
    "pcgrad_task_orders",
    "register",
    "reweighter_from_state_dict",
]
