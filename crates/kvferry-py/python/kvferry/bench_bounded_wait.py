"""Benchmark of :func:`kvferry.bounded_wait`: CPU per second of waiting, and latency
added when the event completes during the wait.

    python -m kvferry.bench_bounded_wait [--samples 300] [--json]

- **cpu**: ``bounded_wait`` waits 1 s on an event that never completes (``query()``
  always False) until its timeout, without history and after waits of the same
  ``what`` that completed in 2 ms (a device hanging mid-run); the waiting thread's CPU time
  (``time.thread_time``) and the process's (``resource.getrusage``) over the wait, as
  a percentage of one core, with the number of queries made.
  Beside it, the CPU one ``time.sleep`` wake-up costs here (each query of a polling
  wait pays at least that).
- **latency**: another thread completes the event after a delay and stamps the
  moment; the waiter stamps the moment ``bounded_wait`` returned; the difference is the
  latency the wait adds. Scenarios: ``steady`` (every completion 2 ms after the wait
  starts, as a stream of similar decode steps; the backoff has a history), ``varied``
  (delays uniform in 0.5–5 ms, with history), ``cold`` (2 ms, a fresh ``what`` each
  time: no history) and, as the floor of a thread handing a result to another on this
  machine, ``threading.Event.wait`` (a blocking, event-driven wait) with the same
  2 ms delays.

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
from .bounded_wait import bounded_wait


class _Never:
    def __init__(self) -> None:
        self.queries = 0
        self.device = "bench"

    def query(self) -> bool:
        self.queries += 1
        return False


class _Flag:
    def __init__(self) -> None:
        self.done = False
        self.t_set = 0
        self.device = "bench"
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def measure_cpu(seconds: float = 1.0, history: bool = False) -> dict[str, Any]:
    """One wait of ``seconds`` on a never-completing event; with ``history``, after
    waits on the same ``what`` that completed in 2 ms (a device that hangs mid-run)."""
    what = f"bench-never-{uuid.uuid4().hex[:6]}"
    if history:
        _latency(8, lambda: 0.002, lambda: what, 0)
    ev = _Never()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.thread_time()
    w0 = time.monotonic()
    try:
        bounded_wait(ev, seconds, what=what)
    except errors.TimeoutError:
        pass
    wall = time.monotonic() - w0
    thread_cpu = time.thread_time() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    proc_cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
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
    samples: int, delay: Callable[[], float], what: Callable[[], str], warmup: int
) -> tuple[list[float], float, float]:
    """Microseconds from the completer's stamp to bounded_wait's return; queries and
    waiter CPU microseconds per wait."""
    out: list[float] = []
    queries = 0
    cpu = 0.0
    for i in range(warmup + samples):
        ev = _Flag()
        d = delay()

        def complete(ev: _Flag = ev, d: float = d) -> None:
            time.sleep(d)
            ev.t_set = time.perf_counter_ns()
            ev.done = True

        t = threading.Thread(target=complete)
        t.start()
        c0 = time.thread_time()
        bounded_wait(ev, 5.0, what=what())
        end = time.perf_counter_ns()
        c1 = time.thread_time()
        t.join()
        if i >= warmup:
            out.append((end - ev.t_set) / 1e3)
            queries += ev.queries
            cpu += (c1 - c0) * 1e6
    return out, queries / samples, cpu / samples


def _latency_threading_event(samples: int, delay: float) -> list[float]:
    out: list[float] = []
    for _ in range(samples):
        ev = threading.Event()
        stamp = [0]

        def complete(ev: threading.Event = ev, stamp: list[int] = stamp) -> None:
            time.sleep(delay)
            stamp[0] = time.perf_counter_ns()
            ev.set()

        t = threading.Thread(target=complete)
        t.start()
        ev.wait()
        end = time.perf_counter_ns()
        t.join()
        out.append((end - stamp[0]) / 1e3)
    return out


def _summary(xs: list[float], queries: float | None = None, cpu_us: float | None = None) -> dict[str, Any]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=100, method="inclusive")
    out: dict[str, Any] = {"samples": len(xs), "p50_us": q[49], "p99_us": q[98], "max_us": xs[-1]}
    out["queries_per_wait"] = queries
    out["cpu_us_per_wait"] = cpu_us
    return out


def run(samples: int = 300, cpu_runs: int = 3) -> dict[str, Any]:
    """All measurements, as a dict."""
    rng = random.Random(25)
    steady_name = f"bench-steady-{uuid.uuid4().hex[:6]}"
    varied_name = f"bench-varied-{uuid.uuid4().hex[:6]}"
    return {
        "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "cpu": [measure_cpu(1.0, history) for history in (False, True) for _ in range(cpu_runs)],
        "wakeup_cost_us": wakeup_cost_us(),
        "latency": {
            "steady 2 ms": _summary(*_latency(samples, lambda: 0.002, lambda: steady_name, 20)),
            "varied 0.5-5 ms": _summary(
                *_latency(samples, lambda: rng.uniform(0.0005, 0.005), lambda: varied_name, 20)
            ),
            "cold 2 ms": _summary(*_latency(samples, lambda: 0.002, lambda: f"bench-cold-{uuid.uuid4().hex}", 0)),
            "threading.Event 2 ms": _summary(_latency_threading_event(samples, 0.002)),
        },
    }


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
    print("\nCPU while waiting 1 s on an event that never completes (target < 0.1 % of a core)")
    print(
        f"{'history':<8} {'wall s':>7} {'thread ms':>10} {'% core':>7} {'process ms':>11} {'% core':>7} {'queries':>8}"
    )
    for c in res["cpu"]:
        h = "2 ms" if c["history"] else "none"
        print(
            f"{h:<8} {c['wall_s']:>7.3f} {c['thread_cpu_ms']:>10.3f} {c['thread_pct_core']:>7.3f} "
            f"{c['process_cpu_ms']:>11.3f} {c['process_pct_core']:>7.3f} {c['queries']:>8}"
        )
    print(f"(one time.sleep wake-up costs {res['wakeup_cost_us']:.1f} us of CPU on this machine)")
    print("\nLatency added when another thread completes the event (target p50 <= 50 us, p99 <= 200 us)")
    print(
        f"{'scenario':<22} {'samples':>7} {'p50 us':>8} {'p99 us':>8} {'max us':>8} "
        f"{'queries/wait':>12} {'cpu us/wait':>11}"
    )
    for name, s in res["latency"].items():
        q = "" if s["queries_per_wait"] is None else f"{s['queries_per_wait']:.1f}"
        c = "" if s["cpu_us_per_wait"] is None else f"{s['cpu_us_per_wait']:.0f}"
        print(
            f"{name:<22} {s['samples']:>7} {s['p50_us']:>8.1f} {s['p99_us']:>8.1f} {s['max_us']:>8.1f} "
            f"{q:>12} {c:>11}"
        )


if __name__ == "__main__":
    main()
