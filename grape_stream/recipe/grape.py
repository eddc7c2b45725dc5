"""The recipe's ``algorithm`` section -> the keyword arguments of a GRAPE algorithm in any trainer.

Options that belong to another method (``mu_z`` under ``method: doge``) are dropped with a log line, so a
recipe written for GRAPE runs unchanged with ``algorithm.method=uniform``; an option no method knows is
an error that names it.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from grape_stream.errors import ConfigError
from grape_stream.grape.controller import REPLAY_METHOD, filter_reweighter_options

__all__ = ["algorithm_kwargs"]

log = logging.getLogger(__name__)


def algorithm_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``GrapeAlgorithm(tasks=..., **algorithm_kwargs(cfg))`` (or a controller)."""
    a = cfg["algorithm"]
    method = a["method"]
    options = dict(a["options"])
    if options.get("step_size") == "constant":
        mus = {}
    else:
        mus = {k: a[k] for k in ("mu_alpha", "mu_z") if a[k] is not None}
    kept, dropped = filter_reweighter_options(method, {**mus, **options}, strict=False)
    if dropped:
        log.info("algorithm.method=%s ignores options that belong to other methods: %s", method, sorted(dropped))
    controller_opts: dict[str, Any] = {"probe_mode": a["probe_mode"]}
    if a.get("geometry", "sgd") != "sgd":  # options beyond the paper: passed only when set
        controller_opts["geometry"] = a["geometry"]
    if a.get("alignments", "probe") != "probe":
        controller_opts.update(alignments=a["alignments"], alignment_steps=a["alignment_steps"])
    if a.get("probe_rse") is not None:
        controller_opts.update(probe_rse=a["probe_rse"], probe_batch_bounds=list(a["probe_batch_bounds"]))
    if method == REPLAY_METHOD:
        if not a["schedule_path"]:
            raise ConfigError("algorithm.method=schedule needs algorithm.schedule_path (a trajectory JSONL)")
        controller_opts.update(schedule_path=a["schedule_path"], schedule_stretch=a["schedule_stretch"])
    return {
        "method": method,
        "alpha_every": a["alpha_every"],
        "z_every": a["z_every"],
        "probe_domain_batch": a["probe_domain_batch"],
        "probe_task_batch": a["probe_task_batch"],
        "mu_alpha": kept.pop("mu_alpha", None),
        "mu_z": kept.pop("mu_z", None),
        "seed": a["seed"],
        **controller_opts,
        **kept,
    }
