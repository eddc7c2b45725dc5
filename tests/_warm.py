"""Training-script subprocesses started warm: each run is a fork of a server interpreter that has already
imported the training stack, instead of a fresh `python script.py` that imports it again.

Why: a tiny training run in these tests costs about 2 CPU-seconds, importing its stack (torch, streaming,
Transformers, Composer, Lightning) about 8; the SIGKILL/resume tests start three runs per case and the suite
starts dozens, so the imports were most of the integration tests' CPU on a 2-core CI machine. One server per
pytest(-xdist) worker pays them once.

What a run still is: a real process, started by `fork()` from a server that has done nothing but import
(no thread started, no tensor made), in its own session and process group, with its own stdin (/dev/null),
stdout and stderr, environment (exactly ``env``), working directory and temp folder; it runs the script as
``__main__`` with ``sys.argv`` as given, ends like an interpreter does (threads joined, atexit handlers run,
streams flushed) and its return code is the script's exit status, or minus the signal that killed it (-9 after
a SIGKILL), as with ``subprocess.run``. What differs from a fresh interpreter: a module's import-time reading of
an environment variable happened in the server (started with the first caller's environment: pass only run-time
settings per run); a warning an import gave in the server is not shown again in the run (so a test of what a run
prints, tests/test_run_ux.py and test_errors.py, starts it cold); and every run shares the server's hash seed,
so a straight and a resumed run iterate their sets in one order (the FSDP, torchrun, mixer-worker and soak tests
still resume in fresh interpreters).

    proc = _warm.run(script, *args, cwd=..., env=..., timeout=400)   # a subprocess.CompletedProcess (text)
    proc = _warm.run(script, *args, cwd=..., env=..., ranks=2)       # as `torchrun --nproc_per_node 2 script ...`

With ``ranks=n`` the server forks n such processes at once with the variables torchrun gives its workers (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR / MASTER_PORT, TORCHELASTIC_RUN_ID), and
waits for them as torchrun does: the first rank that fails takes the others down (SIGKILL) and its exit status is
the run's; their stdout and stderr go, line-interleaved, to one stdout and one stderr. The ranks of a warm launch
share one hash seed, where torchrun's fresh interpreters each draw their own: the DDP tests that launch with real
torchrun (tests/test_lightning.py, test_hf_trainer.py) still check that ranks agree whatever their set order.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from _parallel import free_port

#: What the server imports before its first fork (the union of what the training scripts import).
PRELOAD = ("torch", "streaming", "transformers", "transformers.trainer", "composer", "lightning.pytorch",
           "grape_stream.integrations.composer", "grape_stream.integrations.hf",
           "grape_stream.integrations.lightning")

_lock = threading.Lock()
_server: "_Server | None" = None


class _Server:
    """The client's end: the server process, a request pipe (JSON lines) and a reply pipe ("pid N", "status S")."""

    def __init__(self, env: dict[str, str]) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        self.log = tempfile.NamedTemporaryFile(prefix="warm-server-", suffix=".log", delete=False)
        tests = os.path.dirname(os.path.abspath(__file__))
        server_env = dict(env, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests, env.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(req_r), str(rep_w)],
                                     pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=self.log, env=server_env, start_new_session=True)
        os.close(req_r)
        os.close(rep_w)
        self.req, self.rep, self.buf = req_w, rep_r, b""
        if self._line(600) != "ready":
            raise RuntimeError(f"the warm server did not start: {self._log_tail()}")

    def _log_tail(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-3000:]

    def _line(self, timeout: float | None) -> str | None:
        """The next reply line, or None when ``timeout`` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.rep], [], [], left)[0]:
                return None
            chunk = os.read(self.rep, 4096)
            if not chunk:
                raise RuntimeError(f"the warm server exited (code {self.proc.wait()}): {self._log_tail()}")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()

    def run(self, cmd: list[str], script: str, args: list[str], cwd: str, env: dict[str, str],
            timeout: float, ranks: int = 0) -> subprocess.CompletedProcess:
        fd_out, out = tempfile.mkstemp(prefix="warm-out-")
        fd_err, err = tempfile.mkstemp(prefix="warm-err-")
        os.close(fd_out)
        os.close(fd_err)
        try:
            request = {"script": script, "args": args, "cwd": cwd, "env": env, "stdout": out, "stderr": err,
                       "ranks": ranks, "port": free_port() if ranks else 0}
            os.write(self.req, (json.dumps(request) + "\n").encode())
            pids = [int(p) for p in (self._line(60) or "pid").split()[1:]]
            status = self._line(timeout)
            if status is None:
                for pid in pids:
                    _kill_tree(pid)
                self._line(60)
                raise subprocess.TimeoutExpired(cmd, timeout, _read(out), _read(err))
            return subprocess.CompletedProcess(cmd, int(status.split()[1]), _read(out), _read(err))
        finally:
            os.unlink(out)
            os.unlink(err)

    def close(self) -> None:
        os.close(self.req)  # the server's loop ends at EOF
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self.rep)
        os.unlink(self.log.name)


def _kill_tree(pid: int) -> None:
    """SIGKILL a run and whatever it started: its process group (its own session, once it has called setsid)
    and the process itself (before it has, the group does not exist yet)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def run(script: str, *args: str, cwd: str, env: dict[str, str], timeout: float = 400,
        ranks: int = 0) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, run as a fork of this worker's warm server (started on first use); ``ranks=n``: as
    ``torchrun --nproc_per_node n`` would run it (the module's docstring says what differs)."""
    global _server
    with _lock:
        if _server is None:
            _server = _Server(env)
            atexit.register(_server.close)
        cmd = [sys.executable, script, *args]
        if ranks:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), *cmd[1:]]
        return _server.run(cmd, os.path.abspath(script), list(args), cwd, env, timeout, ranks)


