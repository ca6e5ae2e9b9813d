"""The kvferry transfer channel (``BaseTransferChannel`` of LMCache 0.5.6), two channels
over real kvferry engines and real sockets in this process, each over a paged buffer
as LMCache's P2P/PD backends hand it (``buffer_ptr``, ``buffer_size``, ``align_bytes``)
with LMCache's own ``TensorMemoryObj`` pages.

Bytes: a write and a read move exactly the pages named. Then the background case's
four cancel tests (``shared/background/host-staging-cancel-drain.txt``), written
against this channel: the "copies" are kvferry transfers slowed by the sender's fault
hook (``send_delay_us``), and at the same instant each test checks "the call has not
returned" and "a transfer still holds the buffer" (``Region.users``), across a window;
when the call returns, nothing holds the buffer any more.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("need_lmcache")

PAGE = 64 << 10
PAGES = 32


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Side:
    """A paged buffer (a torch uint8 tensor), its LMCache memory objects, a channel."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        import torch
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        from kvferry.integrations.lmcache import KvferryTransferChannel

        self.buf = torch.zeros(PAGES * PAGE, dtype=torch.uint8)
        self.url = f"127.0.0.1:{_port()}"
        self.ch = KvferryTransferChannel(
            async_mode=True,
            role="both",
            buffer_ptr=self.buf.data_ptr(),
            buffer_size=self.buf.numel(),
            align_bytes=PAGE,
            tp_rank=0,
            peer_init_url=self.url,
            peer_lookup_url=f"127.0.0.1:{_port()}",
            event_loop=loop,
            kvferry_timeout=10.0,
            # The socket: the tests below slow down and corrupt its sends.
            kvferry_transport="tcp",
        )
        self.objs = []
        for i in range(PAGES):
            raw = self.buf[i * PAGE : (i + 1) * PAGE]
            meta = MemoryObjMetadata(shape=torch.Size([PAGE]), dtype=torch.uint8, address=i, phy_size=PAGE, ref_count=1, pin_count=0, fmt=MemoryFormat.BINARY_BUFFER)
            self.objs.append(TensorMemoryObj(raw, meta, None))
        self.name = name

    def fill(self, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.buf.copy_(torch.randint(0, 256, (PAGES * PAGE,), generator=g, dtype=torch.uint8))

    def page(self, i: int) -> Any:
        return self.buf[i * PAGE : (i + 1) * PAGE]

    @property
    def users(self) -> int:
        return int(self.ch.region.users)


@pytest.fixture
def pair() -> Any:
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    a, b = Side("a", loop), Side("b", loop)
    a.ch.lazy_init_peer_connection(a.url, b.url, b.url)
    b.ch.lazy_init_peer_connection(b.url, a.url, a.url)
    yield a, b, loop
    for s in (a, b):
        s.ch.close()
    loop.call_soon_threadsafe(loop.stop)
    th.join(5)


def _run(loop: asyncio.AbstractEventLoop, coro: Any, timeout: float = 30.0) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def test_write_and_read_move_exactly_the_pages_named(pair):
    import torch

    a, b, loop = pair
    a.fill(1)
    b.fill(2)
    before_b = b.buf.clone()
    n = _run(loop, a.ch.async_batched_write([a.objs[i] for i in (0, 5, 7)], {"receiver_id": b.url, "remote_indexes": [3, 4, 30]}))
    assert n == 3
    assert torch.equal(b.page(3), a.page(0)) and torch.equal(b.page(4), a.page(5)) and torch.equal(b.page(30), a.page(7))
    untouched = [i for i in range(PAGES) if i not in (3, 4, 30)]
    assert all(torch.equal(b.page(i), before_b[i * PAGE : (i + 1) * PAGE]) for i in untouched)
    n = _run(loop, a.ch.async_batched_read([a.objs[i] for i in (10, 11)], {"sender_id": b.url, "remote_indexes": [20, 21]}))
    assert n == 2
    assert torch.equal(a.page(10), b.page(20)) and torch.equal(a.page(11), b.page(21))
    # sync forms (PD backend's worker thread)
    n = b.ch.batched_write([b.objs[1]], {"receiver_id": a.url, "remote_indexes": [31]})
    assert n == 1 and torch.equal(a.page(31), b.page(1))
    assert a.users == 0 and b.users == 0


class Call:
    """A channel call as an asyncio task on the channel's loop, watched from here."""

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Any) -> None:
        self.loop = loop

        async def make() -> Any:
            return asyncio.ensure_future(coro)

        self.task = asyncio.run_coroutine_threadsafe(make(), loop).result(5)

    def cancel(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)

    def done(self) -> bool:
        return self.task.done()

    def outcome(self, timeout: float = 30.0) -> Any:
        async def wait() -> Any:
            try:
                return ("ok", await self.task)
            except BaseException as e:  # noqa: BLE001 - the outcome is the point
                return ("err", e)

        return asyncio.run_coroutine_threadsafe(wait(), self.loop).result(timeout)


