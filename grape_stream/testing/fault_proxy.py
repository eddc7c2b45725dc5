"""A fault-injecting HTTP proxy for an S3-compatible server: what a flaky network does, on demand.

It sits between the client (boto3 / streaming, through S3_ENDPOINT_URL) and a real server (moto_server)
on 127.0.0.1 and, per request, either forwards it unchanged or injects one fault:

* ``error_rate``    answer ``error_status`` (503 SlowDown, or 500 InternalError) without forwarding,
* ``reset_rate``    read the request, then drop the connection with a TCP reset (no response),
* ``latency``       sleep this many seconds before forwarding,
* ``forbidden``     answer 403 InvalidAccessKeyId (what a wrong or revoked key gets), without forwarding,
* ``outage(s)``     refuse connections for ``s`` seconds: the listening socket is closed and re-opened
                    on the same port, so clients see ECONNREFUSED exactly as when a server restarts;
                    ``outage_after(n, s)`` starts one after the next ``n`` forwarded requests,
* ``fail(...)``     one call site: requests of a method whose path matches a pattern get a 500, 503
                    SlowDown, 403 or a reset, after ``skip`` of them passed, ``times`` times (a
                    :class:`Rule`, which counts its hits); ``slow_down(prefix)`` is S3 throttling one
                    prefix (503 SlowDown for a fraction of its requests, for as long as it is set),
* ``accept_keys(k)`` the server's credential check: a request signed with an access key not in ``k``
                    gets 403 InvalidAccessKeyId (change ``k`` mid-run to rotate credentials);
                    ``stats.keys`` / ``stats.bytes_by_key``: requests / response bytes per access key.

Faults are drawn from a seeded RNG, so a scenario is repeatable. Used by the tests (fixtures drive it
in-process) and by bench/faults.py; point it at your own MinIO / R2 endpoint to try your job against a
blip. It speaks HTTP/1.1 with keep-alive and chunked request bodies, which is what botocore sends; it is
a test tool, not a general-purpose proxy (plain http:// upstreams only).
"""

from __future__ import annotations

import http.client
import os
import random
import re
import socket
import struct
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"}
_FORBIDDEN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidAccessKeyId</Code>'
    b"<Message>The AWS Access Key Id you provided does not exist in our records. (injected by fault_proxy)"
    b"</Message></Error>"
)
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate. (injected by fault_proxy)</Message></Error>"
)
_INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again. (injected by fault_proxy)</Message></Error>"
)
#: action -> (status, reason, body) of the injected answers
_ANSWERS = {"503": (503, "Slow Down", _SLOWDOWN), "500": (500, "Internal Server Error", _INTERNAL),
            "403": (403, "Forbidden", _FORBIDDEN)}
_KEY_RE = re.compile(r"Credential=([^/,\s]+)/|X-Amz-Credential=([^%/&]+)")


@dataclass
class FaultStats:
    forwarded: int = 0
    errors: int = 0
    resets: int = 0
    refused_windows: int = 0
    refused_keys: int = 0
    keys: Counter = field(default_factory=Counter)  # access key -> requests signed with it
    bytes_by_key: Counter = field(default_factory=Counter)  # access key -> response body bytes


@dataclass
class Rule:
    """Faults for one call site: ``method`` (None: any) and a regex searched in the request path+query."""

    method: str | None
    path: str
    action: str = "500"  # "500" | "503" (SlowDown) | "403" | "reset"
    times: int | None = None  # None: for as long as the rule is set
    skip: int = 0  # let this many matching requests through first
    rate: float = 1.0  # the fraction of (not skipped) matching requests that fail
    seen: int = 0
    hits: int = 0

    def matches(self, method: str, target: str) -> bool:
        return (self.method is None or self.method == method) and re.search(self.path, target) is not None


