"""The connector's request ledger (``kvferry.integrations.vllm.ledger``), property-tested
against a model: random interleavings of vLLM's calls (new pulls, aborts, finished
requests, steps), transfer outcomes (landed, missed, failed drained or not, the prefill
restarted, a device copy stuck then drained), publications and their slot releases
(reads' ``Done``, releases, expiry, reported twice), CUDA publications waiting for
their step, and clock steps. The driver plays the worker's I/O exactly as
``worker.py`` does (launch, cancel, land, report, flush releases) over simulated
transfers; a simulated prefill tracks every slot. Checked after every step:

- a pull's blocks go back to vLLM (``finished_recving``) only once nothing can write
  them (its transfer drained, or none was started), and once per request;
- every slot of a pull given up (failed, aborted) that its reader did not land is
  named by exactly one release — none twice, none forgotten (unless the prefill
  restarted) — in messages of at most ``max_keys`` keys;
- a publication is reported ``finished_sending`` once, only after every slot was
  released and vLLM reported it finished; every slot is counted once;
- a pull preempted (vLLM takes its blocks back) is reported as a failed load, once,
  only once drained, and its unread slots are released; a publication preempted
  withdraws exactly the slots still out (one still computing is given up unpublished);
- at quiescence (every transfer settled, the clock past every deadline) the ledger
  holds nothing and every request was reported exactly once.

Needs no vLLM: the ledger imports none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

from kvferry import errors  # noqa: E402
from kvferry.integrations.vllm.ledger import PullRecord, RequestLedger, Seen  # noqa: E402

TIMEOUT = 10.0
MAX_KEYS = 3  # small, so a step's releases are cut into several messages


@dataclass
class SimTransfer:
    keys: list[tuple[str, str]]
    done: bool = False
    error: BaseException | None = None
    drained: bool = True
    stuck: bool = False  # a device copy that outlives the transfer until drain()
    landed: set[tuple[str, str]] = field(default_factory=set)


@dataclass
class SimPull:
    rec: PullRecord
    keys: list[tuple[str, str]]
    plain: bool
    transfer: SimTransfer | None = None
    restarted: bool = False


class LedgerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 100.0
        self.wall = 1_000_000.0
        self.led = RequestLedger(timeout=TIMEOUT, max_keys=MAX_KEYS)
        self.pulls: dict[str, SimPull] = {}
        self.n = 0
        self.reported: dict[str, int] = {}
        self.held: set[tuple[str, str]] = set()  # slots the prefill still holds
        self.done_keys: set[tuple[str, str]] = set()
        self.released_keys: list[tuple[str, str]] = []  # by the decode's messages
        self.pubs: dict[str, list[str]] = {}  # prefill side: request -> slot keys
        self.slot_out: dict[str, set[str]] = {}
        self.finished_seen: set[str] = set()
        self.sent_reported: dict[str, int] = {}
        self.computing: set[str] = set()
        self.preempted: set[str] = set()

    # -- the simulated I/O (as worker.py) ------------------------------------------

    def seen(self, rec: PullRecord, unread: bool = False) -> Seen:
        sp = self.pulls[rec.req_id]
        t = sp.transfer
        ks: tuple[tuple[str, int | None, str], ...] = ()
        if unread:
            landed = t.landed if t is not None else set()
            ks = tuple((a, None, k) for a, k in sp.keys if (a, k) not in landed)
        if t is None:
            return Seen(False, unread=ks)
        return Seen(True, t.done, t.error if t.done else None, t.drained, ks)

    def launch(self, sp: SimPull) -> None:
        self.led.launched(sp.rec)
        sp.transfer = SimTransfer(list(sp.keys))

    def cancel(self, t: SimTransfer) -> None:
        if not t.done:
            t.done, t.error = True, errors.CancelledError("cancelled")
            t.drained = not t.stuck

    def flush(self) -> None:
        for msg in self.led.flush_releases():
            assert 1 <= len(msg.keys) <= MAX_KEYS, msg
            for k in msg.keys:
                key = (msg.address, k)
                assert key not in self.released_keys, f"{key} released twice"
                self.released_keys.append(key)
                self.held.discard(key)

    def step(self) -> None:
        """One worker step (transfer_results)."""
        polled = self.led.poll(self.now, self.seen)
        for rec in polled.cancel:
            t = self.pulls[rec.req_id].transfer
            assert t is not None
            self.cancel(t)
        for rec in polled.launch:
            self.launch(self.pulls[rec.req_id])
        for rec in polled.ready:
            sp = self.pulls[rec.req_id]
            t = sp.transfer
            assert t is None or t.drained, f"{rec.req_id} handed back while its transfer may write"
            self.led.report(rec, self.seen(rec, unread=True))
        self.flush()
        recv, failed = self.led.take_recving()
        assert failed <= recv
        for r in recv:
            self.reported[r] = self.reported.get(r, 0) + 1
            assert self.reported[r] == 1, f"{r} reported twice"
            sp = self.pulls[r]
            assert sp.transfer is None or sp.transfer.drained
            if r in self.preempted:
                assert r in failed, f"{r} preempted but reported as landed"
            given_up = r in failed or sp.rec.state == "aborted"
            if given_up and not sp.restarted:
                landed = sp.transfer.landed if sp.transfer is not None else set()
                for key in sp.keys:
                    assert key in landed or key in self.released_keys, f"{key} of {r} neither read nor released"
        for r in self.led.finished_sending():
            self.sent_reported[r] = self.sent_reported.get(r, 0) + 1
            assert self.sent_reported[r] == 1, f"{r} finished_sending twice"
            assert not self.slot_out.get(r), f"{r} reported with slots out"
            assert r in self.finished_seen

    def live(self) -> list[SimPull]:
        return [sp for r, sp in self.pulls.items() if r in self.led.pulls]

    def in_flight(self) -> list[SimPull]:
        return [sp for sp in self.live() if sp.transfer is not None and not sp.transfer.done]

    # -- vLLM's calls --------------------------------------------------------------

    @rule(plain=st.booleans(), nkeys=st.integers(1, 4), start_fails=st.booleans(), lease=st.floats(0.0, 30.0))
    def new_pull(self, plain: bool, nkeys: int, start_fails: bool, lease: float) -> None:
        self.n += 1
        r = f"r{self.n}"
        keys = [("p0", r)] if plain else [(f"p{i % 2}", f"{r}/{i}") for i in range(nkeys)]
        self.held |= set(keys)
        rec = PullRecord(req_id=r, expires_at=self.wall + lease, retries_misses=plain, load_blocks=[self.n * 10, self.n * 10 + 1])
        sp = SimPull(rec, keys, plain)
        self.pulls[r] = sp
        self.led.start_pull(rec, self.now, self.wall)
        if start_fails:
            self.led.fail(rec, errors.InvalidArgumentError("refused at start"))
        else:
            self.launch(sp)
        self.flush()

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        sp = data.draw(st.sampled_from(self.live()))
        rec, cancel = self.led.abort(sp.rec.req_id, self.seen(sp.rec, unread=True), self.now)
        if rec is not None:
            self.preempted.discard(rec.req_id)  # finished after all: reported as aborted
        if cancel:
            assert sp.transfer is not None
            self.cancel(sp.transfer)
        self.flush()

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        sp = data.draw(st.sampled_from(self.live()))
        was_aborted = sp.rec.state == "aborted"
        rec, cancel = self.led.preempt(sp.rec.req_id, self.seen(sp.rec, unread=True))
        assert (rec is None) == was_aborted
        if rec is None:
            return
        self.preempted.add(rec.req_id)
        if cancel:
            assert sp.transfer is not None
            self.cancel(sp.transfer)
        self.flush()

    @precondition(lambda self: any(q in self.led.pubs for q in self.pubs))
    @rule(data=st.data())
    def preempt_publication(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(sorted(q for q in self.pubs if q in self.led.pubs)))
        keys = self.led.preempt_publication(r)
        if r in self.computing:
            assert keys == []
            self.computing.discard(r)
            self.slot_out[r] = set()
            return
        assert set(keys) == self.slot_out.get(r, set()), (r, keys, self.slot_out.get(r))

    @rule(dt=st.sampled_from([0.001, 0.01, 0.05, 0.5, 3.0, 12.0]))
    def clock(self, dt: float) -> None:
        self.now += dt
        self.wall += dt
        self.step()

    # -- transfer outcomes ----------------------------------------------------------

    @precondition(lambda self: self.in_flight())
    @rule(data=st.data(), kind=st.sampled_from(["land", "miss", "fail", "fail_undrained", "restarted", "stick"]))
    def outcome(self, data: st.DataObject, kind: str) -> None:
        sp = data.draw(st.sampled_from(self.in_flight()))
        t = sp.transfer
        assert t is not None
        if kind == "stick":
            t.stuck, t.drained = True, False
            return
        t.done = True
        if kind == "land":
            t.landed = set(t.keys)
            self.done_keys |= t.landed
            self.held -= t.landed
            t.drained = not t.stuck
            return
        if kind == "miss":
            t.error = errors.NotFoundError("not published yet")
            return
        if kind == "restarted":
            t.error, sp.restarted = errors.PeerRestartedError("restarted"), True
            self.held -= set(t.keys)  # the new incarnation holds none of them
            return
        # Some of a planned pull's reads landed before the failure (their Done sent).
        n = data.draw(st.integers(0, len(t.keys) - 1)) if len(t.keys) > 1 else 0
        t.landed = set(t.keys[:n])
        self.held -= t.landed
        t.error = errors.DeviceError("device copy failed") if kind == "fail_undrained" else errors.TimeoutError("timed out")
        t.drained = kind != "fail_undrained" and not t.stuck

    @precondition(lambda self: any(sp.transfer is not None and not sp.transfer.drained for sp in self.pulls.values()))
    @rule(data=st.data())
    def drain(self, data: st.DataObject) -> None:
        sp = data.draw(st.sampled_from([sp for sp in self.pulls.values() if sp.transfer is not None and not sp.transfer.drained]))
        assert sp.transfer is not None
        sp.transfer.drained, sp.transfer.stuck = True, False

    # -- the prefill side ------------------------------------------------------------

    @rule(nslots=st.integers(0, 3), cuda=st.booleans())
    def publish(self, nslots: int, cuda: bool) -> None:
        self.n += 1
        r = f"q{self.n}"
        keys = [r] + [f"{r}/{i}" for i in range(1, nslots)] if nslots else []
        self.pubs[r] = keys
        if cuda:
            self.led.computing(r, [1, 2], self.now + TIMEOUT)
            self.computing.add(r)
            return
        self.led.published(r, keys)
        self.slot_out[r] = set(keys)

    @rule(done=st.booleans())
    def gpu_step(self, done: bool) -> None:
        go, lost = self.led.computed(self.now, done)
        for rec in go:
            self.computing.discard(rec.req_id)
            self.led.published(rec.req_id, self.pubs[rec.req_id])
            self.slot_out[rec.req_id] = set(self.pubs[rec.req_id])
        for rec in lost:
            assert self.now > rec.give_up_at
            self.computing.discard(rec.req_id)
            self.slot_out[rec.req_id] = set()

    @precondition(lambda self: any(self.slot_out.values()))
    @rule(data=st.data(), reason=st.sampled_from(["done", "declined", "released", "expired", "shutdown"]), twice=st.booleans())
    def slot_released(self, data: st.DataObject, reason: str, twice: bool) -> None:
        r = data.draw(st.sampled_from(sorted(q for q, s in self.slot_out.items() if s)))
        k = data.draw(st.sampled_from(sorted(self.slot_out[r])))
        self.slot_out[r].discard(k)
        last = self.led.slot_released(k, reason)
        assert (last is not None) == (not self.slot_out[r]), (r, k, last)
        if twice:
            assert self.led.slot_released(k, reason) is None, "a slot counted twice"

    @precondition(lambda self: any(q not in self.finished_seen for q in self.pubs))
    @rule(data=st.data())
    def finished(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(sorted(q for q in self.pubs if q not in self.finished_seen)))
        self.finished_seen.add(r)
        self.led.finished(r)

    # -- checks ----------------------------------------------------------------------

    @invariant()
    def each_reported_once(self) -> None:
        assert all(n == 1 for n in self.reported.values())
        assert all(n == 1 for n in self.sent_reported.values())
        assert not set(self.reported) & set(self.led.pulls)

    def teardown(self) -> None:
        """Quiescence: every transfer settles, the clock passes every deadline, every
        slot is released and every request finished; then nothing is held."""
        for sp in self.pulls.values():
            t = sp.transfer
            if t is not None:
                t.stuck, t.drained = False, True
                if not t.done:
                    t.done, t.error = True, errors.TimeoutError("timed out")
        for _ in range(3):
            self.now += TIMEOUT + 2.0
            self.wall += TIMEOUT + 2.0
            self.step()
            for sp in self.pulls.values():
                if sp.transfer is not None:
                    sp.transfer.drained = True
                    if not sp.transfer.done:
                        sp.transfer.done, sp.transfer.error = True, errors.TimeoutError("timed out")
        assert not self.led.pulls, self.led.pulls
        assert set(self.reported) == set(self.pulls)
        self.gpu_step(False)
        for r, keys in list(self.slot_out.items()):
            for k in list(keys):
                keys.discard(k)
                self.led.slot_released(k, "expired")
        for r in self.pubs:
            if r not in self.finished_seen:
                self.finished_seen.add(r)
                self.led.finished(r)
        self.step()
        assert set(self.sent_reported) == set(self.pubs), set(self.pubs) - set(self.sent_reported)
        assert self.led.holds() == {"pulls": 0, "publications": 0, "slots": 0, "releases_queued": 0}, self.led.holds()


LedgerModel.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_request_ledger_against_its_model = LedgerModel.TestCase


def test_a_step_over_max_keys_is_cut_into_messages() -> None:
    """Issue 41, defect 1, at the ledger: 4,097 keys for one prefill rank in one step
    go as two messages (4,096 and 1), each key once."""
    led = RequestLedger(timeout=TIMEOUT)
    led.release("p0:1", [f"k{i}" for i in range(4000)], 10.0)
    led.release("p0:1", [f"k{i}" for i in range(3990, 4097)], 20.0)
    msgs = led.flush_releases()
    assert [len(m.keys) for m in msgs] == [4096, 1]
    assert {k for m in msgs for k in m.keys} == {f"k{i}" for i in range(4097)}
    assert all(m.expires_at == 20.0 for m in msgs)
    assert led.flush_releases() == []


def test_a_miss_with_no_time_left_is_final_not_relaunched() -> None:
    """A plain pull's retry falls due with less than ``MIN_GET`` before its deadline
    (a loaded step came late): the miss is final — reported as the miss it is, its key
    released — instead of a get launched with a millisecond left that would time out
    and be reported as a timeout (seen under load in the defect-2 test)."""
    from kvferry.integrations.vllm.ledger import MIN_GET

    led = RequestLedger(timeout=TIMEOUT)
    rec = led.start_pull(PullRecord(req_id="r", retries_misses=True, load_blocks=[7]), 0.0, 0.0)
    led.launched(rec)
    miss = Seen(True, True, errors.NotFoundError("not yet"), True, (("p0:1", None, "r"),))
    assert not led.poll(1.0, lambda _: miss).ready and rec.state == "waiting"
    polled = led.poll(TIMEOUT - MIN_GET / 2, lambda _: miss)
    assert not polled.launch and polled.ready == [rec]
    led.report(rec, miss)
    assert led.take_recving() == ({"r"}, {"r"}) and led.take_load_errors() == {7}
    assert isinstance(rec.error, errors.NotFoundError)
    assert [m.keys for m in led.flush_releases()] == [("r",)]
