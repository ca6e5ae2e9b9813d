"""A vLLM test instance in a process of its own: :class:`RemoteInstance`.

The child runs the instance's engine loop as vLLM's ``EngineCore`` does — it steps while
its scheduler holds requests and answers the parent's commands between steps (add
prefills, inject faults, read its state) over a pipe — so a test can SIGKILL it as a
crashed or OOM-killed worker. The instance is one of :mod:`vllm_harness`'s classes,
named by ``kind`` and built from the same keyword arguments; it is imported only in the
child, so this module stays below the harness.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

def _serve(conn: Any, kind: str, role: str, kw: dict[str, Any]) -> None:
    """An instance's engine loop in its own process: steps while the scheduler holds
    requests (as EngineCore does), answering commands between steps. Each finished
    request is reported once, as ``(finish_reason, kv_transfer_params)``."""
    import vllm_harness as h

    inst = getattr(h, kind)(role, **kw)
    engines = [w.engine for w in inst.workers()]
    conn.send(("ready", [e.address for e in engines], [e.incarnation for e in engines], inst.free_at_start))
    reported: set[str] = set()
    hold_after_finish = 0.0  # seconds the loop pauses after a step that finished requests
    hold_until = 0.0
    while True:
        has = inst.scheduler.has_requests()
        busy = (has or bool(inst.held())) and time.monotonic() >= hold_until
        while conn.poll(0 if busy else 0.005):
            msg = conn.recv()
            cmd = msg[0]
            if cmd == "add":
                for rid, prompt in msg[1]:
                    inst.add(rid, prompt, 1, {"do_remote_decode": True})
                conn.send(("ok",))
            elif cmd == "faults":
                for e in engines:
                    e._e._inject_faults(send_delay_us=msg[1], corrupt_next_sends=None)
                conn.send(("ok",))
            elif cmd == "corrupt":
                for e in engines:
                    e._e._inject_faults(corrupt_next_sends=msg[1])
                conn.send(("ok",))
            elif cmd == "hold_after_finish":
                hold_after_finish = float(msg[1])
                conn.send(("ok",))
            elif cmd == "device_fault":
                for e in engines:
                    e._e._inject_device_fault(msg[1], msg[2])
                conn.send(("ok",))
            elif cmd == "device_release":
                for e in engines:
                    e._e._release_device()
                conn.send(("ok",))
            elif cmd == "device_stats":
                conn.send(("device_stats", engines[0].stats().get("device", {})))
            elif cmd == "leaks":
                conn.send(("leaks", h.scheduler_leaks(inst.scheduler)))
            elif cmd == "blocks":
                mgr = inst.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
                conn.send(("blocks", {r: [b.ref_cnt for b in bl] for r, bl in mgr.req_to_blocks.items()}))
            elif cmd == "state":
                by_rank = [sorted(w._sending) for w in inst.workers()]
                st = {
                    "held": sorted(inst.held()),
                    "free": inst.free_blocks(),
                    "free_at_start": inst.free_at_start,
                    "finished_sending": dict(inst.finished_sending),
                    "leaks": inst.leaks(),
                    "released": [dict(w.stats.data.get("published_released", {})) for w in inst.workers()],
                    "publishing": sorted({r for rids in by_rank for r in rids}),
                    "publishing_by_rank": by_rank,
                    "now": time.monotonic(),
                }
                conn.send(("state", st))
            elif cmd == "stop":
                inst.close()
                conn.send(("stopped",))
                return
        if busy:
            inst.step()
            new = {r: (str(o.finish_reason), o.kv_transfer_params) for r, o in inst.final.items() if r not in reported}
            if new:
                if hold_after_finish:
                    hold_until, hold_after_finish = time.monotonic() + hold_after_finish, 0.0
                reported |= set(new)
                conn.send(("finished", new))
            if not has:
                time.sleep(0.002)  # only waiting for releases: don't spin


class RemoteInstance:
    """A :class:`vllm_harness.Instance` (or the harness class named ``kind``) in a
    spawned process: a prefill that a test can SIGKILL (:meth:`kill`)."""

    def __init__(self, role: str = "kv_producer", kind: str = "Instance", **kw: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kind, role, kw), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 300
        while not self.conn.poll(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"instance process did not start (exit code {self.proc.exitcode})")
        _, self.addresses, self.incarnations, self.free_at_start = self.conn.recv()
        self.finished: dict[str, tuple[str, dict[str, Any]]] = {}  # rid -> (finish reason, params)

    @property
    def address(self) -> str:
        """Rank 0's kvferry address (the only one at ``tp=1``)."""
        return str(self.addresses[0])

    @property
    def incarnation(self) -> int:
        """Rank 0's engine incarnation."""
        return int(self.incarnations[0])

    def _poll(self, deadline: float) -> bool:
        while not self.conn.poll(0.05):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                return False
        return True

    def _call(self, *msg: Any, timeout: float = 60.0) -> tuple[Any, ...]:
        self.conn.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            if not self._poll(deadline):
                raise AssertionError(f"instance did not answer {msg[0]!r} (alive: {self.proc.is_alive()})")
            r = self.conn.recv()
            if r[0] == "finished":
                self.finished.update(r[1])
                continue
            return tuple(r)

    def prefill(self, reqs: list[tuple[str, list[int]]], timeout: float = 120.0) -> dict[str, dict[str, Any]]:
        """Runs these requests' prefill; returns their kv_transfer_params."""
        self._call("add", reqs)
        deadline = time.monotonic() + timeout
        want = {r for r, _ in reqs}
        while not want <= set(self.finished):
            if not self._poll(deadline):
                raise AssertionError(f"prefill of {sorted(want - set(self.finished))} did not finish")
            r = self.conn.recv()
            assert r[0] == "finished", r
            self.finished.update(r[1])
        return {r: self.finished[r][1] for r in want}

    def wait_published(self, req_ids: set[str], timeout: float = 10.0) -> None:
        """Waits until every rank has published these requests (the prefill publishes
        one engine step after it returned their params): a decode that starts its pulls
        after this meets no miss, whatever the load on the machine."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            if all(req_ids <= set(pub) for pub in st["publishing_by_rank"]):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"prefill did not publish {sorted(req_ids)} on every rank: {st['publishing_by_rank']}")
            time.sleep(0.01)

    def faults(self, send_delay_us: int) -> None:
        """Delays every rank's sends by this much per chunk."""
        self._call("faults", send_delay_us)

    def state(self) -> dict[str, Any]:
        """``held`` (request ids the scheduler holds), ``free``/``free_at_start``
        (blocks), ``finished_sending`` (rid -> when, on the instance's monotonic clock
        ``now``), ``leaks`` (:meth:`Instance.leaks`), ``released`` (per rank, by
        reason), ``publishing`` (request ids published on any rank) and
        ``publishing_by_rank``."""
        return dict(self._call("state")[1])

    def corrupt(self, sends: int) -> None:
        """Corrupts the next ``sends`` sends of every rank."""
        self._call("corrupt", sends)

    def hold_after_finish(self, seconds: float) -> None:
        """The next step that finishes requests is followed by a pause of ``seconds``:
        their blocks are published that much later."""
        self._call("hold_after_finish", seconds)

    def device_fault(self, fault: str, trigger: str = "next") -> None:
        """Arms a sim device fault in every rank's engine (``device="sim"``)."""
        self._call("device_fault", fault, trigger)

    def device_release(self) -> None:
        """Releases every sim device copy held back by a fault."""
        self._call("device_release")

    def device_stats(self) -> dict[str, Any]:
        """Rank 0's device stats."""
        return dict(self._call("device_stats")[1])

    def leaks(self) -> list[str]:
        """:func:`scheduler_leaks` of the instance's scheduler (without a step)."""
        return list(self._call("leaks")[1])

    def block_refs(self) -> dict[str, list[int]]:
        """Per request the scheduler holds blocks for: their ref counts (group 0)."""
        return dict(self._call("blocks")[1])

    def wait_freed(self, req_ids: set[str], timeout: float) -> dict[str, Any]:
        """Waits until the instance freed these requests' blocks; returns its state."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            if not req_ids & set(st["held"]):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"still held: {sorted(req_ids & set(st['held']))}; state {st}")
            time.sleep(0.02)

    def kill(self) -> int | None:
        """SIGKILL, as a crashed or OOM-killed worker; returns the exit code (-9)."""
        self.proc.kill()
        self.proc.join(10)
        return self.proc.exitcode

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self._call("stop", timeout=30)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()
