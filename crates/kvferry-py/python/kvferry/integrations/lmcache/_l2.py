# mypy: disable-error-code="import-untyped"
# mypy: allow-subclassing-any
# (lmcache ships no type information: its classes are Any here.)
"""LMCache's multiprocess (MP) mode: kvferry as an L2 adapter, :class:`KvferryL2Adapter`.

In MP mode an LMCache server process owns the KV cache; its storage manager keeps an L1
(a CPU memory arena) and hands L1 memory objects to *L2 adapters* to store and load. LMCache
loads an external adapter through its ``plugin`` adapter type::

    --l2-adapter '{"type": "plugin", "module_path": "kvferry.integrations.lmcache",
                   "class_name": "KvferryL2Adapter",
                   "adapter_params": {"server": "10.0.0.5:7070", "secret_file": "/etc/kvferry/secret"}}'

LMCache finds :class:`KvferryL2AdapterConfig` by its name (``class_name + "Config"``) and
builds it from ``adapter_params`` (the same settings as the remote tier's ``kvferry.*``
keys: :class:`~._options.RemoteOptions`).

How it moves bytes (the kvferry client calls are the remote tier's):

- **store**: each object's bytes are pushed into the peer's store straight from L1 (no
  Python copy) under a key that names the object's size (:func:`data_key`), then a
  16-byte size record (:func:`size_key`). Data first, so a lookup never finds the record
  without its data.
- **lookup**: one kvferry ``lookup`` round trip for the batch's size records; the hits
  are the leading keys held.
- **load**: one kvferry ``get`` round trip (cut into up to ``parallel`` concurrent
  transfers) straight into the L1 objects LMCache hands in: L1 is registered with the
  kvferry engine once (the allocator's aligned blocks, :class:`~._landing.Landing`), so
  the socket (or, for a peer on this host, ``process_vm_readv``) writes each chunk in
  place. The data key names the object's size, so a chunk stored for an object of
  another size is a miss (a shorter chunk would otherwise land and leave the object's
  tail stale).

The promises at LMCache's boundary:

- **Bounded.** Every kvferry call carries ``timeout`` (``adapter_params``); a load's
  transfers are waited for ``timeout`` plus a drain grace, then cancelled. A dead,
  hung (SIGSTOPped) or unreachable peer makes a task complete as failed (store) or as
  misses (lookup, load) within that bound, and LMCache's controllers go on. A store
  stops at its first failed push.
- **Never wrong bytes.** A load bit is set only for a chunk that landed whole, with
  kvferry's end-to-end checksum verified, and whose size matched. A restarted peer is
  empty: misses.
- **Memory handed back on every path.** A load task completes (its event fd is
  signalled) only after every transfer writing its objects has drained — a failed or
  timed-out transfer is cancelled, and ``Transfer.cancel`` returns only after the drain.
  A store task completes only after its pushes returned (they read the objects until
  then). ``close`` waits for the running tasks, deregisters L1 and closes the engine
  (its report is :attr:`KvferryL2Adapter.close_report`).
- **Refused secret.** A peer that refuses the secret (or TLS certificate) fails the
  adapter's construction with :class:`kvferry.AuthError` naming the peer and the
  setting, so the LMCache server does not start with a tier that can never work. An
  unreachable peer only warns.

``delete`` is not supported by a ``kvferry serve`` peer (it evicts by LRU, under its
``--blocks``); the adapter declares no capacity, so LMCache's global L2 eviction does
not call it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import struct
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Optional

from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

import kvferry

from ._landing import Landing
from ._options import PREFIX, RemoteOptions

logger = init_logger(__name__)

DRAIN_GRACE = 2.0
"""Seconds a load waits beyond ``timeout`` before it cancels its transfers."""

SIZE_SLOT = 16
"""Bytes of one size record."""

_SIZE_MAGIC = b"KVFL2S1\0"
_PROBE = "lmc-l2-probe"


def object_key_name(key: Any) -> str:
    """A stable name of an LMCache ``ObjectKey``: model, rank, group, salt, chunk hash."""
    return f"{key.model_name}@{key.kv_rank}@{key.object_group_id}@{key.cache_salt}@{bytes(key.chunk_hash).hex()}"


def data_key(key: Any, size: int) -> str:
    """The kvferry key holding the bytes of an object of ``size`` bytes: the size is part
    of the key, so a load into an object of another size is a miss, never a short
    landing that would leave the object's tail stale."""
    return f"lmc-l2/{size}/" + object_key_name(key)


