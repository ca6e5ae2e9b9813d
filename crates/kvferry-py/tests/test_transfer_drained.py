"""``Transfer.done()`` and ``Transfer.drained()`` are two moments: a transfer whose
host-to-device scatter stalls past ``device_timeout`` fails (done, with its error)
while the device may still write the destination (not drained); ``drained()`` turns
True only once the device completed the copy. ``cancel(timeout=0)`` asks and returns
at once. Sim device engines (``Engine(device="sim")``), no GPU needed."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

import kvferry
from device_cache import BLOCK, device_cache


def _until(cond: Callable[[], bool], within: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < within, "timed out"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_failed_transfer_is_done_before_it_drained() -> None:
    with kvferry.Engine(device="sim") as p, kvferry.Engine(device="sim", device_timeout=0.3) as d:
        assert p.address is not None
        data = np.random.default_rng(3).integers(0, 255, (16, BLOCK), dtype=np.uint8)
        _, src = device_cache(p, 16, data)
        dst_mem, dst = device_cache(d, 16)
        p.publish("k", src, [1, 2, 3])
        d._e._inject_device_fault("stall", "next")  # the scatter runs only once released
        t = d.get(p.address, "k", dst, [4, 5, 6], timeout=10.0)
        _until(t.done, 5.0)
        assert isinstance(t.error, kvferry.errors.DeviceError), t.error
        time.sleep(0.3)
        assert not t.drained(), "drained while the stalled scatter may still write"
        assert (np.frombuffer(dst_mem.read(4 * BLOCK, 3 * BLOCK), dtype=np.uint8) == 0).all()
        d._e._release_device()  # the stalled copy runs now, writing the blocks
        _until(t.drained, 5.0)
        got = np.frombuffer(dst_mem.read(4 * BLOCK, 3 * BLOCK), dtype=np.uint8).reshape(3, BLOCK)
        assert (got == data[1:4]).all(), "drained means the late copy has finished"
        assert d.close()["clean"] and p.close()["clean"]


def test_success_is_drained_when_done_and_cancel_can_return_at_once() -> None:
    with kvferry.Engine(device="sim") as p, kvferry.Engine(device="sim", device_timeout=5.0) as d:
        assert p.address is not None
        _, src = device_cache(p, 8, np.ones((8, BLOCK), dtype=np.uint8))
        _, dst = device_cache(d, 8)
        p.publish("ok", src, [0])
        t = d.get(p.address, "ok", dst, [1], timeout=5.0)
        assert t.wait(5.0) == 1 and t.done() and t.drained()
        p.publish("stuck", src, [2])
        d._e._inject_device_fault("stall", "next")
        t = d.get(p.address, "stuck", dst, [3], timeout=10.0)
        _until(lambda: d.stats()["device"]["stuck"] >= 1, 5.0)
        t0 = time.monotonic()
        assert t.cancel(timeout=0) is False  # asked; the stalled scatter is still out
        assert time.monotonic() - t0 < 0.1
        _until(t.done, 5.0)  # cancelled: the outcome is known at once...
        assert isinstance(t.error, kvferry.errors.CancelledError), t.error
        time.sleep(0.2)
        assert not t.drained()  # ...the drain waits for the stalled scatter
        d._e._release_device()
        _until(t.drained, 5.0)
        assert d.close()["clean"] and p.close()["clean"]
