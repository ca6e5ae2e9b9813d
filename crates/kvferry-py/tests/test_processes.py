"""A producer engine in another process: killed mid-transfer, then restarted."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvferry

from producer_process import BLOCK, MakeProducer, rss_bytes


def test_producer_killed_mid_transfer_then_restarted(remote_producer: MakeProducer) -> None:
    prod = remote_producer(send_delay_us=150_000)  # 150 ms per chunk sent
    keys = [f"req/{i}" for i in range(20)]
    for i, k in enumerate(keys):
        prod.publish(k, [i])
    with kvferry.Engine(listen=None, io_timeout=30.0) as d:
        out = np.zeros((64, BLOCK), dtype=np.uint8)
        dst = d.register_kv_cache(out, block_bytes=BLOCK)
        staged = d.stage(prod.address, ["req/0"], timeout=5.0)
        t = d.get(prod.address, keys, dst, [[20 + i] for i in range(20)], timeout=30.0)
        time.sleep(0.4)  # a few chunks in
        assert not t.done()
        killed = time.monotonic()
        prod.kill()
        with pytest.raises(kvferry.PeerLostError) as ei:
            t.wait(5.0)
        assert time.monotonic() - killed < 1.0
        assert ei.value.dirty is True  # direct: blocks were being written
        assert d.stats()["consumer"]["draining"] == 0

        # Restart on the same port: a new incarnation. A transfer that targeted the
        # old one (a staged lease) is refused as PeerRestartedError, never served by
        # the new process.
        again = remote_producer(listen=prod.address)
        assert again.incarnation != prod.incarnation
        with pytest.raises(kvferry.PeerRestartedError):
            d.resolve(staged, dst, [50], timeout=5.0)
        data = again.publish("fresh", [2])
        # An eager get naming the old incarnation is refused before anything is
        # staged or written, though the new process holds the key; naming the new
        # one (or none) lands it.
        out[60] = 7
        with pytest.raises(kvferry.PeerRestartedError):
            d.get_blocking(again.address, "fresh", dst, [60], incarnation=prod.incarnation)
        with pytest.raises(kvferry.PeerRestartedError):
            d.get(again.address, ["fresh"], dst, [[60]], incarnation=prod.incarnation).wait(5.0)
        assert (out[60] == 7).all(), "a refused get wrote nothing"
        assert d.get_blocking(again.address, "fresh", dst, [60], incarnation=again.incarnation) == 1
        assert out[60].tobytes() == data
        assert d.get_blocking(again.address, "fresh", dst, [61]) == 1
        assert d.stats()["consumer"]["draining"] == 0
        again.stop()


def test_ten_thousand_small_gets_keep_rss_flat() -> None:
    with kvferry.Engine(ttl=600.0) as p, kvferry.Engine() as d:
        peer = p.address
        assert peer is not None
        src_arr = np.random.default_rng(3).integers(0, 255, (16, BLOCK), dtype=np.uint8)
        src = p.register_kv_cache(src_arr, block_bytes=BLOCK)
        for i in range(16):
            p.publish(f"s{i}", src, [i], once=False)
        out = np.zeros((16, BLOCK), dtype=np.uint8)
        dst = d.register_kv_cache(out, block_bytes=BLOCK)

        def run(n: int) -> None:
            for j in range(n):
                d.get_blocking(peer, f"s{j % 16}", dst, [j % 16])

        run(2000)  # warm up: pools, allocator arenas
        before = rss_bytes()
        run(10_000)
        after = rss_bytes()
        assert (out == src_arr).all()
        assert abs(after - before) <= 0.05 * before, (before, after)
