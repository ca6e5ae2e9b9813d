# mypy: disable-error-code="import-untyped,import-not-found"
"""Shared pieces of the SGLang backend tests: the pin check and the two real role
processes (``worker.py``), each a prefill or decode with its own kvferry engines.

Needs sglang 0.5.23 beside torch (``scripts/install-sglang.sh``). Without it every test
here is skipped with the reason, unless ``KVFERRY_REQUIRE_SGLANG=1`` (then they fail).
"""

from __future__ import annotations


import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pinned import skip_or_fail, why_not_pinned

PINNED = "0.5.23"
_HOW = "install it with scripts/install-sglang.sh (sglang==0.5.23 without its dependencies, in the vLLM venv) and run pytest from that venv"
HERE = Path(__file__).resolve().parent
PYSRC = HERE.parents[1] / "python"


WHY_NOT = why_not_pinned("sglang", PINNED, ("torch", "zmq"), _HOW)
REQUIRED = os.environ.get("KVFERRY_REQUIRE_SGLANG") == "1"


@pytest.fixture(scope="session")
def need_sglang() -> None:
    skip_or_fail(WHY_NOT, "KVFERRY_REQUIRE_SGLANG")


class Role:
    """One worker process: JSON commands in, JSON answers out, each bounded."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        e = dict(os.environ)
        e["PYTHONPATH"] = os.pathsep.join([str(PYSRC), e.get("PYTHONPATH", "")])
        e.setdefault("KVFERRY_SGLANG_TIMEOUT", "10")
        e.setdefault("KVFERRY_SGLANG_BOOTSTRAP_TIMEOUT", "10")
        e.update(env or {})
        self.p = subprocess.Popen(
            [sys.executable, str(HERE / "worker.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=e, cwd="/tmp",
        )
        self.ready = False

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"worker {self.p.pid} did not answer within {timeout} s")
            r, _, _ = select.select([self.p.stdout], [], [], left)
            if r:
                line = self.p.stdout.readline()
                if not line:
                    raise RuntimeError(f"worker {self.p.pid} exited ({self.p.poll()})")
                if line.startswith("{"):
                    out: dict[str, Any] = json.loads(line)
                    return out

    def wait_ready(self, timeout: float = 180) -> None:
        if not self.ready:
            self._read(timeout)
            self.ready = True

    def __call__(self, op: str, timeout: float = 60, **kw: Any) -> dict[str, Any]:
        self.wait_ready()
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        out = self._read(timeout)
        assert "error" not in out, out.get("trace", out)
        return out

    def fails(self, op: str, timeout: float = 60, **kw: Any) -> str:
        """Runs ``op`` expecting it to raise in the worker; the exception's type and
        message."""
        self.wait_ready()
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        out = self._read(timeout)
        assert "error" in out, f"{op} succeeded: {out}"
        return str(out["error"])

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


@pytest.fixture(scope="session")
def roles(need_sglang: None) -> Iterator[tuple[Role, Role]]:
    """A prefill and a decode process, started together (their imports overlap)."""
    pre, dec = Role(), Role()
    try:
        pre.wait_ready()
        dec.wait_ready()
        yield pre, dec
    finally:
        pre.close()
        dec.close()
