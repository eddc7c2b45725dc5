"""Stale multiprocessing temp folders (left by SIGKILLed DataLoader runs) are swept; live ones are not."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from grape_stream.stale_temp import sweep_stale_multiprocessing_dirs


def _bind(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1)
    return s


def test_only_folders_whose_sockets_nobody_binds_are_removed(tmp_path):
    live, dead, other = tmp_path / "pymp-live", tmp_path / "pymp-dead", tmp_path / "pymp-other"
    for d in (live, dead, other):
        d.mkdir()
    keep = _bind(str(live / "listener-a"))
    _bind(str(dead / "listener-b")).close()  # the socket file stays, nobody listens: a killed owner
    (other / "notes.txt").write_text("not a multiprocessing folder's content")
    (tmp_path / "unrelated").mkdir()
    try:
        removed = sweep_stale_multiprocessing_dirs(str(tmp_path))
    finally:
        keep.close()
    assert removed == [str(dead)]
    assert live.exists() and other.exists() and (tmp_path / "unrelated").exists()


def test_a_sigkilled_dataloader_run_leaves_a_folder_that_is_then_swept(tmp_path):
    code = (
        "import os, signal, tempfile, torch\n"
        f"tempfile.tempdir = {str(tmp_path)!r}\n"
        "dl = torch.utils.data.DataLoader(list(range(64)), batch_size=4, num_workers=2)\n"
        "it = iter(dl); next(it); next(it)\n"
        "os.killpg(os.getpgrp(), signal.SIGKILL)\n"  # the whole job, workers too (OOM killer, preemption)
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, start_new_session=True)
    assert proc.returncode == -9
    left = [n for n in os.listdir(tmp_path) if n.startswith("pymp-")]
    assert left, "expected the killed run to leave its pymp-* folder behind"
    assert sorted(os.path.basename(p) for p in sweep_stale_multiprocessing_dirs(str(tmp_path))) == sorted(left)
