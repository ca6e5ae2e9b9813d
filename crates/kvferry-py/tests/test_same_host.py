"""The same-host mover from Python: an engine reads a producer on this host straight
from its memory by default (``stats()["movers"]`` says so, with the producer's pid),
lands the right bytes on the direct and batched paths, and ``transport="tcp"`` on
either side keeps every byte on the socket, with the reason recorded."""

from __future__ import annotations

import os

import numpy as np
import pytest
from numpy.typing import NDArray

import kvferry

BLOCK = 4096


def _kv(seed: int) -> NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 255, (32, BLOCK), dtype=np.uint8)


def test_same_host_get_reads_the_producers_memory() -> None:
    with kvferry.Engine(peer_id="prefill") as p, kvferry.Engine(peer_id="decode") as d:
        assert p.address is not None
        src_arr = _kv(1)
        src = p.register_kv_cache(src_arr, block_bytes=BLOCK)
        p.publish("a", src, [3, 4, 5])
        p.publish("b", src, [9])
        out = np.zeros_like(src_arr)
        dst = d.register_kv_cache(out, block_bytes=BLOCK)
        assert d.get_blocking(p.address, ["a", "b"], dst, [[10, 11, 12], [0]]) == 2
        assert (out[10:13] == src_arr[3:6]).all() and (out[0] == src_arr[9]).all()
        s = d.stats()
        assert s["consumer"]["cma_transfers"] == 1
        assert s["consumer"]["cma_bytes"] == 4 * BLOCK
        [m] = s["movers"]
        assert m["mover"] == "cma" and m["fallback"] is None and m["pid"] == os.getpid()
        assert p.stats()["producer"]["bytes_sent"] == 0


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_transport_tcp_keeps_the_socket(side: str) -> None:
    pt = "tcp" if side == "producer" else "auto"
    ct = "tcp" if side == "consumer" else "auto"
    with kvferry.Engine(peer_id="prefill", transport=pt) as p, kvferry.Engine(
        peer_id="decode", transport=ct
    ) as d:
        assert p.address is not None
        src_arr = _kv(2)
        src = p.register_kv_cache(src_arr, block_bytes=BLOCK)
        p.publish("a", src, [1, 2])
        out = np.zeros_like(src_arr)
        dst = d.register_kv_cache(out, block_bytes=BLOCK)
        assert d.get_blocking(p.address, "a", dst, [7, 8]) == 1
        assert (out[7:9] == src_arr[1:3]).all()
        s = d.stats()
        assert s["consumer"]["cma_transfers"] == 0
        assert p.stats()["producer"]["bytes_sent"] == 2 * BLOCK
        if side == "producer":
            [m] = s["movers"]
            assert m["mover"] == "socket" and "transport is tcp" in m["fallback"]
        else:
            assert s["movers"] == []


def test_a_bad_transport_is_named() -> None:
    with pytest.raises(kvferry.InvalidArgumentError, match="transport"):
        kvferry.Engine(transport="rdma")
