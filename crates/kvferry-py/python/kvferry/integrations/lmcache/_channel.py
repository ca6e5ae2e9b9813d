# mypy: disable-error-code="import-untyped"
# mypy: allow-subclassing-any
# (lmcache ships no type information: its classes are Any here.)
"""LMCache's P2P/PD transfer channel over kvferry: :class:`KvferryTransferChannel`, and
:func:`install`, which makes it LMCache's channel type ``"kvferry"``.

A channel owns a kvferry engine listening on the host of its ``peer_init_url`` and
registers LMCache's paged buffer (``buffer_ptr``, ``buffer_size``, one block per
``align_bytes`` page) with it once. The control plane is a ZMQ REP socket bound at
``peer_init_url`` (as LMCache's own socket channels do), served by one thread:

- ``init``: peers exchange ids, kvferry addresses and LMCache's init side messages.
- ``pull``: "fetch these keys from me into your pages": the receiver of a *write*
  gets the writer's published pages straight into its own pages (zero copy on both
  sides: the writer's socket reads its pages, the receiver's socket writes its pages).
- ``publish``: "offer these pages of yours": the first step of a *read*; the reader
  then gets them straight into its pages.

Pages offered to a peer are kvferry publications (``once``, TTL = the channel's
timeout): pinned until the consumer's ``Done``, the TTL, or a release — and a
publication's release is reported only after every send reading it stopped.

Cancellation (the host-staging case LMCache's users lost bytes to): a cancelled
``async_batched_read``/``async_batched_write`` returns only after no socket touches the
buffers any more, however often it is cancelled: reads cancel their kvferry transfers
and await each one's drain; writes release their publications and await the engine's
report that each was released (its sends stopped). A failing piece of a read cancels
its siblings and awaits their drain before the error is raised. Pages a cancelled write
had published return at once (the receiver's later pull is a miss). Every wait is
bounded by the channel's timeout plus a drain grace.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from typing import Any, Optional, Union

import msgspec
import zmq
from lmcache.logging import init_logger
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.transfer_channel.abstract import BaseTransferChannel
from lmcache.v1.transfer_channel.transfer_utils import InitSideMsgBase, InitSideRetMsgBase, SideMsg

import kvferry

from ._settle import settle

logger = init_logger(__name__)

DEFAULT_TIMEOUT = 10.0
_GRACE = 2.0
PIECES = 4
"""A read of several pages runs as up to this many concurrent kvferry transfers."""


class ChannelError(RuntimeError):
    """A kvferry channel operation failed (peer unknown, peer refused, or no answer in time)."""


def _tcp(url: str) -> str:
    return url if url.startswith("tcp://") else f"tcp://{url}"


def _host(url: str) -> str:
    u = url[len("tcp://") :] if url.startswith("tcp://") else url
    return u.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"


def _local_ip_toward(host: str) -> str:
    """The local address this host's routes use to reach ``host`` (no packet sent)."""
    infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    fam, _, _, _, addr = infos[0]
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


class _Releases:
    """Collects the engine's publication-release reports, so that several waiters can
    each wait for their own keys. Only keys someone will wait for (:meth:`expect`,
    called as they are published) are kept; the reports of publications nobody waits
    for — the pages this peer serves to readers (``op: publish``) — are drained and
    dropped on every poll, so a peer that only serves reads keeps no report beyond
    its last batch (the engine's queue, the binding's map of published keys and this
    set all stay bounded)."""

    def __init__(self, engine: kvferry.Engine) -> None:
        self._engine = engine
        self._expected: set[bytes] = set()
        self._seen: set[bytes] = set()
        self._lock = threading.Lock()

    def expect(self, keys: list[bytes]) -> None:
        with self._lock:
            self._expected.update(keys)

    def poll(self) -> None:
        with self._lock:
            for key, _why in self._engine.released():
                k = kvferry.key_bytes(key) if isinstance(key, str) else bytes(key)
                if k in self._expected:
                    self._seen.add(k)

    def all_released(self, keys: list[bytes]) -> bool:
        self.poll()
        with self._lock:
            if all(k in self._seen for k in keys):
                self._seen.difference_update(keys)
                self._expected.difference_update(keys)
                return True
            return False

    def forget(self, keys: list[bytes]) -> None:
        """A waiter gave up on ``keys``: reports of them are no longer kept."""
        with self._lock:
            self._expected.difference_update(keys)
            self._seen.difference_update(keys)

    async def wait(self, keys: list[bytes], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while not self.all_released(keys):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)
        return True


