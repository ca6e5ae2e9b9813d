"""``kvferry.bounded_wait`` on CPU: events that complete early, late (from another
thread, which also proves the GIL is released while waiting), never (raises within the
timeout plus 20 ms, naming what, the device and the time waited), whose ``query()``
raises (propagates), bad timeouts, the adaptive backoff (no busy spin; a wait with a
history sleeps until shortly before the usual completion) and the CUDA-handle path
without a driver. The real-GPU part is ``scripts/gpu-check.sh``."""

from __future__ import annotations

import ctypes.util
import math
import threading
import time
import uuid

import pytest

import kvferry


class Flag:
    """An event completed by whoever calls ``set()``; counts and stamps its queries."""

    def __init__(self, done: bool = False, device: str | None = "test:0") -> None:
        self.done = done
        self.device = device
        self.queries: list[float] = []

    def query(self) -> bool:
        self.queries.append(time.monotonic())
        return self.done

    def set(self) -> None:
        self.done = True


class At:
    """An event that completes at a given monotonic time (no other thread needed)."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.queries: list[float] = []

    def query(self) -> bool:
        now = time.monotonic()
        self.queries.append(now)
        return now >= self.at


def _name() -> str:
    """A fresh ``what``: each test gets its own backoff history."""
    return f"test-{uuid.uuid4().hex[:8]}"


def test_completed_event_returns_at_once_after_one_query():
    ev = Flag(done=True)
    waited = kvferry.bounded_wait(ev, 5.0, what=_name())
    assert isinstance(waited, float)
    assert 0.0 <= waited < 0.05
    assert len(ev.queries) == 1


def test_event_completed_late_by_another_thread():
    ev = Flag()
    setter = threading.Timer(0.2, ev.set)
    t0 = time.monotonic()
    setter.start()
    waited = kvferry.bounded_wait(ev, 10.0, what=_name())
    elapsed = time.monotonic() - t0
    setter.join()
    # The setter thread needed the GIL to run: the wait released it.
    assert 0.19 <= waited <= elapsed
    assert elapsed < 2.0


@pytest.mark.parametrize("timeout", [0.05, 0.3])
def test_never_completing_event_raises_within_timeout_plus_20ms(timeout):
    what = _name()
    ev = Flag(device="npu:3")
    t0 = time.monotonic()
    with pytest.raises(kvferry.TimeoutError) as info:
        kvferry.bounded_wait(ev, timeout, what=what)
    elapsed = time.monotonic() - t0
    assert timeout <= elapsed <= timeout + 0.020, elapsed
    e = info.value
    assert isinstance(e, kvferry.Error) and isinstance(e, TimeoutError)
    assert e.op == what
    assert e.device == "npu:3"
    assert timeout <= e.waited <= elapsed
    msg = str(e)
    assert what in msg and "npu:3" in msg and "waited" in msg


def test_timeout_names_the_event_type_when_what_is_omitted():
    with pytest.raises(kvferry.TimeoutError) as info:
        kvferry.bounded_wait(Flag(device=None), 0.01)
    assert "Flag" in str(info.value) and "Flag" in info.value.op


def test_query_that_raises_propagates_unchanged():
    class Broken:
        calls = 0

        def query(self):
            Broken.calls += 1
            if Broken.calls >= 3:
                raise RuntimeError("device lost")
            return False

    with pytest.raises(RuntimeError, match="device lost"):
        kvferry.bounded_wait(Broken(), 5.0, what=_name())
    assert Broken.calls == 3


def test_object_without_query_is_an_attribute_error():
    with pytest.raises(AttributeError):
        kvferry.bounded_wait(object(), 1.0)


@pytest.mark.parametrize("bad", [-1.0, -1e-9, math.nan, math.inf])
def test_bad_timeouts_are_refused(bad):
    ev = Flag(done=True)
    with pytest.raises(kvferry.InvalidArgumentError, match="timeout"):
        kvferry.bounded_wait(ev, bad)
    assert ev.queries == []


def test_zero_timeout_queries_once():
    assert kvferry.bounded_wait(Flag(done=True), 0) < 0.05
    ev = Flag()
    with pytest.raises(kvferry.TimeoutError):
        kvferry.bounded_wait(ev, 0, what=_name())
    assert len(ev.queries) == 1


def test_waiting_a_second_is_not_a_busy_spin():
    """A second on a never-completing event: about 90 queries and little CPU."""
    ev = Flag()
    cpu0 = time.thread_time()
    with pytest.raises(kvferry.TimeoutError):
        kvferry.bounded_wait(ev, 1.0, what=_name())
    cpu = time.thread_time() - cpu0
    assert 20 <= len(ev.queries) <= 150, len(ev.queries)
    # Target is < 1 ms (0.1 %); the bound here is loose because the machine is shared.
    assert cpu < 0.02, cpu
    # Intervals grow to 20 ms and no further.
    gaps = [b - a for a, b in zip(ev.queries, ev.queries[1:])]
    assert max(gaps) < 0.020 + 0.015


def test_backoff_adapts_to_the_usual_completion_time():
    """After waits that took ~60 ms, a wait sleeps until just before 60 ms instead of
    polling from the start; a wait without history polls from 10 µs on."""
    what = _name()
    cold = At(time.monotonic() + 0.06)
    kvferry.bounded_wait(cold, 5.0, what=what)
    for _ in range(3):
        kvferry.bounded_wait(At(time.monotonic() + 0.06), 5.0, what=what)
    t0 = time.monotonic()
    warm = At(t0 + 0.06)
    kvferry.bounded_wait(warm, 5.0, what=what)
    early = [q for q in warm.queries if q < t0 + 0.045]
    # The first query, then the sleep towards the horizon in pieces of <= 20 ms.
    assert len(early) <= 4, len(early)
    early_cold = [q for q in cold.queries if q < cold.at - 0.015]
    assert len(early_cold) >= 8, len(early_cold)
    # And it resumed soon after the event completed.
    assert warm.queries[-1] - warm.at < 0.010


def test_history_ignores_waits_that_found_the_event_complete():
    what = _name()
    for _ in range(5):
        kvferry.bounded_wait(Flag(done=True), 1.0, what=what)
    ev = At(time.monotonic() + 0.03)
    kvferry.bounded_wait(ev, 5.0, what=what)
    # No history of pending waits: polling started at once.
    assert len([q for q in ev.queries if q < ev.at - 0.01]) >= 5


class FakeCudaEvent:
    """Looks like ``torch.cuda.Event`` to bounded_wait: a raw ``cuda_event`` handle."""

    def __init__(self, handle: int) -> None:
        self.cuda_event = handle
        self.device = "cuda:0"

    def query(self) -> bool:  # must not be called on the CUDA path
        raise AssertionError("query() called on a CUDA event")


@pytest.mark.skipif(not kvferry.HAS_CUDA, reason="this build has no cuda feature")
def test_never_recorded_cuda_event_is_complete():
    # torch creates the CUevent lazily at the first record(); until then query() is True.
    assert kvferry.bounded_wait(FakeCudaEvent(0), 1.0) < 0.05


@pytest.mark.skipif(not kvferry.HAS_CUDA, reason="this build has no cuda feature")
@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is present (scripts/gpu-check.sh)")
def test_cuda_event_without_a_driver_is_a_device_error():
    with pytest.raises(kvferry.DeviceError, match="no device") as info:
        kvferry.bounded_wait(FakeCudaEvent(0xDEAD), 1.0, what="copy_event")
    assert "copy_event" in str(info.value)
