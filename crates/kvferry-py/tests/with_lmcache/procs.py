"""Ports and start-up waits for the LMCache tests that run several processes (P2P,
PD). No heavy import here: child processes import this before torch, to start
LMCache's controller while they import the rest."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

_LOW, _HIGH = 20000, 32768
"""Ports handed to LMCache's sockets come from below Linux's ephemeral range
(32768-60999 by default): a port picked as free stays free until LMCache binds it,
because no outgoing connection of any process on the host is given one from here
(a port picked with ``bind(0)`` is from the ephemeral range, where any process's
next connection may take it in between)."""

_handed: set[int] = set()
_rng = random.Random(os.getpid() ^ time.monotonic_ns())


def free_port() -> int:
    """A loopback TCP port below the ephemeral range, free now, not handed out before
    by this process."""
    for _ in range(1000):
        port = _rng.randrange(_LOW, _HIGH)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise RuntimeError(f"no free port in {_LOW}..{_HIGH} after 1000 tries")


def wait_listening(port: int, proc: "subprocess.Popen[Any]", deadline: float, log: Path | None = None) -> None:
    """Returns once something listens on loopback ``port``; fails at once if ``proc``
    (the process that should listen) exits, or at ``deadline`` (``time.monotonic()``),
    with the tail of its ``log``. Start-up of LMCache's processes (torch, FastAPI
    imports) takes seconds on an idle host and over a minute on a loaded one: the
    bound is the test's budget, not a guess at the start-up time."""
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5):
                return
        except OSError:
            pass
        tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
        if proc.poll() is not None:
            raise RuntimeError(f"the process meant to listen on {port} exited with {proc.returncode}: {tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing listened on {port} within the test's budget: {tail}")
        time.sleep(0.1)