def _rank_env(env: dict[str, str], rank: int, ranks: int, port: int) -> dict[str, str]:
    """What torchrun (torch.distributed.run, one node) puts in worker ``rank``'s environment."""
    n = str(ranks)
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n,
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": n,
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": f"warm-{port}", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}


# ------------------------------------------------------------------------------------------------------------
# The server (this file run as a script): import, then fork one child per request and report its exit status.
# ------------------------------------------------------------------------------------------------------------
def _child(req: dict[str, Any], rep_fd: int) -> None:
    """In the forked child: become the requested process, run the script, then raise SystemExit so that the
    interpreter ends as a fresh one would (never returns into the server's loop)."""
    import runpy
    import traceback

    code: Any = 1
    try:
        os.setsid()
        os.close(rep_fd)  # (the request pipe's read end is closed as the SystemExit unwinds the server's loop)
        append = os.O_WRONLY | os.O_APPEND  # (the ranks of one launch share the files)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], append), (2, req["stderr"], append)):
            new = os.open(path, flags)
            os.dup2(new, fd)
            os.close(new)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        tempfile.tempdir = None  # TMPDIR as this run's environment says
        sys.argv = [req["script"], *req["args"]]
        sys.path[0] = os.path.dirname(req["script"])  # as `python script.py` puts it
        runpy.run_path(req["script"], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    raise SystemExit(code)


def _wait_all(pids: list[int]) -> int:
    """Wait for every process of a launch; as torchrun, the first that fails takes the others down and its exit
    status is the launch's (0 when all exit 0)."""
    left, code = set(pids), 0
    while left:
        pid, status = os.waitpid(-1, 0)
        if pid not in left:
            continue
        left.discard(pid)
        exit_code = os.waitstatus_to_exitcode(status)
        if exit_code != 0 and code == 0:
            code = exit_code
            for other in left:
                _kill_tree(other)
    return code


def _serve(req_fd: int, rep_fd: int) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    sys.stdout.flush()  # nothing an import printed reaches a child's stdout
    sys.stderr.flush()
    os.write(rep_fd, b"ready\n")
    with os.fdopen(req_fd, "rb", buffering=0) as requests:
        for line in iter(requests.readline, b""):
            req = json.loads(line)
            ranks = int(req.get("ranks") or 0)
            envs = [_rank_env(req["env"], r, ranks, req["port"]) for r in range(ranks)] if ranks else [req["env"]]
            pids = []
            for env in envs:
                pid = os.fork()
                if pid == 0:
                    _child({**req, "env": env}, rep_fd)
                pids.append(pid)
            os.write(rep_fd, ("pid " + " ".join(map(str, pids)) + "\n").encode())
            os.write(rep_fd, f"status {_wait_all(pids)}\n".encode())
    os._exit(0)  # the server has nothing to finalise, and the native threads its imports started (jemalloc's,
    # torch's) made a normal interpreter exit linger for seconds


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