def size_key(key: Any) -> str:
    """The kvferry key of an object's size record (:func:`encode_size`), pushed after its
    data: what a lookup asks for."""
    return "lmc-l2-size/" + object_key_name(key)


def encode_size(n: int) -> bytes:
    """The size record of an ``n``-byte object."""
    return _SIZE_MAGIC + struct.pack("<Q", n)


def decode_size(rec: bytes) -> Optional[int]:
    """The size in a record, or None if ``rec`` is not one."""
    if len(rec) < SIZE_SLOT or rec[: len(_SIZE_MAGIC)] != _SIZE_MAGIC:
        return None
    return int(struct.unpack_from("<Q", rec, len(_SIZE_MAGIC))[0])


class KvferryL2AdapterConfig(L2AdapterConfigBase):
    """The adapter's settings, from LMCache's ``adapter_params`` (a dict).

    Keys as the remote tier's ``kvferry.*`` options, without the prefix: ``server``
    (required: ``HOST:PORT`` of a ``kvferry serve``, or a peer id with ``directory``),
    ``secret`` / ``secret_file``, ``timeout`` (seconds, default 5: the bound on every
    call), ``connect_timeout``, ``threads`` (concurrent tasks, default 4), ``parallel``
    (concurrent transfers a load is cut into), ``transport`` (``auto``/``tcp``),
    ``directory``, ``tls_cert``/``tls_key``/``tls_ca``. An unknown key or a bad value is
    a ``ValueError`` naming it (LMCache prints it with :meth:`help`).
    """

    def __init__(self, options: RemoteOptions) -> None:
        self.options = options

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KvferryL2AdapterConfig":
        params = {k: v for k, v in d.items() if k != "type"}
        try:
            opts = RemoteOptions.from_config(SimpleNamespace(extra_config={PREFIX + k: v for k, v in params.items()}))
        except ValueError as e:
            raise ValueError(f"kvferry L2 adapter_params: {e}".replace("kvferry.", "")) from e
        return cls(opts)

    @classmethod
    def help(cls) -> str:
        return (
            "kvferry L2 adapter (type plugin, module_path kvferry.integrations.lmcache, class_name KvferryL2Adapter); "
            "adapter_params: server (HOST:PORT, required), secret or secret_file, timeout (s, default 5), "
            "connect_timeout, threads, parallel, transport (auto|tcp), directory, tls_cert/tls_key/tls_ca"
        )


