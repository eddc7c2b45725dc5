"""Reweighters: turn one Gram matrix of probe gradients into new domain weights alpha and task weights z.

    r = build_reweighter("grape", num_domains=K, num_tasks=N)
    alpha, z = r.update(gram, task_losses, lr)

Layout: ``base`` (the Reweighter class: state, input checks, Gram conditioning, history, checkpoints),
``step`` (the functional core: the shared mirror-descent step as a pure function), ``step_rule`` (how
big a step is: the default KL trust region, the paper's lr / mu, constant; pure functions), ``from_scores``
(updates from in-step scores instead of a Gram: ``alignments: steps``), ``from_losses`` (updates from
the training steps' per-domain losses: the loss-driven online methods), ``options`` (the
options dataclasses every method builds on, their checks, the paper's defaults PAPER_MU_ALPHA /
PAPER_MU_Z), ``gram_input`` (reading, checking, clipping the Gram), ``noise`` (the math of the options
beyond the paper: cosine alignments, Gram / alpha EMA), ``state`` (exact JSON forms), ``registry`` (the
one method list and the functions that read it), and one file per method family, each with its options
dataclass, its pure step function and its classes: ``fixed`` (uniform, static), ``doge`` (doge,
doge_pcgrad, the PCGrad coefficient math: ``doge_step``), ``grape`` (grape, grape_gap, grape_ema:
``grape_step``), ``rnb`` (R&B's Balance from the training steps' domain Gram: ``rnb_step``), ``odm`` (ODM's
EXP3 bandit on training losses: ``odm_step``), ``ado`` and ``ado_fit`` (ADO's per-domain power-law fits of the
training losses: ``ado_step``). docs/reweighting.md has the equations as implemented.

Adding a method: one file here with an options dataclass (fields = the options it accepts, ``resolve``
= their checks), its step as a pure function, and a ``Reweighter`` subclass decorated with ``@register``
(``method``, ``description``, ``Options``, ``signal`` (where its updates' numbers come from, a
``config.choices.Signal``; default: the probe), ``moves_alpha`` / ``moves_z``, and
``_scores`` / ``_step`` calling the pure function); then one import line in the ``isort: off`` block
below (its position there is the method's position in every listing). Adding an option: one field (and
its check) in one options dataclass. The recipe's method choices and option checks, the controller's
methods and option filtering all read the registry.
"""

from __future__ import annotations

from grape_stream.grape.reweighting.base import GRAM_ASYMMETRY_RTOL, Reweighter
from grape_stream.grape.reweighting.from_losses import DomainLosses
from grape_stream.grape.reweighting.options import (
    PAPER_MU_ALPHA,
    PAPER_MU_Z,
    NoiseOptions,
    ReweighterOptions,
    StepOptions,
)
from grape_stream.grape.reweighting.registry import (
    REWEIGHTERS,
    all_options,
    available_methods,
    build_reweighter,
    method_description,
    method_needs_probe,
    method_options,
    method_signal,
    register,
    reweighter_from_state_dict,
)
from grape_stream.grape.reweighting.state import STATE_FORMAT
from grape_stream.grape.reweighting.step import WeightStep, condition_gram, mirror_step

# The method files. Their import order is the registry's order, i.e. the order methods are listed
# everywhere (recipe choices, docs, demo), so the import sorter must leave this block alone.
# isort: off
from grape_stream.grape.reweighting.fixed import StaticOptions, StaticReweighter, UniformReweighter
from grape_stream.grape.reweighting.doge import (
    DogePCGradOptions,
    DogePCGradReweighter,
    DogeReweighter,
    doge_step,
    pcgrad_coefficients,
    pcgrad_task_orders,
)
from grape_stream.grape.reweighting.grape import (
    GrapeEmaOptions,
    GrapeEmaReweighter,
    GrapeGapReweighter,
    GrapeOptions,
    GrapeReweighter,
    grape_step,
)
from grape_stream.grape.reweighting.rnb import RnbOptions, RnbReweighter, rnb_step
from grape_stream.grape.reweighting.doremi import (
    DoremiOptions,
    DoremiReweighter,
    average_alpha_from_trajectory,
    doremi_step,
)
from grape_stream.grape.reweighting.odm import OdmOptions, OdmReweighter, odm_step
from grape_stream.grape.reweighting.ado import AdoOptions, AdoReweighter, ado_step
# isort: on

__all__ = [
    "GRAM_ASYMMETRY_RTOL",
    "PAPER_MU_ALPHA",
    "PAPER_MU_Z",
    "REWEIGHTERS",
    "STATE_FORMAT",
    "AdoOptions",
    "AdoReweighter",
    "DomainLosses",
    "DogePCGradOptions",
    "DogePCGradReweighter",
    "DogeReweighter",
    "DoremiOptions",
    "DoremiReweighter",
    "GrapeEmaOptions",
    "GrapeEmaReweighter",
    "GrapeGapReweighter",
    "GrapeOptions",
    "GrapeReweighter",
    "NoiseOptions",
    "OdmOptions",
    "OdmReweighter",
    "Reweighter",
    "ReweighterOptions",
    "RnbOptions",
    "RnbReweighter",
    "StaticOptions",
    "StaticReweighter",
    "StepOptions",
    "UniformReweighter",
    "WeightStep",
    "ado_step",
    "all_options",
    "available_methods",
    "average_alpha_from_trajectory",
    "build_reweighter",
    "condition_gram",
    "doge_step",
    "doremi_step",
    "grape_step",
    "method_description",
    "method_needs_probe",
    "method_options",
    "method_signal",
    "mirror_step",
    "odm_step",
    "pcgrad_coefficients",
    "pcgrad_task_orders",
    "register",
    "reweighter_from_state_dict",
    "rnb_step",
]