class FaultProxy:
    """Start with ``FaultProxy(upstream_url).start()``; point clients at ``proxy.url``; ``stop()`` at the end."""

    def __init__(self, upstream: str, *, seed: int = 0, host: str = "127.0.0.1", port: int = 0) -> None:
        if not upstream.startswith("http://"):
            raise ValueError("upstream must be an http:// URL")
        hostport = upstream[len("http://"):].rstrip("/")
        self._up_host, _, up_port = hostport.partition(":")
        self._up_port = int(up_port or 80)
        self._host = host
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.error_rate = 0.0
        self.reset_rate = 0.0
        self.latency = 0.0
        self.error_status = 503
        self.forbidden = False
        self.accepted_keys: set[str] | None = None
        self.rules: list[Rule] = []
        self._outage_after: tuple[int, float] | None = None
        self.stats = FaultStats()
        self._stopping = threading.Event()
        self._refuse_until = 0.0
        self._listener: socket.socket | None = None
        self._listener_ready = threading.Event()
        self._port = port
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()  # every socket the proxy holds, for the fork hook

    # -- control -------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._port}"

    def set_faults(self, *, error_rate: float = 0.0, reset_rate: float = 0.0, latency: float = 0.0,
                   error_status: int = 503) -> None:
        with self._lock:
            self.error_rate, self.reset_rate, self.latency = error_rate, reset_rate, latency
            self.error_status = error_status

    def fail(self, path: str, *, method: str | None = None, action: str = "500", times: int | None = None,
             skip: int = 0, rate: float = 1.0) -> Rule:
        """Inject faults at one call site (see :class:`Rule`); returns the rule, whose ``hits`` count."""
        if action not in (*_ANSWERS, "reset"):
            raise ValueError(f"action must be one of {sorted(_ANSWERS)} or 'reset', got {action!r}")
        rule = Rule(method, path, action, times, skip, rate)
        with self._lock:
            self.rules.append(rule)
        return rule

    def slow_down(self, prefix: str, rate: float = 1.0) -> Rule:
        """S3 throttling one prefix (``bucket/key-prefix``): 503 SlowDown for `rate` of its requests."""
        return self.fail("^/" + re.escape(prefix.strip("/")) + r"(/|\?|$)", action="503", rate=rate)

    def accept_keys(self, keys: set[str] | None) -> None:
        """Accept only requests signed with these access keys (None: any, the default)."""
        with self._lock:
            self.accepted_keys = None if keys is None else set(keys)

    def clear(self) -> None:
        self.set_faults()
        self.forbidden = False
        self._refuse_until = 0.0
        with self._lock:
            self.rules = []
            self.accepted_keys = None
            self._outage_after = None

    def outage(self, seconds: float) -> None:
        """Refuse every connection for `seconds`, starting now (existing connections are cut too)."""
        with self._lock:
            self._refuse_until = time.monotonic() + seconds
            self.stats.refused_windows += 1
        self._close_listener()

    def outage_after(self, requests: int, seconds: float) -> None:
        """Start an outage of `seconds` once `requests` more requests have been forwarded."""
        with self._lock:
            self._outage_after = (self.stats.forwarded + requests, seconds)

    def in_outage(self) -> bool:
        return time.monotonic() < self._refuse_until

    def start(self) -> "FaultProxy":
        _LIVE.add(self)
        self._open_listener()
        t = threading.Thread(target=self._accept_loop, name="fault-proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        _LIVE.discard(self)
        self._stopping.set()
        self._close_listener()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _forget_sockets_in_child(self) -> None:
        # Runs in a freshly forked child: no locks (another thread of the parent may have held one at the
        # fork, and it would never be released here), only closing file descriptors.
        for s in [self._listener, *list(self._sockets)]:
            if s is not None and s.fileno() >= 0:
                try:
                    os.close(s.fileno())
                except OSError:
                    pass
        self._sockets = set()
        self._listener = None

    # -- listening -----------------------------------------------------------------------------------
    def _open_listener(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self._host, self._port))
        s.listen(128)
        s.settimeout(0.1)
        self._port = s.getsockname()[1]
        self._listener = s

    def _close_listener(self) -> None:
        s, self._listener = self._listener, None
        if s is not None:
            try:
                s.close()
            except OSError:
                pass

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            if self._listener is None:
                if self.in_outage():
                    time.sleep(0.02)
                    continue
                try:
                    self._open_listener()
                except OSError:
                    time.sleep(0.05)
                    continue
            try:
                conn, _ = self._listener.accept()  # type: ignore[union-attr]
            except socket.timeout:
                continue
            except OSError:
                continue
            if self.in_outage():
                _reset(conn)
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()

    # -- one client connection ----------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        self._sockets.add(conn)
        conn.settimeout(60)
        f = conn.makefile("rb")
        upstream: http.client.HTTPConnection | None = None
        try:
            while not self._stopping.is_set():
                req = _read_request(f, conn)
                if req is None:
                    return
                method, target, headers, body = req
                if self.in_outage():
                    _reset(conn)
                    return
                m = _KEY_RE.search(next((v for k, v in headers if k.lower() == "authorization"), "") + " " + target)
                key = (m.group(1) or m.group(2)) if m else None  # signed with (header or presigned URL)
                action = self._decide(method, target, key)
                if action == "reset":
                    self.stats.resets += 1
                    _reset(conn)
                    return
                if action is not None:
                    status, reason, answer = _ANSWERS[action]
                    self.stats.errors += action != "403"
                    conn.sendall(_response(status, [("Content-Type", "application/xml")],
                                           b"" if method == "HEAD" else answer, reason=reason))
                    continue
                lat = self.latency
                if lat:
                    time.sleep(lat)
                if upstream is None:
                    upstream = http.client.HTTPConnection(self._up_host, self._up_port, timeout=60)
                    upstream.connect()
                    if upstream.sock is not None:
                        self._sockets.add(upstream.sock)
                fwd = [(k, v) for k, v in headers if k.lower() not in _HOP_HEADERS and k.lower() != "content-length"]
                fwd.append(("Content-Length", str(len(body))))
                try:
                    upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                    for k, v in fwd:
                        upstream.putheader(k, v)
                    upstream.endheaders(body)
                    resp = upstream.getresponse()
                    data = resp.read()
                except (OSError, http.client.HTTPException):
                    _reset(conn)
                    return
                self._count_forwarded(key, len(data))
                out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_HEADERS]
                out_headers = [(k, v) for k, v in out_headers if k.lower() != "content-length"]
                if method == "HEAD":
                    length = resp.getheader("Content-Length")
                    if length is not None:
                        out_headers.append(("Content-Length", length))
                    conn.sendall(_response(resp.status, out_headers, b"", reason=resp.reason, head=True))
                else:
                    conn.sendall(_response(resp.status, out_headers, data, reason=resp.reason))
        except (OSError, ValueError):
            return
        finally:
            self._sockets.discard(conn)
            if upstream is not None:
                if upstream.sock is not None:
                    self._sockets.discard(upstream.sock)
                upstream.close()
            try:
                conn.close()
            except OSError:
                pass


    def _decide(self, method: str, target: str, key: str | None) -> str | None:
        """The fault for one request ("500", "503", "403", "reset"), or None to forward it."""
        with self._lock:
            self.stats.keys[key or "(unsigned)"] += 1
            if self.forbidden or (self.accepted_keys is not None and key not in self.accepted_keys):
                self.stats.refused_keys += 1
                return "403"
            for rule in self.rules:
                if rule.matches(method, target) and (rule.times is None or rule.hits < rule.times):
                    rule.seen += 1
                    if rule.seen > rule.skip and self._rng.random() < rule.rate:
                        rule.hits += 1
                        return rule.action
            roll = self._rng.random()
            if roll < self.reset_rate:
                return "reset"
            if roll < self.reset_rate + self.error_rate:
                return str(self.error_status)
        return None

    def _count_forwarded(self, key: str | None, nbytes: int) -> None:
        start = None
        with self._lock:
            self.stats.forwarded += 1
            self.stats.bytes_by_key[key or "(unsigned)"] += nbytes
            if self._outage_after is not None and self.stats.forwarded >= self._outage_after[0]:
                start, self._outage_after = self._outage_after[1], None
        if start is not None:
            self.outage(start)


