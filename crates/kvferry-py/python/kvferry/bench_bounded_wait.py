"""Benchmark of :func:`kvferry.bounded_wait`, per kind of event: CPU per second of
waiting, and latency added when the event completes during the wait.

    python -m kvferry.bench_bounded_wait [--samples 300] [--json]

Kinds of event (each takes its own path through ``bounded_wait``):

- ``query()``: a Python object whose ``query()`` reads a flag — polled on the adaptive
  schedule, GIL taken for each query (``torch.Event`` of accelerators other than CUDA,
  user objects).
- ``CompletionEvent``: ``kvferry.CompletionEvent``, completed with ``set()`` — the
  waiter sleeps on its notifier, no polling.
- ``cuda``: a ``torch.cuda.Event`` behind a stream gated on a flag in pinned host
  memory (``cuStreamWaitValue32``) that the completing thread sets — notified by a
  driver host function. Only where torch sees a CUDA GPU; skipped with the reason
  otherwise.

Measurements:

- **cpu**: ``bounded_wait`` waits 1 s on an event that never completes, until its
  timeout (for ``query()`` also after waits of the same ``what`` that completed in
  2 ms: a device hanging mid-run); the waiting thread's CPU time (``time.thread_time``)
  and the process's (``resource.getrusage``) over the wait, as a percentage of one
  core, with the number of queries made. Beside it, the CPU one ``time.sleep`` wake-up
  costs here (each query of a polling wait pays at least that).
- **latency**: another thread completes the event after a delay and stamps the moment
  just before; the waiter stamps the moment ``bounded_wait`` returned; the difference
  is the latency the wait adds (the completing thread then blocks with the GIL
  released, as a worker or driver thread carries on, rather than exiting: a thread's
  exit would hold the GIL against the waiter). ``fixed 2 ms`` (every completion 2 ms after the wait
  starts, as a stream of similar decode steps; polling has a history), ``varied
  0.5-5 ms`` (delays uniform over the wait), and for ``query()`` ``cold 2 ms`` (a fresh
  ``what`` each time: no history). As the floor of one thread waking another here,
  ``threading.Event.wait`` with the same 2 ms delays.

Targets (issue 25): cpu < 0.1 % of a core; latency p50 <= 50 µs, p99 <= 200 µs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from . import errors
from ._kvferry import CompletionEvent
from .bounded_wait import bounded_wait

CPU_TARGET_PCT = 0.1
P50_TARGET_US = 50.0
P99_TARGET_US = 200.0


class _Flag:
    """A ``query()`` event completed by ``complete()``; counts its queries."""

    def __init__(self) -> None:
        self.done = False
        self.device = "bench"
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def complete(self) -> None:
        self.done = True


class _Notified:
    """A ``kvferry.CompletionEvent`` with the interface of ``_Flag``."""

    def __init__(self) -> None:
        self.event = CompletionEvent(device="bench")
        self.queries = 0

    def complete(self) -> None:
        self.event.set()


class _Kind:
    """How to make, complete and wait for one kind of event."""

    def __init__(self, name: str, make: Callable[[], Any], wait_target: Callable[[Any], Any]) -> None:
        self.name = name
        self.make = make
        self.wait_target = wait_target


QUERY = _Kind("query()", _Flag, lambda ev: ev)
NOTIFY = _Kind("CompletionEvent", _Notified, lambda ev: ev.event)


def measure_cpu(kind: _Kind = QUERY, seconds: float = 1.0, history: bool = False) -> dict[str, Any]:
    """One wait of ``seconds`` on a never-completing event; with ``history``, after
    waits on the same ``what`` that completed in 2 ms (a device that hangs mid-run)."""
    what = f"bench-never-{uuid.uuid4().hex[:6]}"
    if history:
        _latency(kind, 8, lambda: 0.002, lambda: what, 0)
    ev = kind.make()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.thread_time()
    w0 = time.monotonic()
    try:
        bounded_wait(kind.wait_target(ev), seconds, what=what)
    except errors.TimeoutError:
        pass
    wall = time.monotonic() - w0
    thread_cpu = time.thread_time() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    proc_cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    kind_close = getattr(ev, "close", None)
    if kind_close is not None:
        kind_close()
    return {
        "history": history,
        "wall_s": wall,
        "thread_cpu_ms": thread_cpu * 1e3,
        "thread_pct_core": 100 * thread_cpu / wall,
        "process_cpu_ms": proc_cpu * 1e3,
        "process_pct_core": 100 * proc_cpu / wall,
        "queries": ev.queries,
    }


def wakeup_cost_us(n: int = 25, sleep: float = 0.04) -> float:
    """CPU microseconds one ``time.sleep`` wake-up costs this thread on this machine:
    the floor under each query of a polling wait."""
    t0 = time.thread_time()
    for _ in range(n):
        time.sleep(sleep)
    return (time.thread_time() - t0) / n * 1e6


def _latency(
    kind: _Kind, samples: int, delay: Callable[[], float], what: Callable[[], str], warmup: int
) -> tuple[list[float], float, float]:
    """Microseconds from the completer's stamp to bounded_wait's return; queries and
    waiter CPU microseconds per wait."""
    out: list[float] = []
    queries = 0
    cpu = 0.0
    for i in range(warmup + samples):
        ev = kind.make()
        d = delay()
        stamp = [0]
        done = threading.Event()

        def complete(ev: Any = ev, d: float = d, stamp: list[int] = stamp, done: threading.Event = done) -> None:
            time.sleep(d)
            stamp[0] = time.perf_counter_ns()
            ev.complete()
            done.wait()  # stays alive, GIL released: not a thread exit racing the waiter

        t = threading.Thread(target=complete)
        t.start()
        c0 = time.thread_time()
        bounded_wait(kind.wait_target(ev), 5.0, what=what())
        end = time.perf_counter_ns()
        c1 = time.thread_time()
        done.set()
        t.join()
        close = getattr(ev, "close", None)
        if close is not None:
            close()
        if i >= warmup:
            out.append((end - stamp[0]) / 1e3)
            queries += ev.queries
            cpu += (c1 - c0) * 1e6
    return out, queries / samples, cpu / samples


def _latency_threading_event(samples: int, delay: float) -> list[float]:
    out: list[float] = []
    for _ in range(samples):
        ev = threading.Event()
        stamp = [0]
        done = threading.Event()

        def complete(ev: threading.Event = ev, stamp: list[int] = stamp, done: threading.Event = done) -> None:
            time.sleep(delay)
            stamp[0] = time.perf_counter_ns()
            ev.set()
            done.wait()

        t = threading.Thread(target=complete)
        t.start()
        ev.wait()
        end = time.perf_counter_ns()
        done.set()
        t.join()
        out.append((end - stamp[0]) / 1e3)
    return out


def _summary(xs: list[float], queries: float | None = None, cpu_us: float | None = None) -> dict[str, Any]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=100, method="inclusive")
    out: dict[str, Any] = {"samples": len(xs), "p50_us": q[49], "p99_us": q[98], "max_us": xs[-1]}
    out["queries_per_wait"] = queries
    out["cpu_us_per_wait"] = cpu_us
    out["meets_targets"] = q[49] <= P50_TARGET_US and q[98] <= P99_TARGET_US
    return out


def _kind_results(kind: _Kind, samples: int, cpu_runs: int, rng: random.Random, cold: bool) -> dict[str, Any]:
    fixed_name = f"bench-fixed-{uuid.uuid4().hex[:6]}"
    varied_name = f"bench-varied-{uuid.uuid4().hex[:6]}"
    histories = (False, True) if kind is QUERY else (False,)
    latency = {
        "fixed 2 ms": _summary(*_latency(kind, samples, lambda: 0.002, lambda: fixed_name, 20)),
        "varied 0.5-5 ms": _summary(
            *_latency(kind, samples, lambda: rng.uniform(0.0005, 0.005), lambda: varied_name, 20)
        ),
    }
    if cold:
        latency["cold 2 ms"] = _summary(
            *_latency(kind, samples, lambda: 0.002, lambda: f"bench-cold-{uuid.uuid4().hex}", 0)
        )
    cpu = [measure_cpu(kind, 1.0, h) for h in histories for _ in range(cpu_runs)]
    for c in cpu:
        c["meets_target"] = c["thread_pct_core"] < CPU_TARGET_PCT
    return {"cpu": cpu, "latency": latency}


def _cuda_kind() -> tuple[_Kind | None, str | None]:
    """The ``cuda`` kind where torch sees a GPU and the driver gates streams on host
    memory; else ``None`` and why not."""
    from ._kvferry import HAS_CUDA

    if not HAS_CUDA:
        return None, "this build of kvferry has no cuda feature"
    try:
        import ctypes

        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA GPU"
    lib = ctypes.CDLL("libcuda.so.1")
    wait_value = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
    wait_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wait_value.restype = ctypes.c_int
    host_devptr = lib.cuMemHostGetDevicePointer_v2
    host_devptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    host_devptr.restype = ctypes.c_int
    torch.cuda.init()

    class _Gated:
        """A ``torch.cuda.Event`` recorded behind a stream waiting for a host flag."""

        def __init__(self) -> None:
            self.flag = torch.zeros(1, dtype=torch.int32).pin_memory()
            dptr = ctypes.c_uint64(0)
            r = host_devptr(ctypes.byref(dptr), ctypes.c_void_p(self.flag.data_ptr()), 0)
            if r != 0:
                raise RuntimeError(f"cuMemHostGetDevicePointer: {r}")
            self.stream = torch.cuda.Stream()
            self.event = torch.cuda.Event()
            r = wait_value(ctypes.c_void_p(self.stream.cuda_stream), dptr.value, 1, 0x1)  # EQ
            if r != 0:
                raise RuntimeError(f"cuStreamWaitValue32: {r}")
            self.event.record(self.stream)
            self.queries = 0

        def complete(self) -> None:
            self.flag[0] = 1

        def close(self) -> None:
            self.flag[0] = 1
            self.event.synchronize()

    try:
        _Gated().close()
    except (RuntimeError, AttributeError, OSError) as e:
        return None, f"cannot gate a stream on host memory here: {e}"
    return _Kind("cuda", _Gated, lambda ev: ev.event), None


def run(samples: int = 300, cpu_runs: int = 3) -> dict[str, Any]:
    """All measurements, as a dict."""
    rng = random.Random(25)
    kinds: dict[str, Any] = {
        QUERY.name: _kind_results(QUERY, samples, cpu_runs, rng, cold=True),
        NOTIFY.name: _kind_results(NOTIFY, samples, cpu_runs, rng, cold=False),
    }
    cuda, why = _cuda_kind()
    if cuda is not None:
        kinds[cuda.name] = _kind_results(cuda, samples, cpu_runs, rng, cold=False)
    else:
        kinds["cuda"] = {"skipped": why}
    return {
        "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "targets": {"cpu_pct_core": CPU_TARGET_PCT, "p50_us": P50_TARGET_US, "p99_us": P99_TARGET_US},
        "wakeup_cost_us": wakeup_cost_us(),
        "kinds": kinds,
        "floor": {"threading.Event 2 ms": _summary(_latency_threading_event(samples, 0.002))},
    }


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvferry.bench_bounded_wait", description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=300, help="latency samples per scenario")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = ap.parse_args(argv)
    res = run(args.samples)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    m = res["machine"]
    print(f"bounded_wait benchmark ({m['cpus']} CPUs, load average {m['loadavg'][0]:.2f})")
    print(f"(one time.sleep wake-up costs {res['wakeup_cost_us']:.1f} us of CPU on this machine)")
    print(
        f"\nCPU while waiting 1 s on an event that never completes (target < {CPU_TARGET_PCT} % of a core)"
    )
    print(
        f"{'kind':<16} {'history':<8} {'wall s':>7} {'thread ms':>10} {'% core':>7} "
        f"{'process ms':>11} {'% core':>7} {'queries':>8}  target"
    )
    for kind, r in res["kinds"].items():
        if "skipped" in r:
            print(f"{kind:<16} skipped: {r['skipped']}")
            continue
        for c in r["cpu"]:
            h = "2 ms" if c["history"] else "none"
            print(
                f"{kind:<16} {h:<8} {c['wall_s']:>7.3f} {c['thread_cpu_ms']:>10.3f} {c['thread_pct_core']:>7.3f} "
                f"{c['process_cpu_ms']:>11.3f} {c['process_pct_core']:>7.3f} {c['queries']:>8}  "
                f"{_mark(c['meets_target'])}"
            )
    print(
        f"\nLatency added when another thread completes the event "
        f"(target p50 <= {P50_TARGET_US:.0f} us, p99 <= {P99_TARGET_US:.0f} us)"
    )
    print(
        f"{'kind':<16} {'scenario':<16} {'samples':>7} {'p50 us':>8} {'p99 us':>8} {'max us':>8} "
        f"{'queries/wait':>12} {'cpu us/wait':>11}  target"
    )
    rows = [(k, n, s) for k, r in res["kinds"].items() if "latency" in r for n, s in r["latency"].items()]
    rows += [("(floor)", n, s) for n, s in res["floor"].items()]
    for kind, name, s in rows:
        q = "" if s["queries_per_wait"] is None else f"{s['queries_per_wait']:.1f}"
        c = "" if s["cpu_us_per_wait"] is None else f"{s['cpu_us_per_wait']:.0f}"
        mark = _mark(s["meets_targets"]) if kind != "(floor)" else ""
        print(
            f"{kind:<16} {name:<16} {s['samples']:>7} {s['p50_us']:>8.1f} {s['p99_us']:>8.1f} {s['max_us']:>8.1f} "
            f"{q:>12} {c:>11}  {mark}"
        )


if __name__ == "__main__":
    main()
