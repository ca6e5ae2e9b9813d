# mypy: disable-error-code="import-untyped,import-not-found"
# (sglang ships no type information: its classes are Any here.)
"""The per-rank manager: one kvferry :class:`~kvferry.Engine` holding SGLang's KV and
auxiliary buffers as regions, a ZeroMQ control socket, and one thread that runs every
room (request) of this rank to an end.

Protocol (JSON messages over ZeroMQ PUSH to the peer's PULL socket):

- ``meta`` decode → prefill: the decode rank's layout, its control endpoint and
  engine, its page count, whether it reads this rank (and its auxiliary row). The
  prefill checks the pairing and answers ``refuse`` naming every difference.
- ``chunk`` prefill → decode, once per :meth:`KvferryKVSender.send`: the chunk's pages
  are published in kvferry under a key; the message says which decode pages they
  fill (by position) and, on the last chunk, the auxiliary keys. The decode reads
  the key with :meth:`Engine.get` into its own pages (a byte selection when TP sizes
  differ) and answers ``ack`` once the read landed and drained; the prefill then
  releases the publication.
- ``abort`` either way: the other side cancels and frees at once (one message, no TTL).

Every wait is bounded: bootstrap by ``KVFERRY_SGLANG_BOOTSTRAP_TIMEOUT``, a transfer
without progress by ``KVFERRY_SGLANG_TIMEOUT``, and a peer engine that stops answering
the liveness probe fails its rooms at the next probe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs, KVPoll

from ... import Engine, Selection, Transfer
from . import _bootstrap
from ._options import Options, Topology, topology
from ._plan import Layout, PairingError, check_pairing, readers, sources, unread_notified_by
from ._rooms import RecvRoom, SendRoom
from ._setup import engine_device, layout_of, local_ip, refuse_unsupported, register_buffers

log = logging.getLogger(__name__)


def _mode(mode: Any) -> str:
    return str(getattr(mode, "value", mode)).lower()


class KvferryKVManager(BaseKVManager):  # type: ignore[misc]
    """SGLang's per-rank transfer manager over one kvferry engine."""

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False) -> None:
        self.kv_args = args
        self.mode = _mode(disaggregation_mode)
        if self.mode not in ("prefill", "decode"):
            raise ValueError(f"kvferry backend: disaggregation mode {self.mode!r} is neither prefill nor decode")
        self.opts = Options.from_env()
        self.topo: Topology = topology(server_args, args)
        refuse_unsupported(self.topo, args)
        self.layout = layout_of(args, self.topo, bool(is_mla_backend))
        host = self.opts.host or local_ip()
        device = engine_device(self.opts.device, args)
        self.engine = Engine(
            listen=f"{host}:0",
            secret=self.opts.secret,
            device=device,
            io_timeout=min(self.opts.timeout, 5.0),
            ttl=self.opts.timeout,
            max_ttl=max(self.opts.timeout, 10.0),
            peer_id=f"sglang-{self.mode}-tp{self.topo.tp_rank}-{id(self):x}",
            transport=self.opts.transport,
        )
        self.kv_region = register_buffers(self.engine, list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens), "kv", device)
        self.aux_regions = [
            register_buffers(self.engine, [p], [n], [item], f"aux{i}", device="host")
            for i, (p, n, item) in enumerate(zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens))
        ]
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.host, self.port = host, port
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket[bytes]] = {}
        self._send_lock = threading.Lock()
        self.lock = threading.RLock()
        self.senders: dict[int, SendRoom] = {}
        self.receivers: dict[int, RecvRoom] = {}
        self._infos: dict[str, dict[str, Any]] = {}
        # What SGLang's decode scheduler reads before it creates receivers: the
        # prefill's topology per bootstrap address (its PrefillServerInfo).
        self.prefill_info_table: dict[str, Any] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        # Finished reads wake the control thread through this pipe (see _loop).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._landed: list[int] = []
        self._recheck = False
        self._thread = threading.Thread(target=self._loop, name="kvferry-sglang-control", daemon=True)
        self._thread.start()
        self._prober = threading.Thread(target=self._probe_loop, name="kvferry-sglang-probe", daemon=True)
        self._prober.start()
        if self.mode == "prefill":
            self.register_to_bootstrap()

    # -- set-up ---------------------------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One bounded attempt to learn the prefill's topology (SGLang's decode
        scheduler retries it, then aborts its requests)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            info = _bootstrap.server_info(bootstrap_addr, min(2.0, self.opts.bootstrap_timeout))
        except Exception as e:
            log.info("kvferry: prefill at %s not ready: %s", bootstrap_addr, e)
            return False
        self._remember(bootstrap_addr, info)
        return True

    def _remember(self, bootstrap_addr: str, info: dict[str, Any]) -> None:
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        names = {f.name for f in dataclasses.fields(PrefillServerInfo)}
        self._infos[bootstrap_addr] = info
        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(**{k: v for k, v in info.items() if k in names})

    def _ensure_prefill_recompute_executor(self) -> ThreadPoolExecutor:
        """The executor SGLang's decode scheduler runs its DP-rank queries on."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(2, thread_name_prefix="kvferry-sglang-query")
        return self._executor

    def register_to_bootstrap(self) -> None:
        _bootstrap.register_rank(
            self.topo, self.host, self.port, self.layout.page_size, self.layout.dtype, self.opts.bootstrap_timeout
        )

    def close(self) -> None:
        """Stops the threads, closes the sockets and the engine (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._prober.join(timeout=5)
        with self._send_lock:
            for s in self._push.values():
                s.close(linger=0)
            self._push.clear()
        self._pull.close(linger=0)
        self._ctx.term()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self.engine.close()
        w, self._wake_w = self._wake_w, -1
        for fd in (self._wake_r, w):
            os.close(fd)

    teardown = close

    # -- messages -------------------------------------------------------------------

    def post(self, endpoint: str, msg: dict[str, Any]) -> None:
        """Sends one control message (never blocks: a full queue drops, and the
        timeouts cover a lost message)."""
        data = json.dumps(msg).encode()
        with self._send_lock:
            s = self._push.get(endpoint)
            if s is None:
                s = self._ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 10000)
                s.connect(endpoint)
                self._push[endpoint] = s
            try:
                s.send(data, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("kvferry: control queue to %s full; message %s dropped", endpoint, msg.get("t"))

    def _loop(self) -> None:
        """The rank's control thread. It wakes on a control message, or on a read of
        this rank that finished (each read's done-callback queues its room and writes
        one byte to a pipe the poller watches): only those rooms are advanced then, so
        a read's landing is seen at once and costs no periodic polling. Timeouts of
        every room are checked every 10 ms; a read that finished but has not drained
        yet (a device copy that outlived a failure) is rechecked every millisecond."""
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = 0.0
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(1 if self._recheck else 10))
                if self._pull in events:
                    while True:
                        try:
                            raw = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(json.loads(raw))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                now = time.monotonic()
                with self.lock:
                    landed, self._landed = self._landed, []
                    for room in dict.fromkeys(landed):
                        r = self.receivers.get(room)
                        if r is not None:
                            self._advance(r, now)
                    if self._recheck or now >= next_tick:
                        self._recheck = False
                        self._tick()
                        next_tick = now + 0.01
            except zmq.ContextTerminated:
                return
            except Exception:  # keep the rank's other rooms going
                log.exception("kvferry: control loop error")

    def _watch(self, r: RecvRoom, t: Transfer) -> None:
        """Queues ``r`` for the control thread once ``t`` finishes. The callback runs on
        an engine thread: it takes no lock of the manager (the control thread may be
        waiting on that engine under it), only appends (atomic) and writes a byte."""
        room = r.room

        def landed() -> None:
            if self._wake_w < 0:  # closed (a callback after close)
                return
            self._landed.append(room)
            try:
                os.write(self._wake_w, b"\0")
            except OSError:  # the pipe is full (a wake-up is pending anyway) or closed
                pass

        t._t.add_done_callback(landed)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        t, room = msg.get("t"), int(msg.get("room", -1))
        with self.lock:
            if self.mode == "prefill":
                s = self.senders.setdefault(room, SendRoom(room))
                if t == "meta":
                    self._on_meta(s, msg)
                elif t == "ack":
                    self._on_ack(s, msg)
                elif t == "abort":
                    self.fail_send(s, f"aborted by decode rank {msg.get('rank')}: {msg.get('reason', '')}", tell=False)
            else:
                r = self.receivers.get(room)
                if r is None:
                    return
                if t == "chunk":
                    self._on_chunk(r, msg)
                    self._advance(r, time.monotonic())
                elif t in ("refuse", "abort"):
                    what = "refused pairing" if t == "refuse" else "aborted by prefill"
                    self.fail_recv(r, f"{what} (prefill rank {msg.get('rank')}): {msg.get('reason', '')}", tell=False)

    # -- prefill side ---------------------------------------------------------------

    def _on_meta(self, s: SendRoom, msg: dict[str, Any]) -> None:
        if s.status == KVPoll.Failed:
            return
        try:
            dec = Layout.from_wire(msg["layout"])
            check_pairing(self.layout, dec)
        except PairingError as e:
            reason = f"refused pairing with decode rank {msg.get('rank')}: {e}"
            self.post(str(msg["endpoint"]), {"t": "refuse", "room": s.room, "rank": self.topo.tp_rank, "reason": str(e)})
            self.fail_send(s, reason, tell=False)
            return
        s.metas[int(msg["rank"])] = msg
        if s.expected is None:
            s.expected = len(readers(self.layout, dec, self.topo.tp_rank)) or 1
        s.progress = time.monotonic()
        if s.status == KVPoll.Bootstrapping and len(s.metas) >= s.expected:
            s.status = KVPoll.WaitingForInput

    def send_chunk(self, s: SendRoom, kv_indices: list[int]) -> None:
        """Publishes one prefill chunk's pages and tells every reader."""
        if s.status == KVPoll.Failed:
            return
        if s.last_sent:
            self.fail_send(s, "send() called after the last chunk")
            return
        offset = s.sent_pages
        s.sent_pages += len(kv_indices)
        last = s.sent_pages >= s.num_pages
        if s.t_first is None:
            s.t_first = time.monotonic()
        readers_ = [m for m in s.metas.values() if m.get("pull")]
        msg: dict[str, Any] = {
            "t": "chunk",
            "room": s.room,
            "rank": self.topo.tp_rank,
            "addr": self.engine.address,
            "inc": self.engine.incarnation,
            "offset": offset,
            "n": len(kv_indices),
            "last": last,
            "key": None,
            "aux": [],
        }
        if kv_indices and readers_:
            key = f"sgl/{s.room}/{self.topo.tp_rank}/{s.chunks}"
            self.engine.publish(key, self.kv_region, kv_indices, ttl=self.opts.timeout, once=False)
            s.keys.append(key)
            s.pending[key] = {int(m["rank"]) for m in readers_}
            s.bytes += len(kv_indices) * sum(self.layout.item_lens)
            msg["key"] = key
        s.chunks += 1
        if last:
            s.last_sent = True
            aux_readers = {int(m["rank"]) for m in readers_ if m.get("aux")}
            if aux_readers and s.aux_index is not None:
                for i, region in enumerate(self.aux_regions):
                    key = f"sgl/{s.room}/{self.topo.tp_rank}/aux{i}"
                    self.engine.publish(key, region, [s.aux_index], ttl=self.opts.timeout, once=False)
                    s.keys.append(key)
                    s.pending[key] = set(aux_readers)
                    msg["aux"].append(key)
        for m in readers_:
            self.post(str(m["endpoint"]), msg)
        s.status = KVPoll.Transferring
        s.progress = time.monotonic()
        self._maybe_done(s)

    def _on_ack(self, s: SendRoom, msg: dict[str, Any]) -> None:
        key = str(msg["key"])
        left = s.pending.get(key)
        if left is None:
            return
        left.discard(int(msg["rank"]))
        s.progress = time.monotonic()
        if not left:
            del s.pending[key]
            self.engine.release(key)
        self._maybe_done(s)

    def _maybe_done(self, s: SendRoom) -> None:
        if s.status != KVPoll.Failed and s.last_sent and not s.pending:
            s.status = KVPoll.Success
            s.t_done = time.monotonic()

    def fail_send(self, s: SendRoom, reason: str, tell: bool = True) -> None:
        """Fails a prefill room: releases its publications now and (``tell``) tells its
        readers, which cancel and free their pages."""
        if s.status in (KVPoll.Failed, KVPoll.Success):
            return
        s.status, s.reason = KVPoll.Failed, reason
        for key in s.keys:
            self.engine.release(key)
        s.pending.clear()
        if tell:
            for m in s.metas.values():
                self.post(str(m["endpoint"]), {"t": "abort", "room": s.room, "rank": self.topo.tp_rank, "reason": reason})

    def drop_send(self, room: int) -> None:
        with self.lock:
            s = self.senders.pop(room, None)
            if s is not None:
                for key in s.keys:
                    self.engine.release(key)

    # -- decode side ----------------------------------------------------------------

    def resolve(self, r: RecvRoom, prefill_dp_rank: int) -> None:
        """Bootstrap of a decode room (on a worker thread): the prefill's topology,
        the pairing checks the server info allows, the endpoints of the ranks read."""
        try:
            info = self._infos.get(r.bootstrap_addr)
            if info is None:
                info = _bootstrap.server_info(r.bootstrap_addr, self.opts.bootstrap_timeout)
                self._remember(r.bootstrap_addr, info)
            why = []
            if info.get("page_size") is not None and int(info["page_size"]) != self.layout.page_size:
                why.append(f"page size differs: prefill {int(info['page_size'])} tokens, decode {self.layout.page_size}")
            if info.get("kv_cache_dtype") is not None and str(info["kv_cache_dtype"]) != self.layout.dtype:
                why.append(f"KV cache dtype differs: prefill {info['kv_cache_dtype']}, decode {self.layout.dtype}")
            for what, flag, key in (("pipeline parallelism", "--pp-size", "pp_size"), ("context parallelism", "--attn-cp-size", "attn_cp_size")):
                if int(info.get(key) or 1) != 1:
                    why.append(f"the prefill runs {what} ({flag} {info[key]}), which the kvferry backend does not pair")
            if why:
                raise PairingError("; ".join(why))
            pre = Layout(**{**self.layout.__dict__, "tp_size": int(info["attn_tp_size"]), "tp_rank": 0})
            srcs = sources(pre, self.layout, self.topo.tp_rank)
            notify = unread_notified_by(pre, self.layout, self.topo.tp_rank)
            endpoints = {
                p: _bootstrap.rank_endpoint(r.bootstrap_addr, prefill_dp_rank, p, self.opts.bootstrap_timeout)
                for p in {s.rank for s in srcs} | set(notify)
            }
        except PairingError as e:
            with self.lock:
                self.fail_recv(r, f"refused pairing at bootstrap: {e}", tell=False)
            return
        except Exception as e:
            with self.lock:
                self.fail_recv(r, f"bootstrap failed: {e}", tell=False)
            return
        with self.lock:
            if r.status == KVPoll.Failed:
                return
            r.sources = {s.rank: s for s in srcs}
            r.notify = notify
            r.endpoints = endpoints
            r.status = KVPoll.WaitingForInput
            r.progress = time.monotonic()
            self.maybe_send_meta(r)

    def maybe_send_meta(self, r: RecvRoom) -> None:
        if r.meta_sent or r.kv_indices is None or r.status != KVPoll.WaitingForInput:
            return
        r.meta_sent = True
        r.progress = time.monotonic()
        first = min(r.sources) if r.sources else None
        r.aux_needed = first is not None and r.aux_index is not None and bool(self.aux_regions)
        for p, ep in r.endpoints.items():
            self.post(
                ep,
                {
                    "t": "meta",
                    "room": r.room,
                    "rank": self.topo.tp_rank,
                    "endpoint": self.endpoint,
                    "addr": self.engine.address,
                    "layout": self.layout.to_wire(),
                    "pages": len(r.kv_indices),
                    "pull": p in r.sources,
                    "aux": p == first and r.aux_needed,
                },
            )

    def _on_chunk(self, r: RecvRoom, msg: dict[str, Any]) -> None:
        if r.status == KVPoll.Failed or r.failing:
            return
        p = int(msg["rank"])
        src = r.sources.get(p)
        assert r.kv_indices is not None
        if src is None:
            return
        off, n = int(msg["offset"]), int(msg["n"])
        if off + n > len(r.kv_indices):
            self.fail_recv(r, f"prefill rank {p} sent pages {off}..{off + n} but this request has {len(r.kv_indices)}")
            return
        addr = str(msg["addr"])
        r.addrs[p] = addr
        inc = int(msg["inc"])
        r.status = KVPoll.Transferring
        r.progress = time.monotonic()
        try:
            if msg.get("key") and n:
                sel = None if src.src_ranges is None else Selection(src_ranges=src.src_ranges, dst_ranges=src.dst_ranges)
                t = self.engine.get(
                    addr, str(msg["key"]), self.kv_region, r.kv_indices[off : off + n],
                    timeout=self.opts.timeout, path=self.opts.path, incarnation=inc, select=sel,
                )
                r.inflight.append((t, p, str(msg["key"])))
                self._watch(r, t)
            for i, key in enumerate(msg.get("aux") or []):
                t = self.engine.get(addr, str(key), self.aux_regions[i], [r.aux_index], timeout=self.opts.timeout, incarnation=inc)
                r.inflight.append((t, p, str(key)))
                self._watch(r, t)
        except Exception as e:
            self.fail_recv(r, f"{type(e).__name__}: {e}")
            return
        if msg.get("last"):
            r.last_seen.add(p)

    def _tick(self) -> None:
        now = time.monotonic()
        for r in list(self.receivers.values()):
            self._advance(r, now)
        for s in list(self.senders.values()):
            if not s.owned and now - s.born > max(300.0, 10 * self.opts.bootstrap_timeout):
                # Announced by a decode but never claimed by a request here (it went
                # to another rank, or the prefill dropped it): forget it.
                self.fail_send(s, "no request on this prefill claimed the room")
                del self.senders[s.room]
                continue
            if s.status == KVPoll.Transferring and now - s.progress > self.opts.timeout:
                self.fail_send(s, f"timeout: no acknowledgement from the decode for {self.opts.timeout:g} s")
            elif s.status == KVPoll.Bootstrapping and s.metas and now - s.progress > self.opts.bootstrap_timeout:
                self.fail_send(s, f"timeout: {len(s.metas)} of {s.expected} decode ranks arrived within {self.opts.bootstrap_timeout:g} s")

    def _advance(self, r: RecvRoom, now: float) -> None:
        still = []
        for t, p, key in r.inflight:
            if not t.done():
                still.append((t, p, key))
                continue
            if t.error is not None:
                if not r.failing:
                    e = t.error
                    self.fail_recv(r, f"read of {key} from prefill rank {p} failed: {type(e).__name__}: {e}")
                if not t.drained():
                    still.append((t, p, key))
                    self._recheck = True
                continue
            if not t.drained():
                still.append((t, p, key))
                self._recheck = True
                continue
            r.progress = now
            if "/aux" in key:
                r.aux_done = True
            if not r.failing and r.endpoints.get(p):
                self.post(r.endpoints[p], {"t": "ack", "room": r.room, "rank": self.topo.tp_rank, "key": key})
        r.inflight = still
        if r.failing:
            if not r.inflight:
                r.status, r.reason = KVPoll.Failed, r.failing
            return
        if r.status in (KVPoll.Failed, KVPoll.Success):
            return
        if (
            r.status == KVPoll.Transferring
            and not r.inflight
            and r.sources
            and set(r.sources) <= r.last_seen
            and (r.aux_done or not r.aux_needed)
        ):
            r.status = KVPoll.Success
            return
        if r.status in (KVPoll.WaitingForInput, KVPoll.Transferring) and r.meta_sent and now - r.progress > self.opts.timeout:
            self.fail_recv(r, f"timeout: no progress from the prefill for {self.opts.timeout:g} s")

    def fail_recv(self, r: RecvRoom, reason: str, tell: bool = True) -> None:
        """Fails a decode room: cancels its reads (``Failed`` is reported once they
        drained, so SGLang frees only quiet pages) and (``tell``) tells the prefill
        ranks, which release their publications."""
        if r.status in (KVPoll.Failed, KVPoll.Success) or r.failing:
            return
        r.failing = reason
        for t, _, _ in r.inflight:
            t.cancel(0)
        if tell:
            for ep in r.endpoints.values():
                self.post(ep, {"t": "abort", "room": r.room, "rank": self.topo.tp_rank, "reason": reason})
        if not r.inflight:
            r.status, r.reason = KVPoll.Failed, reason

    def drop_recv(self, room: int) -> None:
        with self.lock:
            r = self.receivers.pop(room, None)
            if r is not None:
                for t, _, _ in r.inflight:
                    t.cancel(5.0)

    # -- liveness -------------------------------------------------------------------

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.opts.probe_interval):
            with self.lock:
                peers: dict[str, list[Any]] = {}
                for r in self.receivers.values():
                    if r.status == KVPoll.Transferring and not r.failing:
                        for p, a in r.addrs.items():
                            if p not in r.last_seen or r.inflight:
                                peers.setdefault(a, []).append(r)
                for s in self.senders.values():
                    if s.status == KVPoll.Transferring:
                        for m in s.metas.values():
                            peers.setdefault(str(m["addr"]), []).append(s)
            for addr, rooms in peers.items():
                try:
                    self.engine.lookup(addr, "kvferry-sglang-probe", timeout=min(2.0, self.opts.timeout))
                except Exception as e:
                    reason = f"peer lost: engine {addr} did not answer a liveness probe ({type(e).__name__}: {e})"
                    with self.lock:
                        for x in rooms:
                            if isinstance(x, RecvRoom):
                                self.fail_recv(x, reason)
                            else:
                                self.fail_send(x, reason, tell=False)