class KvferryTransferChannel(BaseTransferChannel):
    """``BaseTransferChannel`` over kvferry (see the module docs).

    Takes the keyword arguments LMCache's ``CreateTransferChannel`` passes
    (``async_mode``, ``role``, ``buffer_ptr``, ``buffer_size``, ``align_bytes``,
    ``tp_rank``, ``peer_init_url``, ``peer_lookup_url``, ``event_loop``, ...). Options
    from the environment: ``KVFERRY_CHANNEL_TIMEOUT`` (seconds, default 10),
    ``KVFERRY_SECRET`` (the shared secret every peer must prove), and for mutual TLS
    between the peers ``KVFERRY_TLS_CERT``, ``KVFERRY_TLS_KEY``, ``KVFERRY_TLS_CA``
    (PEM files; all three or none).
    """

    def __init__(self, async_mode: bool = False, **kw: Any) -> None:
        for need in ("buffer_ptr", "buffer_size", "align_bytes"):
            if need not in kw:
                raise ChannelError(f"kvferry channel: missing {need}")
        self.async_mode = async_mode
        self.role = kw.get("role", "both")
        self.tp_rank = kw.get("tp_rank", 0)
        self.buffer_ptr = int(kw["buffer_ptr"])
        self.align_bytes = int(kw["align_bytes"])
        self.pages = int(kw["buffer_size"]) // self.align_bytes
        if self.pages <= 0:
            raise ChannelError(f"kvferry channel: a buffer of {kw['buffer_size']} bytes has no {self.align_bytes}-byte page")
        # LMCache's PD sender has no init URL (it only connects to its receiver): it
        # then runs no control socket, and its engine starts at the first peer, on
        # the local address that routes to that peer.
        url = kw.get("peer_init_url")
        self.peer_init_url: Optional[str] = None if url is None else str(url)
        self.peer_lookup_url = kw.get("peer_lookup_url")
        self.timeout = float(kw.get("kvferry_timeout") or os.environ.get("KVFERRY_CHANNEL_TIMEOUT") or DEFAULT_TIMEOUT)
        self._secret: Optional[str] = kw.get("kvferry_secret") or os.environ.get("KVFERRY_SECRET")
        # "auto": a peer on this host is read from its memory (process_vm_readv);
        # "tcp": every byte on the socket.
        self._transport = str(kw.get("kvferry_transport") or os.environ.get("KVFERRY_TRANSPORT") or "auto")
        self._engine: Optional[kvferry.Engine] = None
        self._region: Optional[kvferry.Region] = None
        self._releases: Optional[_Releases] = None
        self._engine_lock = threading.Lock()
        self.peers: dict[str, dict[str, Optional[str]]] = {}
        self._running = True
        self._ctx = zmq.Context()
        self._rep: Optional[zmq.Socket[bytes]] = None
        self._thread: Optional[threading.Thread] = None
        if self.peer_init_url is not None:
            self._start_engine(_host(self.peer_init_url))
            self._rep = self._ctx.socket(zmq.REP)
            self._rep.setsockopt(zmq.LINGER, 0)
            self._rep.setsockopt(zmq.RCVTIMEO, 100)
            self._rep.bind(_tcp(self.peer_init_url))
            self._thread = threading.Thread(target=self._serve, name="kvferry-lmc-channel", daemon=True)
            self._thread.start()

    def _start_engine(self, host: str) -> kvferry.Engine:
        """The channel's engine, started (listening on ``host``) on first use, with
        LMCache's paged buffer registered (one block per page)."""
        with self._engine_lock:
            if self._engine is None:
                tls = {k: os.environ.get(f"KVFERRY_{k.upper()}") for k in ("tls_cert", "tls_key", "tls_ca")}
                engine = kvferry.Engine(
                    tls_cert=tls["tls_cert"],
                    tls_key=tls["tls_key"],
                    tls_ca=tls["tls_ca"],
                    listen=f"[{host}]:0" if ":" in host else f"{host}:0",
                    secret=self._secret,
                    arena_bytes=4 << 20,
                    store_bytes=1 << 20,
                    ttl=self.timeout,
                    max_ttl=self.timeout,
                    io_timeout=self.timeout,
                    transport=self._transport,
                )
                self._region = engine.register_kv_cache(
                    (self.buffer_ptr, self.pages * self.align_bytes, "cpu"), block_bytes=self.align_bytes, name="lmcache-channel"
                )
                self._releases = _Releases(engine)
                self._engine = engine
            return self._engine

    @property
    def engine(self) -> kvferry.Engine:
        """The channel's kvferry engine (``ChannelError`` before the first peer of a
        channel without an init URL)."""
        if self._engine is None:
            raise ChannelError("kvferry channel: no peer was initialised yet (lazy_init_peer_connection)")
        return self._engine

    @property
    def region(self) -> kvferry.Region:
        """LMCache's paged buffer as registered with the engine."""
        self.engine  # noqa: B018 - the same error before the engine exists
        assert self._region is not None
        return self._region

    @property
    def address(self) -> str:
        """The engine's address as peers dial it."""
        addr = self.engine.address
        if addr is None:  # pragma: no cover - the channel's engine always listens
            raise ChannelError("kvferry channel: the engine does not listen")
        return addr

    # -- control plane ----------------------------------------------------------

    def _request(self, url: str, msg: dict[str, Any], timeout: Optional[float] = None) -> dict[str, Any]:
        """One request/reply to the channel at ``url``, bounded by ``timeout``."""
        t = self.timeout if timeout is None else timeout
        s = self._ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, int(t * 1000))
        s.setsockopt(zmq.RCVTIMEO, int(t * 1000))
        try:
            s.connect(_tcp(url))
            s.send(msgspec.msgpack.encode(msg))
            try:
                reply: dict[str, Any] = msgspec.msgpack.decode(s.recv())
            except zmq.Again:
                raise ChannelError(f"kvferry channel: {url} did not answer {msg['op']} within {t:.1f} s") from None
        finally:
            s.close()
        if "error" in reply:
            raise ChannelError(f"kvferry channel: {url} refused {msg['op']}: {reply['error']}")
        return reply

    def _serve(self) -> None:
        rep = self._rep
        assert rep is not None
        while self._running:
            try:
                raw = rep.recv()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            try:
                reply = self._handle(msgspec.msgpack.decode(raw))
            except Exception as e:  # noqa: BLE001 - every request gets an answer
                reply = {"error": f"{type(e).__name__}: {e}"}
            try:
                rep.send(msgspec.msgpack.encode(reply))
            except zmq.ZMQError:
                return

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "init":
            self.peers[msg["id"]] = {"url": msg["url"], "addr": msg["addr"]}
            out: dict[str, Any] = {"addr": self.address, "id": self.peer_init_url}
            if msg.get("side") is not None:
                side = msgspec.msgpack.decode(msg["side"], type=SideMsg)
                out["side"] = msgspec.msgpack.encode(self.handle_init_side_msg(side))
            return out
        if op == "pull":
            idx = [int(i) for i in msg["indexes"]]
            self._check_indexes(idx)
            n = self.engine.get_blocking(msg["addr"], list(msg["keys"]), self.region, [[i] for i in idx], timeout=self.timeout)
            return {"n": n}
        if op == "publish":
            idx = [int(i) for i in msg["indexes"]]
            self._check_indexes(idx)
            keys = [uuid.uuid4().bytes + uuid.uuid4().bytes for _ in idx]
            if self._releases is not None:
                self._releases.poll()  # the reports of earlier batches served: dropped
            for k, i in zip(keys, idx):
                self.engine.publish(k, self.region, [i], ttl=self.timeout, once=True)
            return {"keys": keys}
        raise ValueError(f"unknown op {op!r}")

    def _check_indexes(self, idx: list[int]) -> None:
        bad = [i for i in idx if not 0 <= i < self.pages]
        if bad:
            raise ValueError(f"page indexes {bad[:5]} outside 0..{self.pages}")

    def _init(self, local_id: str, peer_id: str, peer_init_url: str, init_side_msg: Optional[InitSideMsgBase]) -> Optional[InitSideRetMsgBase]:
        self._start_engine(_local_ip_toward(_host(peer_init_url)))
        msg: dict[str, Any] = {"op": "init", "id": local_id, "url": self.peer_init_url, "addr": self.address}
        if init_side_msg is not None:
            msg["side"] = msgspec.msgpack.encode(init_side_msg)
        reply = self._request(peer_init_url, msg)
        self.peers[peer_id] = {"url": peer_init_url, "addr": reply["addr"]}
        if reply.get("side") is not None:
            ret: InitSideRetMsgBase = msgspec.msgpack.decode(reply["side"], type=SideMsg)
            return ret
        return None

    def lazy_init_peer_connection(self, local_id: str, peer_id: str, peer_init_url: str, init_side_msg: Optional[InitSideMsgBase] = None) -> Optional[InitSideRetMsgBase]:
        return self._init(local_id, peer_id, peer_init_url, init_side_msg)

    async def async_lazy_init_peer_connection(self, local_id: str, peer_id: str, peer_init_url: str, init_side_msg: Optional[InitSideMsgBase] = None) -> Optional[InitSideRetMsgBase]:
        return await settle(asyncio.to_thread(self._init, local_id, peer_id, peer_init_url, init_side_msg))

    def remote_xfer_handler_exists(self, receiver_or_sender_id: str) -> bool:
        return receiver_or_sender_id in self.peers

    def _peer(self, peer_id: str) -> tuple[str, str]:
        """``(control URL, kvferry address)`` of an initialised peer that runs a
        control socket (every peer this side writes to or reads from does)."""
        p = self.peers.get(peer_id)
        if p is None:
            raise ChannelError(f"kvferry channel: peer {peer_id!r} was never initialised (lazy_init_peer_connection)")
        url, addr = p.get("url"), p.get("addr")
        if url is None or addr is None:
            raise ChannelError(f"kvferry channel: peer {peer_id!r} has no init URL (a PD sender): nothing can be written to or read from it")
        return url, addr

    # -- data plane ------------------------------------------------------------

    def get_local_mem_indices(self, objects: Union[list[bytes], list[MemoryObj]]) -> list[int]:
        out = []
        for o in objects:
            if not isinstance(o, MemoryObj):
                raise ChannelError("kvferry channel: only MemoryObj pages of the registered buffer can move")
            off = int(o.data_ptr) - self.buffer_ptr
            if off < 0 or off % self.align_bytes or off // self.align_bytes >= self.pages:
                raise ChannelError(f"kvferry channel: object at offset {off} is not a page of the registered buffer")
            out.append(off // self.align_bytes)
        return out

    async def async_batched_write(self, objects: Union[list[bytes], list[MemoryObj]], transfer_spec: Optional[dict[str, Any]] = None) -> int:
        """Writes ``objects`` into pages ``remote_indexes`` of ``receiver_id``: publishes
        them, has the receiver pull, and returns after every publication was released."""
        assert transfer_spec is not None
        if not objects:
            return 0
        peer_url, _ = self._peer(transfer_spec["receiver_id"])
        remote = [int(i) for i in transfer_spec["remote_indexes"]]
        local = self.get_local_mem_indices(objects)
        if len(remote) != len(local):
            raise ChannelError(f"kvferry channel: {len(local)} objects but {len(remote)} remote indexes")
        keys = [uuid.uuid4().bytes + uuid.uuid4().bytes for _ in local]
        published: list[bytes] = []
        try:
            self.engine  # noqa: B018 - ChannelError before the first peer, as publish() raises
            assert self._releases is not None  # made with the engine
            self._releases.expect(keys)
            for k, i in zip(keys, local):
                self.engine.publish(k, self.region, [i], ttl=self.timeout, once=True)
                published.append(k)
            pull = asyncio.ensure_future(
                asyncio.to_thread(self._request, peer_url, {"op": "pull", "addr": self.address, "keys": keys, "indexes": remote})
            )
            pull.add_done_callback(lambda f: f.cancelled() or f.exception())
            reply = await asyncio.shield(pull)  # a cancel stops waiting for the answer ...
            return int(reply["n"])
        finally:
            # ... and on every path the publications are released, then we wait until
            # the engine reports each one released: no send reads these pages any more.
            # Repeated cancels are absorbed by settle(); the first one is re-raised.
            for k in published:
                self.engine.release(k)
            if published:
                assert self._releases is not None
                ok = await settle(self._releases.wait(published, self.timeout + _GRACE))
                if not ok:
                    self._releases.forget(published)
                    logger.error("kvferry channel: publications not released within %.1f s", self.timeout + _GRACE)

    async def async_batched_read(self, buffers: Union[list[bytes], list[MemoryObj]], transfer_spec: Optional[dict[str, Any]] = None) -> int:
        """Reads pages ``remote_indexes`` of ``sender_id`` into ``buffers`` (up to
        :data:`PIECES` concurrent transfers); returns after every transfer stopped."""
        assert transfer_spec is not None
        if not buffers:
            return 0
        peer_url, peer_addr = self._peer(transfer_spec["sender_id"])
        remote = [int(i) for i in transfer_spec["remote_indexes"]]
        local = self.get_local_mem_indices(buffers)
        if len(remote) != len(local):
            raise ChannelError(f"kvferry channel: {len(local)} buffers but {len(remote)} remote indexes")
        transfers: list[kvferry.Transfer] = []

        cancelled = threading.Event()

        async def run() -> int:
            reply = await asyncio.to_thread(self._request, peer_url, {"op": "publish", "indexes": remote})
            keys = list(reply["keys"])
            if cancelled.is_set():  # cancelled while the sender published: start nothing
                self.engine.release_remote(peer_addr, keys, timeout=self.timeout)
                raise asyncio.CancelledError()
            step = -(-len(keys) // PIECES)
            for s in range(0, len(keys), step):
                transfers.append(self.engine.get(peer_addr, keys[s : s + step], self.region, [[i] for i in local[s : s + step]], timeout=self.timeout))
            return await self._gather(transfers, step)

        def cancel_all() -> None:
            cancelled.set()
            threading.Thread(target=self._drain, args=(list(transfers),), daemon=True).start()

        try:
            return await settle(run(), on_cancel=cancel_all)
        finally:
            # settle() returned only after run() ended, and run() ends only after
            # every piece stopped; this is the backstop (nothing left to wait for).
            self._drain(transfers)

    async def _gather(self, transfers: list[kvferry.Transfer], step: int) -> int:
        """The pieces' landed chunks; on the first failure the siblings are cancelled
        and drained before the error is raised."""
        futs = [asyncio.ensure_future(_wait(t)) for t in transfers]
        pending = set(futs)
        first: Optional[BaseException] = None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None and first is None:
                    first = f.exception()
                    await asyncio.to_thread(self._drain, transfers)
        if first is not None:
            await asyncio.to_thread(self._drain, transfers)  # the failed one may still drain
            raise first
        total = 0
        for f in futs:
            n = f.result()
            total += n
            if n < step:
                break
        return total

    def _drain(self, transfers: list[kvferry.Transfer]) -> None:
        """Returns once no transfer of ``transfers`` touches the buffer: a failed
        transfer can be done while it still drains, and ``cancel()`` returns only after
        the drain, so every transfer that did not succeed is cancelled, done or not."""
        for t in transfers:
            if not t.done() or t.error is not None:
                t.cancel()

    def batched_write(self, objects: Union[list[bytes], list[MemoryObj]], transfer_spec: Optional[dict[str, Any]] = None) -> int:
        return asyncio.run(self.async_batched_write(objects, transfer_spec))

    def batched_read(self, buffers: Union[list[bytes], list[MemoryObj]], transfer_spec: Optional[dict[str, Any]] = None) -> int:
        return asyncio.run(self.async_batched_read(buffers, transfer_spec))

    def batched_send(self, objects: Union[list[bytes], list[MemoryObj]], transfer_spec: Optional[dict[str, Any]] = None) -> int:
        raise NotImplementedError("kvferry channel: send/recv pairs are not supported; LMCache's P2P and PD backends use write/read")

    def batched_recv(self, buffers: Union[list[bytes], list[MemoryObj]], transfer_spec: Optional[dict[str, Any]] = None) -> int:
        raise NotImplementedError("kvferry channel: send/recv pairs are not supported; LMCache's P2P and PD backends use write/read")

    async def async_batched_send(self, objects: Union[list[bytes], list[MemoryObj]], transfer_spec: Optional[dict[str, Any]] = None) -> int:
        raise NotImplementedError("kvferry channel: send/recv pairs are not supported")

    async def async_batched_recv(self, buffers: Union[list[bytes], list[MemoryObj]], transfer_spec: Optional[dict[str, Any]] = None) -> int:
        raise NotImplementedError("kvferry channel: send/recv pairs are not supported")

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        if self._thread is not None:
            self._thread.join(2.0)
        if self._rep is not None:
            self._rep.close(0)
        self._ctx.term()
        if self._engine is not None:
            self._engine.close(self.timeout)


async def _wait(t: kvferry.Transfer) -> int:
    return await t


_installed: dict[str, Any] = {}
_TARGETS = (
    "lmcache.v1.storage_backend.p2p_backend",
    "lmcache.v1.storage_backend.pd_backend",
    "lmcache.v1.storage_backend.pd_backend_async",
)


def install() -> None:
    """Makes ``transfer_channel: "kvferry"`` work in LMCache's P2P and PD backends.

    LMCache has no channel registry: its factory ``CreateTransferChannel`` accepts
    ``"nixl"`` and ``"mock_memory"`` only, and each backend imported it by name. This
    wraps the factory (``"kvferry"`` builds a :class:`KvferryTransferChannel`, any
    other type goes to LMCache's own) and replaces the name in
    ``lmcache.v1.transfer_channel`` and in each backend module. Idempotent. Refused
    (``RuntimeError``) on an lmcache other than the tested version."""
    import importlib

    from . import LMCACHE_VERSION
    from ._version import installed_version

    have = installed_version()
    if have != LMCACHE_VERSION:
        raise RuntimeError(
            f"kvferry.integrations.lmcache.install() is pinned to lmcache=={LMCACHE_VERSION} (it replaces "
            f"LMCache's channel factory where its backends imported it); found lmcache {have}"
        )
    tc: Any = importlib.import_module("lmcache.v1.transfer_channel")

    if _installed:
        return
    original = tc.CreateTransferChannel

    def create(channel_type: str, async_mode: bool, role: str, buffer_ptr: int, buffer_size: int, align_bytes: int, tp_rank: int, peer_init_url: Optional[str], device: Optional[str] = None, **kwargs: Any) -> BaseTransferChannel:
        if channel_type != "kvferry":
            return original(channel_type, async_mode, role, buffer_ptr, buffer_size, align_bytes, tp_rank, peer_init_url, device=device, **kwargs)
        if device not in (None, "cpu"):
            raise ValueError(f"the kvferry channel moves host memory; buffer device {device!r} is not supported")
        return KvferryTransferChannel(async_mode=async_mode, role=role, buffer_ptr=buffer_ptr, buffer_size=buffer_size, align_bytes=align_bytes, tp_rank=tp_rank, peer_init_url=peer_init_url, device=device, **kwargs)

    _installed["original"] = original
    tc.CreateTransferChannel = create
    for name in _TARGETS:
        mod = importlib.import_module(name)
        if getattr(mod, "CreateTransferChannel", None) is original:
            setattr(mod, "CreateTransferChannel", create)  # noqa: B010 - a module attribute mypy cannot see
