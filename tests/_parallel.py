"""What keeps a test safe when `make test` runs the suite on parallel pytest-xdist workers (see tests/conftest.py).

Importable from test modules and from the processes they spawn (``tests/`` is on their path).
"""

from __future__ import annotations

import os
import socket
from typing import Callable

_handed_out: set[int] = set()


def worker_index() -> int:
    """This xdist worker's number (``gw3`` -> 3); 0 outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name[2:].isdigit() else 0


def worker_count() -> int:
    """How many xdist workers run the suite; 1 outside xdist."""
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that no other worker of this run can be handed.

    The kernel's "bind port 0" alone lets two workers that ask at once both be given a port the first has not
    bound yet (a rendezvous of one job joining the other's); here each worker keeps to its own residue class
    (port // 2 % workers == worker index: Linux hands bind(0) odd ports only, so the parity says nothing) and
    never hands out a port twice, so only processes outside the suite can still race for it.
    """
    index, count = worker_index(), worker_count()
    for _ in range(10_000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port // 2 % count == index and port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free TCP port on 127.0.0.1")


#: What the fork server of `spawn` imports once per worker (the ranks' heavy imports).
SPAWN_PRELOAD = ("torch", "torch.distributed.fsdp", "streaming", "composer", "grape_stream.integrations.composer",
                 "grape_stream.grape.controller")


def spawn(fn: Callable[..., None], args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)`` with the ranks forked from a server that has
    imported `SPAWN_PRELOAD` (multiprocessing's "forkserver" start method) instead of fresh interpreters that
    import torch, streaming and Composer again: those imports were most of a short multi-rank test's CPU.

    Each rank is still its own process that runs ``fn(rank, *args)`` on a freshly imported stack (the server only
    imports: no thread, tensor or process group exists when it forks). The server keeps the environment it was
    started with, so each rank is handed this process's environment as it is now (and its TMPDIR). Tests that
    check shared memory or the resource tracker (the mixer's) keep ``mp.spawn``: a forked rank shares this
    process's resource tracker."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(SPAWN_PRELOAD))
    mp.start_processes(_in_env, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True,
                       start_method="forkserver")


def _in_env(rank: int, env: dict[str, str], fn: Callable[..., None], args: tuple) -> None:
    import tempfile

    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None
    fn(rank, *args)
