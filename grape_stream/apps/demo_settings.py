"""What the demo changes relative to the ``demo-cpu`` recipe: :class:`DemoSettings`, and the two presets
(:data:`DEMO` for ``grape-stream demo``, :data:`QUICK` for ``--quick``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["BYTES_MODEL_DATA", "DEMO", "QUICK", "DemoSettings"]

#: The earlier byte-level demo's model and data (``--setting bytes``, ``bench/mixture_quality.py``): six high-resource
#: sources, seven low-resource targets, the byte tokenizer (vocab 257), a 2-layer decoder on 256-byte sequences.
BYTES_MODEL_DATA = (
    "model.vocab_size=257", "model.n_layer=2", "model.n_head=4", "model.d_model=128", "model.d_ff=512",
    "data.seq_len=256", "data.domains=[en,fr,de,es,ru,it]", "data.tasks=[tr,da,ca,pl,nl,uk,pt]",
)


@dataclass(frozen=True)
class DemoSettings:
    """What the demo changes relative to the ``demo-cpu`` recipe (everything else comes from it).

    ``mu_alpha`` / ``mu_z`` / ``clip_norm``: None (the default) runs GRAPE with the library's own step rule, a
    KL trust region per update that needs no tuning (grape.reweighting.step_rule); numbers give the paper's
    eta = lr / mu (with clipping), as the earlier, hand-tuned demo did (docs/results.md: eta 10, clip_norm 1).
    ``curve_every`` / ``curve_samples``: the test-loss curve (strided subset per target). ``model_data``: the
    recipe overrides of the model and the data (the byte-level setting's unless the pool's replaces them:
    the recipe itself is the pool setting's GRAPE run, so ``make demo``'s next command reproduces a run).
    """

    steps: int = 400
    global_batch: int = 32
    lr: float = 2.0e-3
    warmup: int = 20
    update_every: int = 25
    probe_domain_batch: int = 8
    probe_task_batch: int = 8
    mu_alpha: float | None = None  # None: the library's step rule (trust region); a number: the paper's lr / mu
    mu_z: float | None = None
    clip_norm: float | None = None
    curve_every: int = 50
    curve_samples: int = 64
    eval_batch_size: int = 64
    final_eval: bool = True  # the recipe's evaluators on the whole test split at the last step
    final_samples: int = 192  # without final_eval: a larger strided subset per target, at the last step
    model_data: tuple[str, ...] = BYTES_MODEL_DATA

    def replace(self, **changes: Any) -> "DemoSettings":
        return dataclasses.replace(self, **changes)


#: `grape-stream demo` (7.2 minutes for three methods measured on 2 idle CPU cores).
DEMO = DemoSettings()
#: `grape-stream demo --quick` (1.3 minutes measured on 2 idle CPU cores).
QUICK = DemoSettings(steps=48, warmup=8, update_every=8, curve_every=16, curve_samples=32, final_eval=False,
                     final_samples=96)
