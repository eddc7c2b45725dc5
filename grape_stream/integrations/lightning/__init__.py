"""Lightning integration (``lightning.pytorch`` 2.6): GrapeLightningCallback (GRAPE updates, metrics, state in
Lightning checkpoints) and MixerDataModule (the mixer as the train dataloader). See docs/lightning.md.

Names are resolved lazily: importing this package does not import Lightning; using a name does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grape_stream.lazy import lazy_exports

if TYPE_CHECKING:
    from grape_stream.integrations.lightning.callback import GrapeLightningCallback
    from grape_stream.integrations.lightning.data import MixerDataModule

_LAZY = {
    "GrapeLightningCallback": "grape_stream.integrations.lightning.callback",
    "MixerDataModule": "grape_stream.integrations.lightning.data",
}

__all__ = ["GrapeLightningCallback", "MixerDataModule"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
