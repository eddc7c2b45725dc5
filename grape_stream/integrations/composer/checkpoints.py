"""Make a checkpoint folder resumable after a kill at any moment of a save.

Composer 0.32 writes ``ep{epoch}-ba{batch}-rank{rank}.pt`` in place (no temporary name) and then points
the ``latest-rank{rank}.pt`` symlink at it. A SIGKILL (OOM killer, preemption) in between leaves either a
truncated file, or a complete file that ``latest`` does not name. Autoresume then loads the older
checkpoint and refuses to start because the newer file "may conflict with a future checkpoint"
(FileExistsError), forever.

:func:`recover_checkpoint_folder` runs before the Trainer is built, on every rank for its own files: a
truncated checkpoint (a torch zip archive without its central directory, which torch.save writes last)
is moved aside into ``.grape_discarded/`` (never deleted), and ``latest`` is pointed at the newest complete
checkpoint, so a complete-but-unlinked save is used rather than thrown away. :func:`recover_before_autoresume`
applies it to a recipe's ``trainer.save_folder`` as Composer names it (``grape-stream train``).
"""

from __future__ import annotations

import logging
import os
import re
import zipfile
from dataclasses import dataclass, field

from composer.utils import dist, format_name_with_dist, parse_uri

__all__ = ["DISCARDED_DIR", "SAVE_FILENAME", "SAVE_LATEST_FILENAME", "Recovery", "checkpoint_is_complete",
           "recover_before_autoresume", "recover_checkpoint_folder"]

logger = logging.getLogger(__name__)

DISCARDED_DIR = ".grape_discarded"

# Composer 0.32.1's defaults, passed to the Trainer explicitly so that recovery and Composer agree on the names
SAVE_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"
SAVE_LATEST_FILENAME = "latest-rank{rank}.pt"


@dataclass
class Recovery:
    latest: str | None = None  # file name the latest symlink points at afterwards
    discarded: list[str] = field(default_factory=list)  # truncated files moved into DISCARDED_DIR
    relinked: bool = False  # the latest symlink was created or moved


def checkpoint_is_complete(path: str) -> bool:
    """True when `path` is a whole torch.save archive (its zip central directory is present and readable).

    Reads only the end of the file, so it costs the same for a 10 MB and a 10 GB checkpoint.
    """
    try:
        with zipfile.ZipFile(path) as z:
            return bool(z.namelist())
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return False


def _pattern(save_filename: str, rank: int) -> re.Pattern[str]:
    regex = re.escape(save_filename)
    for unit in ("epoch", "batch", "sample", "token"):
        regex = regex.replace(re.escape("{" + unit + "}"), f"(?P<{unit}>\\d+)")
    regex = regex.replace(re.escape("{rank}"), str(rank))
    return re.compile(f"^{regex}$")


def recover_checkpoint_folder(
    folder: str,
    *,
    rank: int = 0,
    save_filename: str = "ep{epoch}-ba{batch}-rank{rank}.pt",
    latest_filename: str = "latest-rank{rank}.pt",
) -> Recovery:
    """Discard truncated checkpoints of `rank` in `folder` and point `latest` at the newest complete one."""
    out = Recovery()
    if not os.path.isdir(folder):
        return out
    if not save_filename.endswith(".pt") or "{batch}" not in save_filename:
        logger.warning("checkpoint recovery skipped: only uncompressed '.pt' names with {batch} are checked (%s)",
                       save_filename)
        return out
    pat = _pattern(save_filename, rank)
    found = []
    for name in os.listdir(folder):
        m = pat.match(name)
        if m and not os.path.islink(os.path.join(folder, name)):
            key = tuple(int(m.groupdict().get(u) or 0) for u in ("epoch", "batch", "sample", "token"))
            found.append((key, name))
    complete = []
    for _key, name in sorted(found):
        path = os.path.join(folder, name)
        if checkpoint_is_complete(path):
            complete.append(name)
            continue
        os.makedirs(os.path.join(folder, DISCARDED_DIR), exist_ok=True)
        os.replace(path, os.path.join(folder, DISCARDED_DIR, name))
        out.discarded.append(name)
        logger.warning("checkpoint %s was cut off by a kill during its save; moved to %s/ and resuming from "
                       "the newest complete checkpoint", path, DISCARDED_DIR)
    latest = os.path.join(folder, latest_filename.format(rank=rank))
    if not complete:
        if os.path.islink(latest):
            os.unlink(latest)  # it names a discarded file: autoresume must start fresh, not fail to load
            out.relinked = True
        return out
    newest = complete[-1]
    out.latest = newest
    current = os.readlink(latest) if os.path.islink(latest) else None
    if current is None or os.path.basename(current) != newest:
        tmp = f"{latest}.tmp.{os.getpid()}"
        os.symlink(newest, tmp)
        os.replace(tmp, latest)
        out.relinked = True
        logger.warning("checkpoint %s was complete but not yet linked as %s; linked it", newest, latest)
    return out


def recover_before_autoresume(save_folder: str | None, run_name: str, *, save_filename: str = SAVE_FILENAME,
                              latest_filename: str = SAVE_LATEST_FILENAME) -> Recovery | None:
    """Make this rank's checkpoints in a local ``save_folder`` resumable after a kill during a save.

    Called before the Composer Trainer is built, on every rank (for its own ``-rank{rank}`` files), when
    ``trainer.autoresume`` is on. The folder is formatted as Composer formats it (``{run_name}``, ``{rank}``,
    ...). A checkpoint cut off by a kill (0 bytes, or a torch archive without its end) is moved into
    ``<save_folder>/.grape_discarded/`` (kept, never deleted); ``latest`` is pointed at the newest complete
    checkpoint, which may be a complete save the kill left unlinked. Without this, Composer 0.32.1 resumes
    from the older ``latest`` and then refuses to start (``FileExistsError: ... may conflict with a future
    checkpoint``) on every retry.

    Remote save folders (``s3://...`` and other object stores) are left alone and None is returned: an
    object store shows an upload only once it is complete, and this check reads local files only. None
    too without a save folder. A ``save_filename`` other than an uncompressed ``.pt`` with ``{batch}`` is
    not checked (logged; see :func:`recover_checkpoint_folder`).
    """
    if not save_folder:
        return None
    backend, _, _ = parse_uri(save_folder)
    if backend:
        logger.debug("checkpoint recovery skipped for the remote save folder %s", save_folder)
        return None
    folder = format_name_with_dist(save_folder, run_name)
    rank = dist.get_global_rank()
    rec = recover_checkpoint_folder(folder, rank=rank, save_filename=format_name_with_dist(save_filename, run_name),
                                    latest_filename=format_name_with_dist(latest_filename, run_name))
    if rec.discarded or rec.relinked:
        logger.warning("autoresume, rank %d: checkpoint folder %s recovered after a kill during a save: moved %s "
                    "into %s/, resuming from %s", rank, folder, rec.discarded or "nothing", DISCARDED_DIR,
                    rec.latest or "the start (no complete checkpoint)")
    return rec
