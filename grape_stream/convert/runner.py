"""Runs a conversion's work units: in this process for one worker, else in a process pool.

Each worker runs whole units (`grape_stream.convert.unit.run_unit`) and sends progress through a queue;
the parent yields each unit's done-marker as it completes, so finalising can start before the last unit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from grape_stream.convert.unit import UnitJob, run_unit
from grape_stream.stale_temp import sweep_stale_multiprocessing_dirs

__all__ = ["Runner"]

_QUEUE: Any = None  # the progress queue, in a worker process


def _worker_init(q: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and terminates the pool
    # Pool.terminate() stops workers with SIGTERM and then waits for them. A forked worker inherits the
    # parent's Python-level SIGTERM handler (importing Composer installs one that calls sys.exit), which
    # only runs between bytecodes: a worker inside a long C call never exits and terminate() waits
    # forever (seen: a --strict error in one worker hung the conversion). The default action always kills.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # One core per worker: parallelism comes from --workers, not from tokenizers' own thread pool.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    global _QUEUE
    _QUEUE = q


def _worker_run(job: UnitJob) -> dict[str, Any]:
    def report(p: dict[str, Any]) -> None:
        _QUEUE.put(p)

    return run_unit(job, report)


def _start_method() -> str:
    """fork where available: workers start in milliseconds instead of re-importing torch (via
    streaming) for seconds each. GRAPE_STREAM_CONVERT_START_METHOD=spawn|forkserver overrides it."""
    env = os.environ.get("GRAPE_STREAM_CONVERT_START_METHOD")
    if env:
        return env
    return "fork" if "fork" in mp.get_all_start_methods() and sys.platform != "darwin" else "spawn"


@contextmanager
def _no_tokenizer_threads_in_children() -> Iterator[None]:
    """Workers are forked while this is set, so each tokenizes on one thread (parallelism comes from
    --workers) and tokenizers does not warn about forking after its thread pool was used."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


class Runner:
    """Runs units and yields their markers as they complete: in this process for one worker (or one
    unit), else in a process pool whose workers each run whole units."""

    def __init__(self, jobs: list[UnitJob], workers: int) -> None:
        self.jobs = jobs
        self.workers = min(workers, len(jobs))
        self.pool: Any = None
        self.queue: Any = None

    def __enter__(self) -> "Runner":
        if self.workers > 1:
            sweep_stale_multiprocessing_dirs()  # what killed conversions left in the temp dir
            ctx = mp.get_context(_start_method())
            self.queue = ctx.Queue()
            with _no_tokenizer_threads_in_children():
                self.pool = ctx.Pool(self.workers, initializer=_worker_init, initargs=(self.queue,))
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self.pool is not None:
            if exc_type is None:
                self.pool.close()
            else:
                self.pool.terminate()  # an error (or Ctrl-C): stop the other units now; they are redone on resume
            self.pool.join()

    def _drain(self, on_progress: Callable[[dict[str, Any]], None], timeout: float) -> None:
        try:
            while True:
                on_progress(self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait())
        except queue_mod.Empty:
            pass

    def results(self, on_progress: Callable[[dict[str, Any]], None]) -> Iterator[dict[str, Any]]:
        """Each unit's done-marker as it completes; a worker's exception (e.g. --strict) re-raised here."""
        if self.pool is None:
            for job in self.jobs:
                yield run_unit(job, on_progress)
            return
        pending = [self.pool.apply_async(_worker_run, (job,)) for job in self.jobs]
        while pending:
            self._drain(on_progress, 0.1)
            still = []
            for res in pending:
                if res.ready():
                    yield res.get()
                else:
                    still.append(res)
            pending = still
        self._drain(on_progress, 0.0)
