"""The connector with the same-host mover, as its users get it by default
(``transport = "auto"``): the decode ranks read the prefill's published blocks
straight from the prefill process's memory (``process_vm_readv``), every head of
every token checked, both sides ending empty; and ``transport = "tcp"`` on the
prefill keeps the socket, with the reason recorded. The rest of the vLLM suites run
the socket mover (they delay and count socket sends; ``KVFERRY_TEST_TRANSPORT``)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from vllm_pairs import CASES, transfer
from vllm_harness import on_backend, pulled

AUTO = {"timeout": 10.0, "transport": "auto"}


def _movers(d: Any) -> list[dict[str, Any]]:
    return [m for w in d.workers() for m in w.engine.stats()["movers"]]


@pytest.mark.parametrize(
    "case,backend,remote",
    [
        ("tp2-to-tp4", "CPU_ATTN", True),  # the prefill in a process of its own
        ("cpu-planes-to-flash-nhd-tp2-to-tp4", "CPU_ATTN", True),
        ("tp2-to-tp1", "FLASH_ATTN", False),
    ],
)
def test_decode_ranks_read_the_prefill_process_memory(made, case, backend, remote):
    p_kw, d_kw = (on_backend(kw, backend) for kw in CASES[case])
    p_kw = {**p_kw, "extra": {**AUTO, **p_kw.get("extra", {})}}
    d_kw = {**d_kw, "extra": {**AUTO, **d_kw.get("extra", {})}}
    p, d, reqs, need, moved = transfer(made, p_kw, d_kw, remote=remote)
    assert pulled(d)[0] == need
    assert moved == need, (moved, need)  # received bytes count the same-host reads too
    cma = sum(w.engine.stats()["consumer"]["cma_bytes"] for w in d.workers())
    assert cma == need, (cma, need)  # every pulled byte came by the same-host mover
    movers = _movers(d)
    assert movers and all(m["mover"] == "cma" and m["fallback"] is None for m in movers), movers
    if remote:
        assert all(m["pid"] != os.getpid() for m in movers), "read from the prefill's own process"


def test_a_tcp_prefill_keeps_the_socket_and_says_why(made):
    p_kw, d_kw = CASES["tp2-to-tp1"]
    p_kw = {**p_kw, "extra": {"timeout": 10.0, "transport": "tcp"}}
    d_kw = {**d_kw, "extra": AUTO}
    p, d, reqs, need, moved = transfer(made, p_kw, d_kw)
    assert moved == need
    assert sum(w.engine.stats()["consumer"]["cma_bytes"] for w in d.workers()) == 0
    movers = _movers(d)
    assert movers and all(m["mover"] == "socket" and "transport is tcp" in m["fallback"] for m in movers), movers
