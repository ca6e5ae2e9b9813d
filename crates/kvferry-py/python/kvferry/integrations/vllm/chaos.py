"""The connector's chaos soak: ``python -m kvferry.integrations.vllm.chaos
--requests N --seed S`` prints a JSON summary and exits 1 if a check failed.

What runs
---------
A prefill instance (TP 2, vLLM 0.33's real ``Scheduler`` with ``KvferryConnector`` as
``kv_producer``, in a process of its own: :class:`~.chaos_node.RemoteNode`) and two
decode instances (TP 1 — a heterogeneous pair, every pull a plan over two prefill
ranks — as ``kv_consumer``): one on the ``sim`` device with ``read_batch`` 1, one on
host memory with ``read_batch`` 8. KV tensors come from vLLM's own allocation path
(:mod:`.alloc`). Requests arrive in rounds of random size, prompts of random length
built on a few shared prefixes (local prefix-cache hits on the decode). Chaos:

- aborts at every stage: before the pull starts, mid-pull, after it landed, and on the
  prefill (a request aborted there is never published);
- the prefill SIGKILLed mid-pull and restarted (a new incarnation: pulls of the dead
  one fail as load errors and are recomputed);
- sim device faults on the decode: failing copies (``fail_copy``), copies stalled or
  never completing until released (undrained failures), slow copies;
- pull timeouts (the prefill's sends delayed past the decode's ``timeout``);
- one burst of requests aborted in one step before their pulls: more than 4,096
  reader-slot keys released to each prefill rank in one step (cut at ``max_keys``).

Checks, at every quiescent point (after each round) and at the end: both decodes' and
the prefill's free blocks equal their start, the prefill publishes nothing
(``published_now`` 0 — well before any lease could have ended), every landed request's
every head of every prompt token equals what the prefill wrote, and no decode request
lived longer than its ``timeout`` plus :data:`BOUND` (plus the time a stall was held).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

__all__ = ["run", "main"]

TIMEOUT = 4.0  # the decodes' pull timeout
LEASE_TTL = 60.0  # the prefill's: far above every quiescence wait, so nothing expires
BOUND = 3.0  # a request's life past its timeout (steps, drains, a local recompute)
QUIET_WAIT = 10.0  # how long a quiescent point may take to settle
SLOTS = 64  # reader slots per request
BURST = 70  # requests aborted in one step before their pulls: 4,480 keys per prefill rank
SHAPE = {"kv_heads": 4, "head_size": 32, "block_size": 16}


def _model(tmp: str) -> str:
    from .bench import model_dir

    return model_dir(tmp, layers=2, kv_heads=SHAPE["kv_heads"], head_dim=SHAPE["head_size"])


class Soak:
    def __init__(self, requests: int, seed: int, log: Any = None) -> None:
        from .chaos_node import Node

        self.rng = random.Random(seed)
        self.requests, self.seed = requests, seed
        self.log = log or (lambda *a: None)
        self.tmp = tempfile.mkdtemp(prefix="kvferry-chaos-")
        self.model = _model(self.tmp)
        self.n = 0
        self.c: dict[str, int] = {k: 0 for k in (
            "requests", "landed", "load_errors", "aborts_before_pull", "aborts_mid_pull", "aborts_after_landed",
            "aborts_on_prefill", "prefill_kills", "device_faults", "pull_timeout_rounds", "burst_requests",
            "corrupted_tokens", "checked_tokens", "leaked_blocks", "leaked_publications", "late_requests", "rounds",
        )}
        self.c["max_life_over_timeout_ms"] = 0
        self.violations: list[str] = []
        self.prefixes = [[self.rng.randrange(4, 1000) for _ in range(self.rng.randrange(16, 64))] for _ in range(4)]
        common: dict[str, Any] = {"model": self.model, "tp": 1, "num_blocks": 1024, **SHAPE}
        base = {"timeout": TIMEOUT, "lease_ttl": LEASE_TTL, "arena_bytes": 64 << 20, "io_timeout": 2.0}
        self.decodes = [
            Node("kv_consumer", extra={**base, "device": "sim", "device_timeout": 1.0, "read_batch": 1}, tag="d-sim", **common),
            Node("kv_consumer", extra={**base, "read_batch": 8}, tag="d-host", **common),
        ]
        self.prefill = self._start_prefill()

    def _start_prefill(self) -> Any:
        from .chaos_node import RemoteNode

        extra = {"timeout": 10.0, "lease_ttl": LEASE_TTL, "arena_bytes": 64 << 20, "reader_slots": SLOTS}
        return RemoteNode(model=self.model, tp=2, num_blocks=2048, tag="p", extra=extra, **SHAPE)

    def prompts(self, k: int) -> list[tuple[str, list[int]]]:
        out = []
        for _ in range(k):
            self.n += 1
            pre = self.prefixes[self.rng.randrange(len(self.prefixes))] if self.rng.random() < 0.6 else []
            tail = [self.rng.randrange(4, 1000) for _ in range(self.rng.randrange(8, 160))]
            out.append((f"s{self.seed}-{self.n}", (pre + tail)[:400]))
        return out

    # -- one round ---------------------------------------------------------------------

    def round(self, k: int, kill: bool, timeouts: bool, burst: bool) -> None:
        rng = self.rng
        d = self.decodes[self.c["rounds"] % 2] if not burst else self.decodes[1]
        self.c["rounds"] += 1
        reqs = self.prompts(k)
        self.c["requests"] += k
        # Some requests are aborted on the prefill: never published, never pulled.
        abort_p = {r for r, _ in reqs if rng.random() < 0.05 and not burst}
        params = self.prefill.prefill(reqs, abort=abort_p)
        reqs = [(r, p) for r, p in reqs if params[r] is not None and params[r].get("do_remote_prefill")]
        self.c["aborts_on_prefill"] += k - len(reqs)
        stall_until: float | None = None
        slowed = kill or (not burst and not timeouts and rng.random() < 0.3)
        if slowed:  # the pulls are in flight a while: it dies, or they are aborted, mid-pull
            self.prefill.send("delay", 300_000 if kill else 100_000)
        if timeouts:
            self.c["pull_timeout_rounds"] += 1
            self.prefill.send("delay", 5_000_000)
        sim = d is self.decodes[0]
        if sim and not burst and rng.random() < 0.9:
            eng = d.workers()[0].engine._e
            for _ in range(rng.choice([1, 1, 2])):
                fault = rng.choice(["fail_copy", "stall", "never_complete", "slow:50"])
                eng._inject_device_fault(fault, rng.choice(["next", "2", "3", "5"]))
                self.c["device_faults"] += 1
                if fault in ("stall", "never_complete"):
                    stall_until = time.monotonic() + rng.uniform(0.2, 1.5)
        plan: dict[str, str] = {}
        for rid, prompt in reqs:
            d.add(rid, prompt, max_tokens=2, params=params[rid])
            x = rng.random()
            plan[rid] = "burst" if burst else ("before" if x < 0.08 else "mid" if x < 0.16 else "after" if x < 0.22 else "")
        added = time.monotonic()
        for rid, how in plan.items():
            if how in ("before", "burst"):
                d.abort(rid)
                self.c["aborts_before_pull"] += 1
        if burst:  # every slot of every request, to each prefill rank, in one step
            self.c["burst_keys_per_rank"] = max(self.c.get("burst_keys_per_rank", 0), len(reqs) * SLOTS)
        steps = 0
        gone: dict[str, float] = {}
        killed = False
        held_extra = 0.0
        while any(r in d.scheduler.requests for r in plan) or steps == 0:
            d.step()
            steps += 1
            now = time.monotonic()
            if stall_until is not None and now >= stall_until:
                d.workers()[0].engine._e._release_device()
                held_extra = now - added
                stall_until = None
            if kill and not killed and steps == 1:
                self.prefill.kill()
                self.c["prefill_kills"] += 1
                killed = True
            for rid, how in plan.items():
                if rid not in d.scheduler.requests or d.scheduler.requests[rid].is_finished():
                    continue
                if how == "mid" and steps == 1:
                    d.abort(rid)
                    self.c["aborts_mid_pull" if rid not in d.finished_recving else "aborts_after_landed"] += 1
                elif how == "after" and rid in d.finished_recving:
                    d.abort(rid)
                    self.c["aborts_after_landed"] += 1
            if now - added > TIMEOUT + BOUND + 30.0:
                self.violations.append(f"round {self.c['rounds']}: requests still held after {now - added:.1f}s")
                break
            for rid in plan:
                if rid not in gone and rid not in d.scheduler.requests:
                    gone[rid] = now
            time.sleep(0.001)
        if stall_until is not None:
            d.workers()[0].engine._e._release_device()
        d.workers()[0].engine._e._release_device() if sim else None
        for rid in plan:
            life = gone.get(rid, time.monotonic()) - added
            over = life - TIMEOUT - held_extra
            self.c["max_life_over_timeout_ms"] = max(self.c["max_life_over_timeout_ms"], int(over * 1000))
            if over > BOUND:
                self.c["late_requests"] += 1
                self.violations.append(f"round {self.c['rounds']}: {rid} lived {life:.2f}s (timeout {TIMEOUT}s, stall held {held_extra:.2f}s)")
        if (timeouts or slowed) and not killed:
            self.prefill.send("delay", 0)
        for rid in plan:
            if rid in d.failed_recving:
                self.c["load_errors"] += 1
            elif rid in d.checked:
                self.c["landed"] += 1
                self.c["corrupted_tokens"] += d.checked[rid]
                self.c["checked_tokens"] += len(dict(reqs)[rid])
        if killed:
            self.prefill = self._start_prefill()
        self.quiescent(f"round {self.c['rounds']}")

    def quiescent(self, where: str) -> None:
        """Both sides back where they started (steps the decodes while waiting)."""
        deadline = time.monotonic() + QUIET_WAIT
        while True:
            for d in self.decodes:
                d.step()
            st = self.prefill.state()
            leaks = [d.free_at_start - d.free_blocks() for d in self.decodes]
            pleak = st["free_at_start"] - st["free"]
            ok = not any(leaks) and not pleak and not st["published_now"] and not st["requests"]
            ok = ok and all(not d.scheduler.requests for d in self.decodes)
            if ok:
                return
            if time.monotonic() > deadline:
                self.c["leaked_blocks"] += sum(max(0, x) for x in leaks) + max(0, pleak)
                self.c["leaked_publications"] += st["published_now"]
                self.violations.append(f"{where}: decode blocks short {leaks}, prefill {pleak}, published {st['published_now']}")
                return
            time.sleep(0.01)

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        rng = self.rng
        kills = 1 if self.requests < 300 else max(2, self.requests // 400)
        burst_at: int | None = self.requests // 4 if self.requests >= 100 else None
        kill_at = sorted({int(self.requests * (i + 1) / (kills + 1)) for i in range(kills)})
        done = 0
        while done < self.requests:
            burst = burst_at is not None and done >= burst_at
            kill = not burst and bool(kill_at) and done >= kill_at[0]
            if burst:
                k, timeouts, burst_at = BURST, False, None
            else:
                k = min(rng.randrange(4, 13), self.requests - done)
                if kill:
                    kill_at.pop(0)
                timeouts = not kill and rng.random() < 0.04
            self.log(f"round {self.c['rounds'] + 1}: {k} requests{' burst' if burst else ''}{' kill' if kill else ''}{' timeouts' if timeouts else ''} ({done}/{self.requests})")
            self.round(k, kill, timeouts, burst)
            if burst:
                self.c["requests"] -= k
                self.c["burst_requests"] += k
            else:
                done += k
        self.quiescent("end")
        stats = [w.engine.stats().get("device", {}) for d in self.decodes for w in d.workers()]
        out: dict[str, Any] = {"seed": self.seed, **self.c, "wall_s": round(time.monotonic() - t0, 1)}
        out["device_stats_sim"] = stats[0]
        out["violations"] = self.violations
        out["ok"] = not self.violations and self.c["corrupted_tokens"] == 0
        return out

    def close(self) -> None:
        self.prefill.stop()
        for d in self.decodes:
            d.close()


def run(requests: int = 100, seed: int = 1, verbose: bool = False) -> dict[str, Any]:
    """Runs the soak (module docs); returns its summary."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if verbose else None
    soak = Soak(requests, seed, log)
    try:
        return soak.run()
    finally:
        soak.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvferry.integrations.vllm.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    out = run(a.requests, a.seed, a.verbose)
    print(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
