"""``bounded_wait``'s CUDA host-function path without a GPU, against a stand-in driver
(``bounded_wait_fake_libcuda.c``, compiled here and loaded by a child process through
``LD_LIBRARY_PATH``). It checks kvferry's side — a pending CUDA event is waited for on a
notifier set by a host function, not polled; a timed-out wait leaves its watch stream
held until the event completes and a later wait gets another; streams are reused; past
64 held streams, or without a device ordinal, the wait polls instead; the calling
thread's context stack is left as it was — not CUDA's semantics, which
``scripts/gpu-check.sh`` tests on a real GPU (``test_bounded_wait.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvferry

HERE = Path(__file__).parent

CHILD = r"""
import ctypes, json, sys, threading, time
lib = ctypes.CDLL(sys.argv[1])
lib.fake_event_new.restype = ctypes.c_void_p
lib.fake_event_set.argtypes = [ctypes.c_void_p]
import kvferry
st = kvferry._kvferry._bounded_wait_stats
out = {}

class Ev:
    def __init__(self, h, dev="cuda:0"):
        self.cuda_event = h
        self.device = dev
    def query(self):
        raise AssertionError("query() called on the CUDA path")

def settle(busy):
    # The fake driver counts a host function as fired once it returned.
    deadline = time.monotonic() + 2
    while lib.fake_fired() != lib.fake_launches() - busy and time.monotonic() < deadline:
        time.sleep(0.005)

def later(h, s):
    threading.Timer(s, lambda: lib.fake_event_set(h)).start()

h = lib.fake_event_new(); later(h, 0.2)
c0 = time.thread_time()
out["late_waited"] = kvferry.bounded_wait(Ev(h), 5.0, what="late")
out["late_cpu"] = time.thread_time() - c0
settle(0)
out["late"] = st()
out["depth_after_late"] = lib.fake_depth()

stuck = lib.fake_event_new()
t0 = time.monotonic(); c0 = time.thread_time()
try:
    kvferry.bounded_wait(Ev(stuck), 1.0, what="stuck")
    out["stuck_error"] = None
except kvferry.TimeoutError as e:
    out["stuck_error"] = str(e)
out["stuck_elapsed"] = time.monotonic() - t0
out["stuck_cpu"] = time.thread_time() - c0
out["stuck"] = st()

other = lib.fake_event_new(); later(other, 0.05)
out["other_waited"] = kvferry.bounded_wait(Ev(other), 5.0, what="other")
settle(1)
out["other"] = st()
out["streams_after_other"] = lib.fake_streams_created()

lib.fake_event_set(stuck)
deadline = time.monotonic() + 5
while st()["cuda_watch_busy"] and time.monotonic() < deadline:
    time.sleep(0.01)
out["released"] = st()

again = lib.fake_event_new(); later(again, 0.05)
kvferry.bounded_wait(Ev(again), 5.0, what="again")
out["streams_after_reuse"] = lib.fake_streams_created()

no_ordinal = lib.fake_event_new(); later(no_ordinal, 0.05)
kvferry.bounded_wait(Ev(no_ordinal, dev="cuda"), 5.0, what="no ordinal")
out["no_ordinal"] = st()

many = [lib.fake_event_new() for _ in range(66)]
for m in many:
    try:
        kvferry.bounded_wait(Ev(m), 0.001, what="many")
    except kvferry.TimeoutError:
        pass
out["many"] = st()
for m in many:
    lib.fake_event_set(m)
deadline = time.monotonic() + 5
while st()["cuda_watch_busy"] and time.monotonic() < deadline:
    time.sleep(0.01)
out["many_released"] = st()
out["depth_at_end"] = lib.fake_depth()
print(json.dumps(out))
"""


@pytest.mark.skipif(not kvferry.HAS_CUDA, reason="this build of kvferry has no cuda feature")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in driver is built for Linux")
def test_cuda_events_are_notified_by_a_host_function_not_polled(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in driver")
    so = tmp_path / "libcuda.so"
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-o", str(so), str(HERE / "bounded_wait_fake_libcuda.c"), "-lpthread"],
        check=True,
    )
    os.symlink(so, tmp_path / "libcuda.so.1")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(so)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])

    # Completed late: woken by the host function, no poll; the stream went back idle.
    assert 0.19 <= out["late_waited"] < 3.0
    late = out["late"]
    assert (late["cuda_notify"], late["cuda_poll"], late["polls"]) == (1, 0, 0), late
    assert (late["cuda_watch_fired"], late["cuda_watch_busy"], late["cuda_watch_idle"]) == (1, 0, 1)
    assert out["depth_after_late"] == 0  # the context pushed was popped
    assert out["late_cpu"] < 0.02  # one wake-up; a poll loop would cost far more

    # Never completing: raises on time, its stream is held (the host function owns it).
    assert out["stuck_error"] is not None and "stuck on cuda:0" in out["stuck_error"]
    assert 1.0 <= out["stuck_elapsed"] <= 1.02, out["stuck_elapsed"]
    assert out["stuck"]["cuda_watch_busy"] == 1 and out["stuck"]["polls"] == 0
    assert out["stuck_cpu"] < 0.02  # one wake-up and a few queries; a spin would be ~1 s

    # Another event meanwhile: a fresh stream, not queued behind the stuck one.
    assert out["other_waited"] < 1.0
    assert out["streams_after_other"] == 2
    assert out["other"]["cuda_watch_busy"] == 1

    # The stuck event completes: its late host function gives the stream back; reused.
    assert out["released"]["cuda_watch_busy"] == 0 and out["released"]["cuda_watch_idle"] == 2
    assert out["streams_after_reuse"] == 2

    # Without a device ordinal ("cuda"): polled with cuEventQuery instead.
    assert out["no_ordinal"]["cuda_poll"] == 1 and out["no_ordinal"]["polls"] >= 1

    # At most 64 streams held behind stuck events; past that the waits poll.
    assert out["many"]["cuda_watch_busy"] == 64
    assert out["many"]["cuda_poll"] == 3  # the no-ordinal one and two of the 66
    assert out["many_released"]["cuda_watch_busy"] == 0
    assert out["many_released"]["cuda_watch_idle"] == 64
    assert out["depth_at_end"] == 0
