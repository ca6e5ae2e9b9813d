# mypy: disable-error-code="import-untyped,import-not-found"
# (sglang ships no type information: its classes are Any here.)
"""SGLang's sender (prefill) and receiver (decode) over :class:`KvferryKVManager`.

States mean what SGLang's schedulers expect: a sender is ``Bootstrapping`` until every
decode rank that reads it has announced its pages, ``WaitingForInput`` until the first
chunk, ``Transferring`` until every reader acknowledged every chunk, then ``Success``.
A receiver is ``Bootstrapping`` until the prefill's topology and endpoints are known,
``WaitingForInput`` until the first chunk arrives, ``Transferring`` while reads are in
flight, and ``Success`` only when every chunk and the auxiliary row landed, were
verified, and nothing writes the pages any more. ``Failed`` on either side carries a
reason that :meth:`failure_exception` raises.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender, KVPoll, KVTransferMetric

from ._manager import KvferryKVManager
from ._rooms import RecvRoom, SendRoom


class KvferryTransferError(RuntimeError):
    """A kvferry transfer of one request failed; the message names the cause
    (timeout, peer lost, restarted peer, checksum, refused pairing, abort)."""

    def __init__(self, room: int, reason: str) -> None:
        super().__init__(f"kvferry transfer of bootstrap room {room} failed: {reason}")
        self.room = room
        self.reason = reason


def _ids(kv_indices: Any) -> list[int]:
    tolist = getattr(kv_indices, "tolist", None)
    return [int(x) for x in (tolist() if callable(tolist) else kv_indices)]


class KvferryKVSender(BaseKVSender):  # type: ignore[misc]
    """The prefill side of one request."""

    def __init__(self, mgr: KvferryKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.mgr = mgr
        self.room = int(bootstrap_room)
        self.kv_mgr = mgr  # the attribute name SGLang's prefill scheduler reads
        with mgr.lock:
            self.state: SendRoom = mgr.senders.setdefault(self.room, SendRoom(self.room))
            self.state.owned = True

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        with self.mgr.lock:
            self.state.num_pages = int(num_kv_indices)
            self.state.inited = True
            self.state.aux_index = None if aux_index is None else int(aux_index)

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None, **_: Any) -> None:
        ids = _ids(kv_indices)
        with self.mgr.lock:
            try:
                self.mgr.send_chunk(self.state, ids)
            except Exception as e:
                self.mgr.fail_send(self.state, f"publishing the chunk failed: {type(e).__name__}: {e}")

    def poll(self) -> int:
        s = self.state
        if s.status == KVPoll.WaitingForInput and s.inited and s.num_pages == 0 and not s.last_sent:
            # Nothing to send (every page was a decode prefix hit): SGLang calls no
            # send(); the empty last chunk still carries the auxiliary row.
            with self.mgr.lock:
                self.mgr.send_chunk(s, [])
        return int(s.status)

    def get_transfer_metric(self) -> KVTransferMetric:
        s = self.state
        latency = None if s.t_first is None or s.t_done is None else s.t_done - s.t_first
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=s.bytes)

    def failure_exception(self) -> None:
        raise KvferryTransferError(self.room, self.state.reason or "failed")

    def abort(self) -> None:
        with self.mgr.lock:
            self.mgr.fail_send(self.state, "aborted by prefill")

    def clear(self) -> None:
        self.mgr.drop_send(self.room)


class KvferryKVReceiver(BaseKVReceiver):  # type: ignore[misc]
    """The decode side of one request."""

    def __init__(self, mgr: KvferryKVManager, bootstrap_addr: str, bootstrap_room: int | None = None, *args: Any, **kwargs: Any) -> None:
        self.mgr = mgr
        self.room = int(bootstrap_room or 0)
        self.kv_mgr = mgr  # the attribute name SGLang's decode scheduler reads
        self.abort_notified = False
        self.state = RecvRoom(self.room, str(bootstrap_addr))
        with mgr.lock:
            mgr.receivers[self.room] = self.state
        self._t0 = time.monotonic()

    def init(self, prefill_dp_rank: int = 0) -> None:
        threading.Thread(
            target=self.mgr.resolve, args=(self.state, int(prefill_dp_rank or 0)), name="kvferry-sglang-bootstrap", daemon=True
        ).start()

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        with self.mgr.lock:
            self.state.kv_indices = _ids(kv_indices)
            self.state.aux_index = None if aux_index is None else int(aux_index)
            self.mgr.maybe_send_meta(self.state)

    def poll(self) -> int:
        r = self.state
        if r.status == KVPoll.Bootstrapping and time.monotonic() - self._t0 > self.mgr.opts.bootstrap_timeout + 5:
            with self.mgr.lock:
                self.mgr.fail_recv(r, f"bootstrap did not finish within {self.mgr.opts.bootstrap_timeout:g} s", tell=False)
        return int(r.status)

    def failure_exception(self) -> None:
        raise KvferryTransferError(self.room, self.state.reason or self.state.failing or "failed")

    def abort(self) -> None:
        with self.mgr.lock:
            self.mgr.fail_recv(self.state, "aborted by decode")
        self.abort_notified = True

    def clear(self) -> None:
        self.mgr.drop_recv(self.room)
