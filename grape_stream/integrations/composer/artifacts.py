"""The GRAPE trajectory (JSONL), its plot (PNG) and the run summary as tracker artifacts, through Composer's
logger API, so they sit next to the run's metrics in TensorBoard, MLflow and W&B.

What each destination gets (Composer 0.32.1):

- every destination with ``log_images`` (TensorBoard, MLflow, W&B, Comet, Neptune): the plot as the image
  ``grape/trajectory``;
- every destination with ``upload_file`` (W&B with ``log_artifacts=True``: an artifact; a remote
  ``save_folder`` / ``RemoteUploaderDownloader``: the object store; Neptune): the files under ``grape/``;
- MLflow: the files as run artifacts under ``grape/`` (Composer 0.32.1's ``MLFlowLogger`` has no
  ``upload_file``; see :func:`_mlflow_artifacts`);
- W&B without ``log_artifacts``: the files in the run's Files (``wandb.save``), since Composer's
  ``upload_file`` does nothing there.
TensorBoard has no place for arbitrary files: it gets the image (and the metrics it already has).
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import numpy as np
from composer.loggers import Logger, MLFlowLogger, WandBLogger

__all__ = ["log_trajectory_artifacts"]

log = logging.getLogger(__name__)

#: where the files go in every tracker
PREFIX = "grape"


def _png_array(path: str) -> np.ndarray:
    """The PNG as an HWC uint8 RGB array (what every destination's ``log_images`` accepts)."""
    from matplotlib import image as mpimg

    img = np.asarray(mpimg.imread(path))
    if img.dtype != np.uint8:
        img = np.clip(np.rint(img * 255.0), 0, 255).astype(np.uint8)
    if img.ndim == 3 and img.shape[2] == 4:
        img = img[:, :, :3]
    return np.ascontiguousarray(img)


def _mlflow_artifacts(dest: MLFlowLogger, files: Sequence[str]) -> None:
    """Workaround, Composer 0.32.1: ``MLFlowLogger`` implements no ``upload_file``, so ``Logger.upload_file``
    never reaches MLflow; log the files with the logger's own client and run id."""
    client, run_id = getattr(dest, "_mlflow_client", None), getattr(dest, "_run_id", None)
    if not getattr(dest, "_enabled", False) or client is None or run_id is None:
        return
    for path in files:
        client.log_artifact(run_id, path, artifact_path=PREFIX)


def _wandb_files(dest: WandBLogger, files: Sequence[str]) -> None:
    """W&B with ``log_artifacts=False`` (Composer's default) ignores ``upload_file``: keep the files in the run."""
    if not getattr(dest, "_enabled", False) or getattr(dest, "_log_artifacts", False):
        return
    import wandb

    if wandb.run is None:
        return
    for path in files:
        wandb.save(os.path.abspath(path), base_path=os.path.dirname(os.path.abspath(path)), policy="now")


def log_trajectory_artifacts(logger: Logger, files: Sequence[str], plot: str | None, step: int) -> None:
    """Send ``files`` (trajectory JSONL, summary, plot) and the ``plot`` image to every logger destination.

    A tracker failing here is logged as a warning: the run itself has finished and its files are on disk.
    """
    files = [f for f in files if f and os.path.isfile(f)]
    try:
        if plot and os.path.isfile(plot):
            logger.log_images(_png_array(plot), name=f"{PREFIX}/trajectory", channels_last=True, step=step,
                              use_table=False)
        for path in files:
            logger.upload_file(f"{PREFIX}/{os.path.basename(path)}", path, overwrite=True)
        for dest in logger.destinations:
            if isinstance(dest, MLFlowLogger):
                _mlflow_artifacts(dest, files)
            elif isinstance(dest, WandBLogger):
                _wandb_files(dest, files)
    except Exception as exc:  # a tracker problem must not fail a finished training run
        log.warning("could not log the GRAPE trajectory to the trackers: %s: %s", type(exc).__name__, exc)