def _started(side: Side, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while side.users == 0:  # a transfer holds the buffer
        assert time.monotonic() < deadline, "the transfers never started"
        time.sleep(0.001)


def _watch(call: Call, side: Side, cancels_at: list[float]) -> int:
    """Cancels ``call`` at each time in ``cancels_at`` (seconds from now); until it is
    done, checks at the same instant "not returned" and "a transfer holds the
    buffer", and counts such samples. When it returned, nothing may hold the buffer."""
    t0 = time.monotonic()
    pending = list(cancels_at)
    held_while_running = 0
    while True:
        now = time.monotonic() - t0
        if pending and now >= pending[0]:
            pending.pop(0)
            call.cancel()
        done = call.done()
        users = side.users  # read after done: once it returned, nothing may hold the buffer
        if done:
            assert users == 0, f"the call returned while {users} transfer(s) still held the buffer"
            break
        if users > 0:
            held_while_running += 1
        assert now < 30, "the cancelled call never returned"
        time.sleep(0.002)
    return held_while_running


def _read_all(a: Side, b: Side, n: int = 16) -> Any:
    return a.ch.async_batched_read(a.objs[:n], {"sender_id": b.url, "remote_indexes": list(range(n))})


def test_cancel_waits_for_inflight_transfers(pair):
    a, b, loop = pair
    b.fill(3)
    b.ch.engine._e._inject_faults(send_delay_us=150_000)  # each page takes 150 ms to leave b
    call = Call(loop, _read_all(a, b))
    _started(a)
    held = _watch(call, a, [0.0])
    kind, err = call.outcome()
    assert kind == "err" and isinstance(err, asyncio.CancelledError)
    assert held > 0, "never saw the call pending while its transfers ran"


def test_repeated_cancel_still_drains(pair):
    import torch

    a, b, loop = pair
    b.ch.engine._e._inject_faults(send_delay_us=150_000)
    call = Call(loop, _read_all(a, b))
    _started(a)
    # three cancels, 40 ms apart: a single shielded await would resume at the second
    held = _watch(call, a, [0.0, 0.04, 0.08])
    kind, err = call.outcome()
    assert kind == "err" and isinstance(err, asyncio.CancelledError)
    assert held > 0
    # the buffer is usable at once: a fresh read lands the right bytes
    b.ch.engine._e._inject_faults(send_delay_us=0)
    b.fill(4)
    assert _run(loop, _read_all(a, b, 4)) == 4
    assert all(torch.equal(a.page(i), b.page(i)) for i in range(4))


def test_error_in_one_piece_drains_siblings(pair):
    import kvferry

    a, b, loop = pair
    b.fill(5)
    # the first page sent is corrupted on the wire (a checksum error in one piece)
    # while the other pieces' pages still trickle out of b
    b.ch.engine._e._inject_faults(send_delay_us=100_000, corrupt_next_sends=1)
    call = Call(loop, _read_all(a, b))
    held = _watch(call, a, [])
    kind, err = call.outcome()
    assert kind == "err" and isinstance(err, kvferry.Error), err
    assert held > 0


def test_cancelled_write_releases_its_pages(pair):
    import torch

    a, b, loop = pair
    a.fill(6)
    a.ch.engine._e._inject_faults(send_delay_us=150_000)  # a's pages leave slowly
    call = Call(loop, a.ch.async_batched_write(a.objs[:12], {"receiver_id": b.url, "remote_indexes": list(range(12))}))
    _started(b)  # b's pull is under way
    held = _watch(call, a, [0.05])
    kind, err = call.outcome()
    assert kind == "err" and isinstance(err, asyncio.CancelledError)
    assert held > 0
    # every page a published for the cancelled write came back: nothing holds a's
    # buffer (checked by _watch at the instant it returned)
    # and the pages are reusable: a new write of the same pages arrives intact
    a.ch.engine._e._inject_faults(send_delay_us=0)
    deadline = time.monotonic() + 15
    while b.users > 0:  # b's pull, now failing, finishes on its side
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _run(loop, a.ch.async_batched_write(a.objs[:2], {"receiver_id": b.url, "remote_indexes": [20, 21]})) == 2
    assert torch.equal(b.page(20), a.page(0)) and torch.equal(b.page(21), a.page(1))


def test_install_makes_kvferry_a_channel_type():
    import lmcache.v1.storage_backend.p2p_backend as p2p
    import lmcache.v1.storage_backend.pd_backend as pd
    import lmcache.v1.transfer_channel as tc

    from kvferry.integrations.lmcache import KvferryTransferChannel, install

    install()
    install()  # idempotent
    assert p2p.CreateTransferChannel is tc.CreateTransferChannel is pd.CreateTransferChannel
    import torch

    buf = torch.zeros(4 * PAGE, dtype=torch.uint8)
    ch = tc.CreateTransferChannel("kvferry", True, "both", buf.data_ptr(), buf.numel(), PAGE, 0, f"127.0.0.1:{_port()}", event_loop=None)
    try:
        assert isinstance(ch, KvferryTransferChannel)
    finally:
        ch.close()


def test_a_peer_that_only_serves_reads_keeps_no_release_reports_beyond_its_last_batch(pair):
    """Issue 41, defect 4: every page a peer serves to a reader (``op: publish``) adds
    a release report, which only a write of its own used to drain; a peer that only
    serves reads piled them up without bound (the engine's queue, the binding's map of
    published keys: 12 batches of 16 pages left 192). Now each batch it serves drops
    the reports of the ones before: at most one batch's are pending."""
    a, b, loop = pair
    a.fill(3)
    rounds, n = 12, 16
    for _ in range(rounds):
        assert _run(loop, b.ch.async_batched_read(b.objs[:n], {"sender_id": a.url, "remote_indexes": list(range(n))})) == n
    time.sleep(0.2)  # the last batch's Done reach the serving peer
    pending = a.ch.engine.released()  # read once: what the serving peer still holds
    assert len(pending) <= n, len(pending)