#: Running proxies. A forked child (a DataLoader worker of the process that runs a proxy) inherits their
#: sockets; if it kept them, a "closed" listener would still accept connections during an outage and a
#: reset connection would stay open. The child is not the proxy: it closes its copies (one hook, for all).
_LIVE: "weakref.WeakSet[FaultProxy]" = weakref.WeakSet()


def _close_inherited_sockets() -> None:
    for proxy in list(_LIVE):
        proxy._forget_sockets_in_child()
    _LIVE.clear()


os.register_at_fork(after_in_child=_close_inherited_sockets)


def _reset(conn: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the client sees 'connection reset by peer', not a clean EOF."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    except OSError:
        pass


def _read_request(f: Any, conn: socket.socket) -> tuple[str, str, list[tuple[str, str]], bytes] | None:
    line = f.readline(65537)
    if not line:
        return None
    parts = line.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3:
        raise ValueError(f"bad request line {line!r}")
    method, target, _ = parts
    headers: list[tuple[str, str]] = []
    while True:
        h = f.readline(65537)
        if h in (b"\r\n", b"\n", b""):
            break
        k, _, v = h.decode("latin-1").partition(":")
        headers.append((k.strip(), v.strip()))
    lower = {k.lower(): v for k, v in headers}
    if lower.get("expect", "").lower() == "100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        headers = [(k, v) for k, v in headers if k.lower() != "expect"]
    if "chunked" in lower.get("transfer-encoding", "").lower():
        body = _read_chunked(f)
    else:
        body = f.read(int(lower.get("content-length", "0") or 0))
    return method, target, headers, body


def _read_chunked(f: Any) -> bytes:
    out = bytearray()
    while True:
        size = int(f.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while f.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return bytes(out)
        out += f.read(size)
        f.readline()


def _response(status: int, headers: list[tuple[str, str]], body: bytes, *, reason: str = "",
              head: bool = False) -> bytes:
    reason = reason or {503: "Slow Down"}.get(status, "OK")
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
    if not head:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
