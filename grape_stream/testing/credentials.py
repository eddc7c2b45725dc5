"""Credentials that rotate, and a count of every time a process looked them up: for tests and benches.

Short-lived credentials on a cluster come from a provider (an instance role, a sidecar refreshing a
file, an SSO cache), not from fixed environment variables. This builds the smallest real provider boto3
knows: an AWS config file whose profile names a ``credential_process`` (a tiny Python script) that prints
the current key and appends one line to a log per call. So:

* :meth:`RotatingCredentials.rotate` changes the key the next lookup gets (pair it with the fault
  proxy's ``accept_keys`` to make the old key stop working at the same moment);
* :meth:`RotatingCredentials.lookups` is how many times any process resolved credentials (a fresh
  boto3 session per shard would show here as one lookup per shard).

``env()`` gives the environment variables to set (and the ``AWS_*`` key variables to unset: they would
take precedence over the profile); DataLoader workers and conversion workers inherit them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["RotatingCredentials"]

_SCRIPT = """import json, os, sys
d = os.path.dirname(os.path.abspath(__file__))
key = open(os.path.join(d, "key")).read().strip()
with open(os.path.join(d, "lookups.log"), "a") as f:
    f.write(f"{os.getppid()} {key}\\n")  # the process that looked them up
print(json.dumps({"Version": 1, "AccessKeyId": key, "SecretAccessKey": "secret-" + key}))
"""


class RotatingCredentials:
    """A credential_process profile under `folder` whose key starts as `key`."""

    def __init__(self, folder: str | os.PathLike[str], key: str = "ROTATING-KEY-1") -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.script = self.folder / "credential_process.py"
        self.script.write_text(_SCRIPT)
        self.config = self.folder / "config"
        self.config.write_text(f"[default]\ncredential_process = {sys.executable} {self.script}\n"
                               "region = us-east-1\n")
        (self.folder / "credentials").write_text("")
        self.key = key
        self.rotate(key)

    def rotate(self, key: str) -> None:
        """From now on a lookup gets `key` (written atomically: a lookup never reads half a key)."""
        tmp = self.folder / "key.tmp"
        tmp.write_text(key)
        os.replace(tmp, self.folder / "key")
        self.key = key

    def lookups(self) -> list[tuple[int, str]]:
        """(pid, key) of every lookup so far, in order."""
        log = self.folder / "lookups.log"
        if not log.exists():
            return []
        return [(int(p), k) for p, k in (line.split() for line in log.read_text().splitlines() if line.strip())]

    def env(self) -> dict[str, str | None]:
        """Variables to set (None: unset) so that boto3 resolves credentials through this profile only."""
        return {
            "AWS_CONFIG_FILE": str(self.config),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.folder / "credentials"),
            "AWS_PROFILE": None,
            "AWS_ACCESS_KEY_ID": None,
            "AWS_SECRET_ACCESS_KEY": None,
            "AWS_SESSION_TOKEN": None,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
