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
            timeout: float) -> subprocess.CompletedProcess:
        fd_out, out = tempfile.mkstemp(prefix="warm-out-")
        fd_err, err = tempfile.mkstemp(prefix="warm-err-")
        os.close(fd_out)
        os.close(fd_err)
        try:
            request = {"script": script, "args": args, "cwd": cwd, "env": env, "stdout": out, "stderr": err}
            os.write(self.req, (json.dumps(request) + "\n").encode())
            pid = int((self._line(60) or "pid -1").split()[1])
            status = self._line(timeout)
            if status is None:
                try:
                    os.killpg(pid, signal.SIGKILL)  # the run and whatever it started
                except ProcessLookupError:
                    pass
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


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def run(script: str, *args: str, cwd: str, env: dict[str, str], timeout: float = 400) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, run as a fork of this worker's warm server (started on first use)."""
    global _server
    with _lock:
        if _server is None:
            _server = _Server(env)
            atexit.register(_server.close)
        return _server.run([sys.executable, script, *args], os.path.abspath(script), list(args), cwd, env, timeout)


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
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY),
                                (2, req["stderr"], os.O_WRONLY)):
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
            pid = os.fork()
            if pid == 0:
                _child(req, rep_fd)
            os.write(rep_fd, f"pid {pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            os.write(rep_fd, f"status {os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)  # the server has nothing to finalise, and the native threads its imports started (jemalloc's,
    # torch's) made a normal interpreter exit linger for seconds


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
