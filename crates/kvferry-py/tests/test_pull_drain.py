"""Delayed pulls (``pull``, and ``stage`` then ``resolve``) interrupted with Ctrl-C
return only after nothing writes their destination any more: the first background
case (a cancel that returns while a copy still runs) at the Python boundary.

The decode engine keeps its KV in sim device memory, and its host-to-device landing
copy is stalled (``stall`` fault) so that, after the interrupt, a device copy into the
destination blocks is still in flight for as long as the test wants. For 500 ms the
test then observes, at the same instants, that the copy is still in flight (the sim
device reports it stuck) and that the interrupted call has not returned. Only once the
device is released may the call raise ``KeyboardInterrupt``, and then nothing is left
draining or leased."""

from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import kvferry

BLOCK = 4096
WINDOW = 0.5  # seconds during which both conditions must hold together


@dataclass
class Seen:
    """What the watcher thread observed around an interrupted call."""

    samples: int = 0
    violations: int = 0
    stuck_at_interrupt: bool = False
    released_at: float | None = None
    error: BaseException | None = None
    raised: float | None = None


def _setup(p: kvferry.Engine, d: kvferry.Engine) -> kvferry.Region:
    src = p.register_kv_cache(np.random.default_rng(7).integers(0, 255, (8, BLOCK), dtype=np.uint8), block_bytes=BLOCK)
    p.publish("k", src, [1, 2], once=False)
    mem = d.alloc_device(8 * BLOCK)
    dst = d.register_kv_cache(mem, block_bytes=BLOCK)
    return dst


def _interrupt_during_stalled_landing(d: kvferry.Engine, call: Callable[[], object]) -> Seen:
    """Runs ``call`` on the main thread while a watcher thread waits until its landing
    copy is stuck on the device, interrupts the main thread (Ctrl-C), samples both
    conditions for ``WINDOW`` seconds, then releases the device."""
    d._e._inject_device_fault("stall", "next")
    returned = threading.Event()
    seen = Seen()

    def watch() -> None:
        try:
            until = time.monotonic() + 10
            while d.stats()["device"]["stuck"] == 0:
                assert time.monotonic() < until, "the landing copy never reached the device"
                time.sleep(0.005)
            seen.stuck_at_interrupt = True
            _thread.interrupt_main()
            end = time.monotonic() + WINDOW
            while time.monotonic() < end:
                still_writing = d.stats()["device"]["stuck"] > 0
                not_returned = not returned.is_set()
                seen.samples += 1
                if not (still_writing and not_returned):
                    seen.violations += 1
                time.sleep(0.01)
        except BaseException as e:  # reported by the test, not lost in the thread
            seen.error = e
        finally:
            seen.released_at = time.monotonic()
            d._e._release_device()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    with pytest.raises(KeyboardInterrupt):
        try:
            call()
        finally:
            returned.set()
    raised = time.monotonic()
    t.join(10)
    assert seen.error is None, seen.error
    seen.raised = raised
    return seen


def _check(d: kvferry.Engine, seen: Seen) -> None:
    assert seen.stuck_at_interrupt
    assert seen.samples >= 10, seen
    assert seen.violations == 0, f"the call returned while its device copy still ran: {seen}"
    assert seen.released_at is not None and seen.raised is not None and seen.raised >= seen.released_at, seen
    deadline = time.monotonic() + 5
    while d.stats()["consumer"]["draining"] and time.monotonic() < deadline:
        time.sleep(0.01)
    st = d.stats()
    assert st["consumer"]["draining"] == 0, st["consumer"]
    assert st["arena"]["leased_pages"] == 0 and st["arena"]["quarantined_pages"] == 0, st["arena"]
    assert st["device"]["stuck"] == 0


def test_ctrl_c_during_pull_returns_after_the_device_copy_stopped() -> None:
    with kvferry.Engine() as p, kvferry.Engine(device="sim", device_timeout=30.0) as d:
        peer = p.address
        assert peer is not None
        dst = _setup(p, d)
        seen = _interrupt_during_stalled_landing(d, lambda: d.pull(peer, "k", dst, [4, 5], timeout=30.0))
        _check(d, seen)
        # The engine still works after the interrupted pull.
        assert d.pull(peer, "k", dst, [6, 7], timeout=10.0) == 1


def test_ctrl_c_during_resolve_returns_after_the_device_copy_stopped() -> None:
    with kvferry.Engine() as p, kvferry.Engine(device="sim", device_timeout=30.0) as d:
        peer = p.address
        assert peer is not None
        dst = _setup(p, d)
        staged = d.stage(peer, "k", timeout=10.0)
        seen = _interrupt_during_stalled_landing(d, lambda: d.resolve(staged, dst, [4, 5], timeout=30.0))
        _check(d, seen)
        staged = d.stage(peer, "k", timeout=10.0)
        assert d.resolve(staged, dst, [6, 7], timeout=10.0) == 1
