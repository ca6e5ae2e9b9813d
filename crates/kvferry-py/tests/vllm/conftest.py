"""The fixtures of the vLLM connector tests; what they build is :mod:`vllm_harness`'s.

- ``need_vllm``: skips (or, with ``KVFERRY_REQUIRE_VLLM=1``, fails) without vLLM 0.33.0.
- ``made``: a list the test appends its instances to; each is closed (a
  ``RemoteInstance`` stopped) after the test.
- ``kv_device``: ``host`` and ``sim``, once each per module: KV in CPU memory moved zero
  copy, or the same tensors adopted as kvferry's sim device memory on both instances
  (connector option ``device="sim"``), so the whole device path runs under vLLM's
  scheduler. A test narrows it with ``@pytest.mark.parametrize("kv_device", ["sim"],
  indirect=True)``.
- ``prefill``: one prefill instance per module and ``kv_device``, in a process of its own
  (:func:`vllm_harness.prefill_process`), its ``lease_ttl`` the module's ``LEASE_TTL``.
- ``decode``: makes decode instances in this process (:func:`vllm_harness.one_rank`,
  ``DECODE_BLOCKS`` of the module's blocks unless told, ``timeout`` the module's
  ``TIMEOUT``), closed after the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import vllm_harness as h


@pytest.fixture(scope="module")
def need_vllm() -> None:
    h.need_vllm()


@pytest.fixture
def made(need_vllm: None) -> Iterator[list[Any]]:
    with h.made() as out:
        yield out


@pytest.fixture(scope="module", params=["host", "sim"])
def kv_device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def prefill(request: pytest.FixtureRequest, need_vllm: None, kv_device: str) -> Iterator[h.RemoteInstance]:
    extra = {"lease_ttl": request.module.LEASE_TTL, "timeout": request.module.TIMEOUT}
    p = h.prefill_process(h.with_device(extra, kv_device))
    yield p
    p.stop()


@pytest.fixture
def decode(request: pytest.FixtureRequest, made: list[Any], kv_device: str) -> Callable[..., h.Instance]:
    blocks = getattr(request.module, "DECODE_BLOCKS", 1024)

    def make(**kw: Any) -> h.Instance:
        extra = h.with_device(kw.pop("extra", {"timeout": request.module.TIMEOUT}), kv_device)
        d = h.one_rank("kv_consumer", extra, num_blocks=kw.pop("num_blocks", blocks), **kw)
        made.append(d)
        return d

    return make
