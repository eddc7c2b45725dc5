"""Make a checkpoint folder resumable after a kill at any moment of a save.

Composer 0.32 writes ``ep{epoch}-ba{batch}-rank{rank}.pt`` in place (no temporary name) and then points
the ``latest-rank{rank}.pt`` symlink at it. A SIGKILL (OOM killer, preemption) in between leaves either a
truncated file, or a complete file that ``latest`` does not name. Autoresume then loads the older
checkpoint and refuses to start because the newer file "may conflict with a future checkpoint"
(FileExistsError), forever.

:func:`recover_checkpoint_folder` runs before the Trainer is built, on every rank for its own files: a
truncated checkpoint (a torch zip archive without its central directory, which torch.save writes last)
is moved aside into ``.grape_discarded/`` (never deleted), and ``latest`` is pointed at the newest complete
checkpoint, so a complete-but-unlinked save is used rather than thrown away.
"""

from __future__ import annotations

import logging
import os
import re
import zipfile
from dataclasses import dataclass, field

__all__ = ["Recovery", "recover_checkpoint_folder", "checkpoint_is_complete", "DISCARDED_DIR"]

logger = logging.getLogger(__name__)

DISCARDED_DIR = ".grape_discarded"


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