class KvferryL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over a kvferry peer (see the module docs).

    Built by LMCache's plugin factory as ``KvferryL2Adapter(config, l1_memory_desc=...)``
    where ``config`` is a :class:`KvferryL2AdapterConfig` (or the raw ``adapter_params``
    dict). Thread-safe: LMCache's store and prefetch controllers call it from their
    threads; every task runs on the adapter's own threads and signals its event fd.
    """

    def __init__(self, config: KvferryL2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)
        if isinstance(config, dict):
            config = KvferryL2AdapterConfig.from_dict(config)
        self.opts = config.options
        self.engine = self.opts.client_engine()
        align = int(getattr(l1_memory_desc, "align_bytes", 0) or 4096)
        self._landing = Landing(self.engine, align)
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stores: dict[int, L2StoreResult] = {}
        self._lookups: dict[int, Any] = {}
        self._loads: dict[int, Any] = {}
        self._healthy = True
        self._closed = False
        self.close_report: dict[str, Any] = {}
        """The engine's close report (``clean``, ``outstanding_pages``, ...), once closed."""
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, self.opts.threads), thread_name_prefix="kvferry-l2")
        try:
            self._check_server()
        except BaseException:
            self._teardown()
            raise

    # -- start-up -------------------------------------------------------------

    def _check_server(self) -> None:
        try:
            self.engine.lookup(self.opts.server, [_PROBE], timeout=self.opts.timeout)
        except kvferry.AuthError as e:
            what = "TLS certificate or secret" if self.opts.tls_cert is not None else "secret"
            raise kvferry.AuthError(
                f"kvferry L2 adapter: server {self.opts.server} refused this client's {what} ({e}); "
                "set adapter_params secret / secret_file to the secret the server was started with"
                + (" and tls_cert/tls_key/tls_ca to certificates the server trusts" if self.opts.tls_cert else "")
            ) from e
        except kvferry.Error as e:
            self._healthy = False
            logger.warning("kvferry L2 adapter: server %s not reachable yet (%s); tasks are misses until it is", self.opts.server, e)

    # -- event fds ---------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- tasks -------------------------------------------------------------------

    def _submit(self, work: Callable[[int], None]) -> int:
        tid = next(self._ids)
        if self._closed:
            raise kvferry.ClosedError("kvferry L2 adapter is closed")
        self._pool.submit(work, tid)
        return tid

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        """Pushes each object (data, then its size record) to the peer; the task fails
        at its first failed push (the rest are not tried)."""
        items = list(zip(keys, objects, strict=True))
        return self._submit(lambda tid: self._store(tid, items))

    def _store(self, tid: int, items: list[tuple[Any, Any]]) -> None:
        stored: list[Any] = []
        sizes: list[int] = []
        ok = True
        try:
            for key, obj in items:
                n = int(obj.get_size())
                self.engine.push(self.opts.server, data_key(key, n), obj.byte_array, timeout=self.opts.timeout)
                self.engine.push(self.opts.server, size_key(key), encode_size(n), timeout=self.opts.timeout)
                stored.append(key)
                sizes.append(n)
            self._healthy = True
        except kvferry.Error as e:
            ok = False
            self._healthy = False
            logger.warning("kvferry L2 adapter: store of %d object(s) failed after %d (%s)", len(items), len(stored), e)
        except Exception:  # a bug must not leave the task pending for ever
            ok = False
            logger.exception("kvferry L2 adapter: store task %d failed", tid)
        with self._lock:
            self._stores[tid] = L2StoreResult(ok, sum(sizes))
        if stored:
            self._notify_keys_stored(stored, sizes)
        self._store_efd.notify()

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> int:
        """Looks the keys up in one round trip; the hits are the leading keys whose
        size record (pushed after the data) the peer holds. (A ``kvferry serve`` has no locks: a chunk
        it evicts before the load is a load miss.)"""
        keys = list(keys)
        return self._submit(lambda tid: self._lookup(tid, keys))

    def _lookup(self, tid: int, keys: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            if keys:
                hits = self.engine.lookup(self.opts.server, [size_key(k) for k in keys], timeout=self.opts.timeout)
                for i in range(hits):
                    bitmap.set(i)
            self._healthy = True
        except kvferry.Error as e:
            self._healthy = False
            logger.warning("kvferry L2 adapter: lookup of %d key(s) failed (%s): misses", len(keys), e)
        except Exception:
            logger.exception("kvferry L2 adapter: lookup task %d failed", tid)
        with self._lock:
            self._lookups[tid] = bitmap
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        """Nothing to do: the adapter takes no locks (see :meth:`submit_lookup_and_lock_task`)."""
        return None

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        """Loads the keys' bytes straight into ``objects`` (L1); the bitmap marks every
        object that received its whole chunk, checksummed, stored for an object of its
        size. Signalled only after every transfer into ``objects`` drained."""
        items = list(zip(keys, objects, strict=True))
        return self._submit(lambda tid: self._load(tid, items))

    def _load(self, tid: int, items: list[tuple[Any, Any]]) -> None:
        bitmap = Bitmap(len(items))
        landed: list[Any] = []
        try:
            for i in self._load_into(items):
                bitmap.set(i)
                landed.append(items[i][0])
        except kvferry.Error as e:
            self._healthy = not isinstance(e, (kvferry.TimeoutError, kvferry.PeerLostError))
            logger.warning("kvferry L2 adapter: load of %d object(s) failed (%s): misses", len(items), e)
        except Exception:
            logger.exception("kvferry L2 adapter: load task %d failed", tid)
        if landed:
            self._notify_keys_accessed(landed)
        with self._lock:
            self._loads[tid] = bitmap
        self._load_efd.notify()

    def _load_into(self, items: list[tuple[Any, Any]]) -> list[int]:
        """Indexes of ``items`` whose object received its chunk; returns only once no
        transfer writes any of the objects."""
        if not items:
            return []
        regions: list[Any] = []
        plan: list[tuple[int, list[int]]] = []  # (index, block ids), one region
        for i, (key, obj) in enumerate(items):
            place = self._landing.place(obj, int(obj.get_size()))
            if place is None or (regions and place[0] is not regions[0]):
                logger.warning("kvferry L2 adapter: %s cannot be landed in place in L1: miss", key)
                break
            regions.append(place[0])
            plan.append((i, place[1]))
        if not plan:
            return []
        region = regions[0]
        step = -(-len(plan) // max(1, min(self.opts.parallel, len(plan))))
        pieces = [plan[s : s + step] for s in range(0, len(plan), step)]
        transfers = [
            self.engine.get(self.opts.server, [data_key(items[i][0], int(items[i][1].get_size())) for i, _ in p], region, [b for _, b in p], timeout=self.opts.timeout)
            for p in pieces
        ]
        out: list[int] = []
        first_error: Optional[BaseException] = None
        deadline = time.monotonic() + self.opts.timeout + DRAIN_GRACE
        for p, t in zip(pieces, transfers):
            try:
                n = t.wait(max(0.0, deadline - time.monotonic()))
                out += [i for i, _ in p[:n]]
            except kvferry.NotFoundError:
                pass
            except kvferry.Error as e:
                first_error = first_error or e
        for t in transfers:  # a failed or late transfer may still write: cancel, which returns after its drain
            if t.result is None:
                self._drain(t)
        if first_error is not None and not out:
            raise first_error
        return out

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            return self._loads.pop(task_id, None)

    def _drain(self, t: kvferry.Transfer) -> None:
        """Cancels ``t`` and returns once nothing writes its blocks. A drain slower than
        the grace is logged and waited for: L1 memory is never handed back under a
        writer."""
        while not t.cancel(DRAIN_GRACE):
            logger.error("kvferry L2 adapter: a cancelled transfer is still draining after %.1f s; waiting (L1 stays held)", DRAIN_GRACE)

    # -- status and close ------------------------------------------------------------

    def report_status(self) -> dict[str, Any]:
        return {"is_healthy": self._healthy, "type": "KvferryL2Adapter", "server": self.opts.server, "closed": self._closed}

    def close(self) -> None:
        """Waits for the running tasks (each bounded by its deadline), deregisters L1,
        closes the engine and the event fds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._landing.close(self.opts.timeout)
        report = self.engine.close(self.opts.timeout)
        self.close_report = report
        if report.get("clean", True):
            logger.info("kvferry L2 adapter: closed clean (%s)", report)
        else:
            logger.warning("kvferry L2 adapter: engine closed with %s", report)
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()

    def __repr__(self) -> str:
        return f"<KvferryL2Adapter server={self.opts.server}>"
