"""The suite's own parallel-safety helper: xdist workers are never handed the same port (tests/_parallel.py)."""

from __future__ import annotations

import socket

import _parallel


def test_workers_are_handed_disjoint_ports_that_are_free(monkeypatch):
    handed = {}
    for count in (1, 2, 3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
        for index in range(count):
            monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
            handed[count, index] = [_parallel.free_port() for _ in range(4)]
    for (count, index), ports in handed.items():
        assert len(set(ports)) == 4 and all(p // 2 % count == index for p in ports)
        for (other_count, other), theirs in handed.items():
            if other_count == count and other != index:
                assert not set(ports) & set(theirs)
    with socket.socket() as s:  # free: it can be bound
        s.bind(("127.0.0.1", handed[2, 0][0]))
