"""The connector's request ledger: every request's life on each side of one worker,
and every rule about it, without I/O.

Semantics
---------
:class:`RequestLedger` is pure: it starts no transfer, reads no clock and calls no
engine. Each method takes the current (monotonic) time as ``now`` — and the wall
clock as ``wall`` where a lease's advertised end matters — and either records what the
I/O layer observed or returns what the I/O layer must do now: start a get, cancel
one, send a release, report a request finished or failed, report load errors. The
worker (``worker.py``) keeps only its transfers, scratch memory and vLLM glue; the
property tests (``tests/vllm/test_request_ledger.py``) drive this module with made-up
instants and transfer outcomes.

**Decode side: pulls.** A pull (:class:`PullRecord`, one per request the worker pulls)
is in exactly one state:

- ``pulling``: its get (or :class:`~.reads.RankReads`) is in flight;
- ``waiting``: a plain pull's get missed (the prefill publishes a step after it
  answered) and is retried at ``retry_at`` — never past ``retry_until``, the lease's
  advertised end, nor with less than :data:`MIN_GET` left before the deadline (then
  the miss is final);
- ``failed``: it failed (an error, a final miss, the deadline's backstop), and a copy
  may still write its blocks: it is reported only once its transfer drained;
- ``aborted``: vLLM finished the request while it pulled; its blocks are handed back
  (``finished_recving``) once the transfer drained, never before.

A pull of a request vLLM takes its blocks back from while it pulls (preempted, or the
worker going to sleep: :meth:`RequestLedger.preempt`) is ``failed`` at once, its
transfer cancelled and its unread slots released; the worker waits (bounded) for the
drain before vLLM may reuse the blocks, and it is reported as a failed load.

A pull leaves the ledger when it is reported (:meth:`RequestLedger.poll`'s ``ready``,
then :meth:`RequestLedger.report`), exactly once: ``finished_recving``, with
``failed_recving`` and its blocks as load errors if it failed. Blocks go back to vLLM
only once nothing can write them — the transfer drained, or none was started.

**Which keys a release carries.** The prefill frees a slot on the reader's ``Done``
(its get landed), on a ``Release`` naming it, or at the lease's end. The decode
releases every slot it will not read — the unread slots a pull's transfer reports —
once, when the pull is given up (failed or aborted, whichever comes first) unless the
prefill restarted (its new incarnation holds none of them). Slots a plan never reads
are released when the pull starts. Releases are collected per prefill address and
incarnation during a step and sent as messages of at most ``max_keys`` keys
(:meth:`RequestLedger.flush_releases`): the engine refuses larger ones whole.

**Prefill side: publications.** A request finished on the prefill is ``computing``
(on a CUDA cache, until the step that wrote its blocks completed: published then, or
given up past ``give_up_at``), then ``published`` under its reader-slot keys, then
``released`` once every slot was released (each reader's ``Done``, the decode's
releases, lease expiry, shutdown) — each slot counted once, a second report of the
same key ignored. A publication whose blocks vLLM takes back (preempted, sleep:
:meth:`RequestLedger.preempt_publication`) has every slot withdrawn at once (still
counted as each is reported released, once its sends stopped), and one still
computing is given up unpublished. It is reported ``finished_sending`` — its blocks vLLM's again — once
it is released *and* vLLM said it finished, exactly once.

Cancellation
------------
Nothing here waits or cancels: :meth:`RequestLedger.poll` and
:meth:`RequestLedger.abort` say which transfers to cancel (asked, not awaited), and a
pull stays until its transfer reports drained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ... import errors

__all__ = ["MAX_KEYS", "PullRecord", "PubRecord", "Seen", "ReleaseMsg", "Polled", "RequestLedger"]

MAX_KEYS = 4096
"""The most keys one ``release_remote`` may carry (the engine's ``max_keys``)."""

MIN_GET = 0.010
"""A missed get is retried only while at least this long is left before the deadline;
then the miss is final (a get launched with less would time out instead)."""

BACKSTOP = 1.0
"""Seconds past a pull's deadline after which the ledger cancels it itself (kvferry
enforces the deadline; this is the backstop)."""

# The reason a request's publication reports once all its slots are released: the most
# telling of its slots' (a lease that ran out first, then a read, then the rest).
_REASON_RANK = {"expired": 0, "done": 1, "declined": 2, "released": 3, "shutdown": 4, "preempted": 5}


@dataclass
class PullRecord:
    """One pull's lifecycle (the worker's :class:`~.worker._Pull` adds its I/O)."""

    req_id: str
    deadline: float = 0.0  # monotonic: a load error after this
    retry_until: float = 0.0  # monotonic: misses of a plain pull retried until then
    expires_at: float | None = None  # wall clock: the lease's advertised end
    started: float = 0.0
    retries_misses: bool = False  # a plain get: its misses are the ledger's to retry
    load_blocks: list[int] = field(default_factory=list)
    state: str = "pulling"
    retry_at: float | None = None
    attempts: int = 0
    error: BaseException | None = None
    undrained_since: float | None = None  # failed, destination not yet quiet
    given_up: bool = False  # its unread slots were released (once)


@dataclass(frozen=True)
class Seen:
    """What the I/O layer observed of a pull's transfer."""

    started: bool  # a transfer exists
    done: bool = False
    error: BaseException | None = None
    drained: bool = True  # nothing writes the destination blocks any more
    unread: tuple[tuple[str, int | None, str], ...] = ()  # (address, incarnation, key) not landed


@dataclass
class PubRecord:
    """One prefill request's publication."""

    req_id: str
    state: str = "computing"
    block_ids: list[int] = field(default_factory=list)
    give_up_at: float = 0.0
    slots_left: int = 0
    reason: str | None = None
    finished_seen: bool = False


@dataclass(frozen=True)
class ReleaseMsg:
    """One ``release_remote``: at most ``max_keys`` keys to one prefill rank."""

    address: str
    incarnation: int | None
    keys: tuple[str, ...]
    expires_at: float | None  # the latest advertised lease end of its keys (None: unknown)


@dataclass
class Polled:
    """What one :meth:`RequestLedger.poll` asks of the I/O layer."""

    launch: list[PullRecord] = field(default_factory=list)  # start (again) their gets
    cancel: list[PullRecord] = field(default_factory=list)  # cancel, not awaited
    ready: list[PullRecord] = field(default_factory=list)  # drained: land (if ok) and report()
    undrained: list[PullRecord] = field(default_factory=list)  # just failed, not yet drained


class RequestLedger:
    """Every request of one worker, both sides (module docs)."""

    def __init__(self, *, timeout: float, max_keys: int = MAX_KEYS) -> None:
        self.timeout = timeout
        self.max_keys = max(1, int(max_keys))
        self.pulls: dict[str, PullRecord] = {}
        self.pubs: dict[str, PubRecord] = {}
        self.slot_owner: dict[str, str] = {}  # published slot key -> request
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.load_errors: set[int] = set()
        self._batch: dict[tuple[str, int | None], tuple[list[float | None], dict[str, None]]] = {}

    # -- decode: pulls -------------------------------------------------------------

    def start_pull(self, rec: PullRecord, now: float, wall: float) -> PullRecord:
        """Records a new pull: its deadline (``timeout`` from now) and how long its
        misses are retried (until the lease's advertised end, never past the
        deadline: the prefill publishes one step after it answered)."""
        rec.started = now
        rec.deadline = now + self.timeout
        exp = rec.expires_at
        rec.retry_until = rec.deadline if exp is None else min(rec.deadline, now + max(0.0, exp - wall))
        rec.state = "pulling"
        self.pulls[rec.req_id] = rec
        return rec

    def launched(self, rec: PullRecord) -> None:
        rec.attempts += 1
        rec.retry_at = None
        rec.state = "pulling"

    def fail(self, rec: PullRecord, error: BaseException) -> None:
        """The pull failed before or while starting (bad params, a launch refused)."""
        if rec.error is None:
            rec.error = error
        if rec.state != "aborted":
            rec.state = "failed"

    def abort(self, req_id: str, seen: Seen, now: float) -> tuple[PullRecord | None, bool]:
        """vLLM finished ``req_id`` (aborted it) while it pulled: ``(record, cancel)``;
        ``cancel`` says the transfer is to be cancelled (asked, not awaited). Its
        unread slots are released unless its bytes landed or the prefill restarted
        (once: a pull already given up releases nothing more). None: not a pull."""
        rec = self.pulls.get(req_id)
        if rec is None or rec.state == "aborted":
            return None, False
        landed = seen.started and seen.done and seen.error is None
        if not landed:
            self._give_up(rec, seen)
        rec.state = "aborted"
        return rec, seen.started and not seen.done

    def preempt(self, req_id: str, seen: Seen) -> tuple[PullRecord | None, bool]:
        """vLLM takes ``req_id``'s blocks back while it pulls (preempted, or the worker
        goes to sleep): ``(record, cancel)`` as :meth:`abort`, but the pull is failed —
        reported, once drained, as a load error (``finished_recving`` with
        ``failed_recving``), whether or not its bytes landed, since the blocks are no
        longer the request's. Its unread slots are released (once). None: not a pull
        (or already aborted: its blocks come back when it drains, as before)."""
        rec = self.pulls.get(req_id)
        if rec is None or rec.state == "aborted":
            return None, False
        landed = seen.started and seen.done and seen.error is None
        if not landed:
            self._give_up(rec, seen)
        rec.given_up = True  # landed: its reads sent Done; nothing left to release
        if rec.error is None:
            rec.error = errors.CancelledError(f"{req_id}: its blocks were taken back by vLLM (preempted or asleep)")
        rec.state = "failed"
        rec.retry_at = None
        return rec, seen.started and not seen.done

    def preempt_publication(self, req_id: str) -> list[str]:
        """vLLM takes ``req_id``'s published blocks back: the slot keys to withdraw now
        (the worker unpublishes them and waits, bounded, until the engine reports each
        released — its sends stopped). One still computing (CUDA) is given up
        unpublished. Slots are then counted as before (:meth:`slot_released`)."""
        rec = self.pubs.get(req_id)
        if rec is None:
            return []
        if rec.state == "computing":
            rec.state = "released"
            rec.reason = "preempted"
            return []
        if rec.state != "published":
            return []
        return [k for k, owner in self.slot_owner.items() if owner == req_id]

    def poll(self, now: float, seen_of: Any) -> Polled:
        """One step over every pull: ``seen_of(record)`` returns its :class:`Seen`.
        Aborted pulls are ready once drained; waiting ones relaunched when due; a pull
        past its deadline plus :data:`BACKSTOP` cancelled and failed; a failed pull is
        ready (to be reported) only once its transfer drained."""
        out = Polled()
        for rec in list(self.pulls.values()):
            seen: Seen = seen_of(rec)
            if rec.state == "aborted":
                if not seen.started or seen.drained:
                    out.ready.append(rec)
                continue
            if rec.state == "waiting":
                if rec.retry_at is not None and now < rec.retry_at:
                    continue
                if rec.deadline - now >= MIN_GET:
                    out.launch.append(rec)
                    continue
                # Too little time left for another get: the miss is final.
                self.fail(rec, seen.error or errors.NotFoundError(f"{rec.req_id} not published before its deadline"))
            if rec.state == "pulling":
                if not seen.started:
                    continue  # launched by the I/O layer at the end of its step
                if not seen.done:
                    if now < rec.deadline + BACKSTOP:
                        continue
                    out.cancel.append(rec)
                    self.fail(rec, errors.TimeoutError(f"pull of {rec.req_id} did not finish within {self.timeout}s"))
                elif seen.error is None:
                    pass  # landed: ready once drained
                elif isinstance(seen.error, errors.NotFoundError) and rec.retries_misses and now < rec.retry_until:
                    rec.state = "waiting"
                    rec.retry_at = min(rec.retry_until, now + min(0.05, 0.002 * 2 ** min(rec.attempts, 5)))
                    continue
                else:
                    self.fail(rec, seen.error)
            if seen.started and not seen.drained:
                if rec.error is not None and rec.undrained_since is None:
                    rec.undrained_since = now
                    out.undrained.append(rec)
                continue
            out.ready.append(rec)
        return out

    def report(self, rec: PullRecord, seen: Seen, error: BaseException | None = None) -> None:
        """A ready pull is reported to vLLM (once): ``finished_recving``, and if it
        failed (``error``: a landing that failed after the transfer) ``failed_recving``
        with its blocks as load errors; a failed pull's unread slots are released."""
        if self.pulls.pop(rec.req_id, None) is None:
            return
        self.finished_recving.add(rec.req_id)
        if rec.state == "aborted":
            return
        if error is not None and rec.error is None:
            rec.error = error
        if rec.error is not None:
            self.failed_recving.add(rec.req_id)
            self.load_errors.update(rec.load_blocks)
            self._give_up(rec, seen)

    def _give_up(self, rec: PullRecord, seen: Seen) -> None:
        if rec.given_up:
            return
        rec.given_up = True
        if isinstance(rec.error, errors.PeerRestartedError) or isinstance(seen.error, errors.PeerRestartedError):
            return  # a restarted prefill no longer holds them
        for address, inc, key in seen.unread:
            self.release(address, [key], rec.expires_at, inc)

    # -- releases ------------------------------------------------------------------

    def release(self, address: str | None, keys: list[str], expires_at: float | None, incarnation: int | None = None) -> None:
        """Queues ``keys`` (slots of prefill rank ``address``) for this step's release."""
        if not address or not keys:
            return
        entry = self._batch.setdefault((str(address), incarnation), ([], {}))
        entry[0].append(expires_at)
        entry[1].update(dict.fromkeys(keys))  # a key once, in order

    def flush_releases(self) -> list[ReleaseMsg]:
        """This step's releases: per prefill rank, messages of at most ``max_keys``
        keys, each retried (on a miss) until the latest lease end its keys advertised."""
        out: list[ReleaseMsg] = []
        batch, self._batch = self._batch, {}
        for (address, inc), (expiries, queued) in batch.items():
            keys = list(queued)
            exp = None if any(e is None for e in expiries) else max(e for e in expiries if e is not None)
            for i in range(0, len(keys), self.max_keys):
                out.append(ReleaseMsg(address, inc, tuple(keys[i : i + self.max_keys]), exp))
        return out

    # -- prefill: publications -----------------------------------------------------

    def computing(self, req_id: str, block_ids: list[int], give_up_at: float) -> None:
        """A finished prefill whose blocks are published once computed (CUDA)."""
        self.pubs.setdefault(req_id, PubRecord(req_id, "computing", list(block_ids), give_up_at))

    def computed(self, now: float, done: bool) -> tuple[list[PubRecord], list[PubRecord]]:
        """``(publish now, given up)`` among those computing: all of them to publish
        once the step completed; past ``give_up_at`` otherwise, given up (released
        unpublished: the decode gets a miss)."""
        go: list[PubRecord] = []
        lost: list[PubRecord] = []
        for rec in list(self.pubs.values()):
            if rec.state != "computing":
                continue
            if done:
                go.append(rec)
            elif now > rec.give_up_at:
                rec.state = "released"
                lost.append(rec)
        return go, lost

    def published(self, req_id: str, keys: list[str]) -> None:
        """``req_id`` is published under ``keys`` (its reader slots; none: publishing
        failed and nothing pins its blocks)."""
        rec = self.pubs.setdefault(req_id, PubRecord(req_id))
        if not keys:
            rec.state = "released"
            return
        rec.state = "published"
        rec.slots_left = len(keys)
        for k in keys:
            self.slot_owner[k] = req_id

    def slot_released(self, key: str, reason: str) -> tuple[str, str] | None:
        """A slot's publication was released: ``(request, reason)`` once it was the
        request's last (the most telling reason of its slots'); None otherwise, and
        for a slot reported twice or never published by this ledger."""
        req_id = self.slot_owner.pop(key, None)
        rec = self.pubs.get(req_id) if req_id is not None else None
        if rec is None or rec.state != "published":
            return None
        if rec.reason is None or _REASON_RANK.get(reason, 9) < _REASON_RANK.get(rec.reason, 9):
            rec.reason = reason
        rec.slots_left -= 1
        if rec.slots_left > 0:
            return None
        rec.state = "released"
        return rec.req_id, rec.reason

    def finished(self, req_id: str) -> None:
        """vLLM reported ``req_id`` finished to this worker."""
        rec = self.pubs.get(req_id)
        if rec is not None:
            rec.finished_seen = True

    def finished_sending(self) -> set[str]:
        """Publications released and seen finished: their blocks are vLLM's again
        (each reported once)."""
        done = {r for r, rec in self.pubs.items() if rec.state == "released" and rec.finished_seen}
        for r in done:
            del self.pubs[r]
        return done

    def sending(self) -> set[str]:
        """Requests published and not yet released."""
        return {r for r, rec in self.pubs.items() if rec.state == "published"}

    # -- per step ------------------------------------------------------------------

    def take_recving(self) -> tuple[set[str], set[str]]:
        """``(finished_recving, failed_recving)`` reported since the last call."""
        out = (self.finished_recving, self.failed_recving)
        self.finished_recving, self.failed_recving = set(), set()
        return out

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def holds(self) -> dict[str, int]:
        """Counts of what the ledger still holds, by kind (all 0 when quiet)."""
        return {
            "pulls": len(self.pulls),
            "publications": len(self.pubs),
            "slots": len(self.slot_owner),
            "releases_queued": sum(len(k) for _, k in self._batch.values()),
        }
