# mypy: disable-error-code="import-untyped"
# mypy: allow-subclassing-any
# (lmcache ships no type information: its classes are Any here.)
"""LMCache's remote KV tier over a kvferry peer: :class:`KvferryRemoteConnector`.

LMCache hands a remote connector its memory objects (``MemoryObj``: one chunk of KV in
LMCache's CPU buffer). ``put`` pushes the object's bytes into the peer's store straight
from that buffer (no Python copy), plus a small metadata chunk (shapes, dtypes, format,
length) under a derived key. ``get`` fetches the metadata, allocates the object with
``local_cpu_backend.allocate`` and has kvferry's socket write the chunk straight into
it: LMCache's CPU buffer is registered with the engine once (a region of the
allocator's aligned blocks), so a get lands in place, zero copy. ``exists`` and the
batched contains use kvferry's ``lookup`` (one round trip for a whole prefix).

Semantics:

- Every call is bounded by ``kvferry.timeout`` (plus a small drain bound): a dead,
  hung or restarted server is a miss (``None`` / ``False`` / 0) or a logged error
  within it, never a hang. The engine stays usable; the next call tries again.
- A chunk is returned only once it landed whole and checksummed (kvferry verifies
  every chunk on the wire); the metadata says how long it is, and a chunk the server
  evicted (or lost by restarting) is a miss. A server restarted empty is all misses.
- A wrong secret is an ``IrrecoverableException`` at start-up (LMCache's signal for a
  configuration error), with a message naming the server and the option.

Cancellation: LMCache cancels a ``get`` that exceeded its ``blocking_timeout_secs``
(``future.cancel()`` on the coroutine). A cancelled ``get``/``put`` returns only after
the kvferry transfer touching the memory object has stopped (``Transfer.cancel`` drains
it; a push runs to its own deadline), however often it is cancelled; only then is an
allocated object released and the cancellation re-raised. Buffers are never handed back
to LMCache's allocator while a socket may still write them.

Its parts, one module each: the settings (:mod:`._options`), a chunk's keys and
metadata record (:mod:`._records`), landing a get in LMCache's buffer
(:mod:`._landing`), and waits that outlast cancellation (:mod:`._settle`, shared with
the transfer channel). This module is the connector LMCache calls, and the adapter
that makes LMCache build it for ``kvferry://`` URLs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, List, Optional, TypeVar

import numpy as np
import torch
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

import kvferry

from ._landing import Landing
from ._options import RemoteOptions
from ._records import META_SLOT, data_key, decode_meta, encode_meta, meta_key
from ._settle import as_future, settle

logger = init_logger(__name__)

T = TypeVar("T")

_DRAIN_GRACE = 2.0


class KvferryRemoteConnector(RemoteConnector):
    """LMCache remote connector over a kvferry peer (see the module docs).

    LMCache constructs it as a remote storage plugin: ``(loop, local_cpu_backend,
    config)``; :class:`KvferryConnectorAdapter` also passes the URL.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any, url: Optional[str] = None):
        super().__init__(config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.opts = RemoteOptions.from_config(config, url)
        self.engine = self.opts.client_engine()
        self._pool = concurrent.futures.ThreadPoolExecutor(self.opts.threads, thread_name_prefix="kvferry-lmc")
        align = int(getattr(getattr(local_cpu_backend, "memory_allocator", None), "align_bytes", 0) or 4096)
        self._landing = Landing(self.engine, align)
        self._closed = False
        self._check_server()

    # -- start-up ---------------------------------------------------------------

    def _check_server(self) -> None:
        """A wrong secret fails start-up; an unreachable server only warns (every call
        is then a miss until it answers)."""
        try:
            self.engine.lookup(self.opts.server, ["lmc-probe"], timeout=self.opts.timeout)
        except kvferry.AuthError as e:
            self.engine.close(1.0)
            self._pool.shutdown(wait=False)
            if self.opts.tls_cert is not None:
                why = (
                    f"kvferry remote tier: server {self.opts.server} refused this client's TLS certificate or secret ({e}); "
                    "kvferry.tls_cert must be signed by the CA the server trusts (--tls-ca), kvferry.tls_ca must be the CA "
                    "that signed the server's, and kvferry.secret must be the server's secret if it has one"
                )
            else:
                why = (
                    f"kvferry remote tier: server {self.opts.server} refused this client's secret ({e}); "
                    "set kvferry.secret / kvferry.secret_file to the secret the server was started with"
                )
            raise IrrecoverableException(why) from e
        except kvferry.Error as e:
            logger.warning("kvferry remote tier: server %s not reachable yet (%s); calls are misses until it is", self.opts.server, e)

    # -- helpers ------------------------------------------------------------------

    def _run(self, fn: Callable[[], T]) -> "asyncio.Future[T]":
        return asyncio.wrap_future(self._pool.submit(fn))

    def _lookup(self, keys: list[str]) -> int:
        return self.engine.lookup(self.opts.server, keys, timeout=self.opts.timeout)

    @staticmethod
    def _pairs(keys: List[CacheEngineKey]) -> list[str]:
        out: list[str] = []
        for k in keys:
            out += [meta_key(k), data_key(k)]
        return out

    # -- RemoteConnector ------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.batched_async_contains("", [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        if not keys:
            return 0
        try:
            return self._lookup(self._pairs(keys)) // 2
        except kvferry.Error as e:
            logger.warning("kvferry remote tier: lookup failed (%s): reporting misses", e)
            return 0

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        if not keys:
            return 0
        return await settle(self._run(lambda: self.batched_contains(keys)))

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            await settle(self._run(lambda: self._lookup(["lmc-probe"])))
            return 0
        except kvferry.Error:
            return 1

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        """Pushes each object (data first, then its metadata, so a reader never sees
        metadata without data); the objects are read until the call returns."""
        items = [(k, o, encode_meta(o)) for k, o in zip(keys, memory_objs, strict=True)]

        def push_all() -> None:
            for key, obj, meta in items:
                data = obj.byte_array
                self.engine.push(self.opts.server, data_key(key), data, timeout=self.opts.timeout)
                self.engine.push(self.opts.server, meta_key(key), meta, timeout=self.opts.timeout)

        try:
            await settle(self._run(push_all))
        except kvferry.Error as e:
            logger.warning("kvferry remote tier: put of %d chunk(s) failed: %s", len(items), e)

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """The objects of ``keys``: a prefix that landed whole, ``None`` after it."""
        out: List[Optional[MemoryObj]] = [None] * len(keys)
        if not keys or self._closed:
            return out
        try:
            metas = await self._get_metas(keys)
        except kvferry.NotFoundError:
            return out
        except kvferry.Error as e:
            logger.warning("kvferry remote tier: get failed (%s): miss", e)
            return out
        objs: list[MemoryObj] = []
        places: list[tuple[Any, list[int]]] = []
        for length, shapes, dtypes, fmt in metas:
            obj = self.local_cpu_backend.allocate(shapes, dtypes, fmt)
            if obj is None:
                break
            place = self._landing.place(obj, length) if obj.get_size() >= length else None
            if place is None or (places and place[0] is not places[0][0]):
                obj.ref_count_down()
                break
            objs.append(obj)
            places.append(place)
        if not objs:
            return out
        landed = 0
        try:
            landed = await self._get_data([data_key(k) for k in keys[: len(objs)]], places)
        except kvferry.NotFoundError:
            landed = 0
        except kvferry.Error as e:
            logger.warning("kvferry remote tier: get of %d chunk(s) failed (%s): miss", len(objs), e)
            landed = 0
        except BaseException:
            # cancelled: _get_data returned only after every transfer drained
            for o in objs:
                o.ref_count_down()
            raise
        for i, o in enumerate(objs):
            if i < landed:
                out[i] = o
            else:
                o.ref_count_down()
        return out

    async def _get_metas(self, keys: List[CacheEngineKey]) -> list[tuple[int, list[torch.Size], list[torch.dtype], MemoryFormat]]:
        buf = np.zeros(len(keys) * META_SLOT, dtype=np.uint8)
        region = self.engine.register_kv_cache(buf, block_bytes=META_SLOT, name="lmc-meta")
        try:
            t = self.engine.get(
                self.opts.server,
                [meta_key(k) for k in keys],
                region,
                [[i] for i in range(len(keys))],
                timeout=self.opts.timeout,
            )
            n = await self._await_transfer(t)
        finally:
            # Only after the transfer stopped (settle drained it): the region is quiet.
            self.engine.deregister(region, timeout=self.opts.timeout)
        metas = []
        for i in range(n):
            try:
                metas.append(decode_meta(buf[i * META_SLOT : (i + 1) * META_SLOT].tobytes()))
            except (ValueError, KeyError) as e:
                logger.warning("kvferry remote tier: bad metadata record for %s (%s): miss", keys[i], e)
                break
        return metas

    async def _get_data(self, keys: list[str], places: list[tuple[Any, list[int]]]) -> int:
        """Gets ``keys`` into their places as up to ``parallel`` concurrent transfers
        (over the engine's pooled connections); returns the leading chunks landed. A
        failing piece cancels its siblings and waits for their drain before raising;
        a cancel of the caller does the same before re-raising."""
        region = places[0][0]
        step = -(-len(keys) // max(1, min(self.opts.parallel, len(keys))))
        transfers = [
            self.engine.get(self.opts.server, keys[s : s + step], region, [p[1] for p in places[s : s + step]], timeout=self.opts.timeout)
            for s in range(0, len(keys), step)
        ]

        def cancel_all() -> None:
            # A failed transfer can be done while it still drains (its fence): cancel()
            # returns only after the drain, so it is called on every transfer that did
            # not succeed, done or not.
            for t in transfers:
                if not t.done() or t.error is not None:
                    t.cancel()

        async def run() -> int:
            futs = [asyncio.ensure_future(self._bounded(t)) for t in transfers]
            done, pending = await asyncio.wait(futs, return_when=asyncio.FIRST_EXCEPTION)
            if pending:  # one failed: stop the siblings, then wait for all of them
                await asyncio.to_thread(cancel_all)
                await asyncio.wait(pending)
            errors = [f.exception() for f in futs]  # every outcome retrieved (no "never retrieved" log)
            if any(e is not None for e in errors):
                await asyncio.to_thread(cancel_all)  # returns once every failed one drained
            total = 0
            for f, err in zip(futs, errors):  # the prefix: stop at the first piece that did not land whole
                if err is not None:
                    if total == 0:
                        raise err
                    break
                n = f.result()
                total += n
                if n < step:
                    break
            return total

        return await settle(run(), on_cancel=lambda: self._pool.submit(cancel_all))

    async def _bounded(self, t: kvferry.Transfer) -> int:
        try:
            return await asyncio.wait_for(asyncio.shield(as_future(t)), self.opts.timeout + _DRAIN_GRACE)
        except asyncio.TimeoutError:
            await asyncio.to_thread(t.cancel)
            raise kvferry.TimeoutError(f"kvferry remote tier: get from {self.opts.server} outlived its deadline") from None

    async def _await_transfer(self, t: kvferry.Transfer) -> int:
        """The transfer's result; bounded by ``timeout`` plus a drain grace; a cancel
        of the caller, or a failure, cancels the transfer and waits until it drained."""

        async def bounded() -> int:
            try:
                return await self._bounded(t)
            except BaseException:
                await asyncio.to_thread(t.cancel)  # a failed transfer may still drain
                raise

        return await settle(bounded(), on_cancel=lambda: self._pool.submit(t.cancel))

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        got = await self.batched_get(keys)
        out: List[MemoryObj] = []
        for o in got:
            if o is None:
                break
            out.append(o)
        return out

    async def list(self) -> List[str]:
        return []

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return False

    async def close(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self.engine.close(self.opts.timeout)

    def __repr__(self) -> str:
        return f"<KvferryRemoteConnector server={self.opts.server}>"


class KvferryConnectorAdapter(ConnectorAdapter):
    """Makes LMCache create :class:`KvferryRemoteConnector` for ``kvferry://HOST:PORT``
    URLs and for ``plugin://kvferry`` (the server then comes from ``kvferry.server``)."""

    def __init__(self) -> None:
        super().__init__("kvferry://")

    def can_parse(self, url: str) -> bool:
        return url.startswith("kvferry://") or url == "plugin://kvferry" or url.startswith("plugin://kvferry.")

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        url = context.url if context.url.startswith("kvferry://") else None
        return KvferryRemoteConnector(context.loop, context.local_cpu_backend, context.config, url=url)
