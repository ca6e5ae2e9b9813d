"""The :class:`Engine`: kvferry for Python inference servers."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from . import _kvferry
from ._args import Key, _ids
from ._fetching import Fetching
from ._memory import byte_view, check_raw, detached, is_cuda_name, is_cuda_tensor, is_raw, layer_spans
from ._selection import Selection
from ._transfer import Transfer
from .errors import InvalidArgumentError

__all__ = ["DEFAULT_WAIT_SPIN_US", "DeviceMemory", "Engine", "Key", "Region", "Selection", "Transfer"]

Region = _kvferry.Region
DeviceMemory = _kvferry.DeviceMemory

DEFAULT_WAIT_SPIN_US = 200
"""Default ``Engine(wait_spin_us=...)``: how long a waiting thread polls before it sleeps."""


class Engine(Fetching):
    """A kvferry engine: serves this process's KV to peers and fetches theirs.

    ``Engine()`` listens on loopback on an ephemeral port; ``address`` says where.
    Use it as a context manager, or call :meth:`close`.

    Args:
        listen: ``"host:port"`` to serve on, or None for a client-only engine.
        secret: shared secret (str or bytes) peers must prove; None for no auth.
        arena_bytes: size of the pinned host staging arena.
        device: ``"host"`` (host memory only), ``"sim"``: a simulated accelerator
            (per-copy latency ``device_latency_us``, fault injection for tests), or
            ``"cuda:N"``: GPU N (a build with the ``cuda`` feature, ``kvferry.HAS_CUDA``;
            without a CUDA driver or GPU the constructor raises ``DeviceError``, in a
            build without the feature ``InvalidArgumentError``). Device memory comes from
            :meth:`alloc_device` or, on a cuda engine, from your own tensors: torch CUDA
            tensors, any ``__dlpack__`` object in CUDA memory, or raw
            ``(ptr, nbytes, "cuda:N")`` tuples, registered without copying by
            :meth:`register_kv_cache` / :meth:`register_kv_caches`. Published device
            blocks are gathered into staging pages (device-to-host, on kvferry's own
            stream) when a peer asks, received ones scattered from staging pages
            (host-to-device), each copy bounded by ``device_timeout``; finish your own
            writes to published blocks (e.g. ``torch.cuda.synchronize()``) before
            :meth:`publish`. A cuda engine's staging arena is CUDA pinned host memory
            (with ``pinned``). Device engines register host buffers too.
        peer_id: this engine's stable name (default: ``kvferry-<pid>-<random>``).
        page_size: staging page size.
        copy_threads: copy threads (default: the available cores).
        store_bytes, store_block_bytes: the copy-in store used by :meth:`put`.
        lease_ttl: TTL this engine asks for leases it stages on peers (seconds).
        ttl, max_ttl: TTL granted to peers' leases and publications by default, and
            at most (seconds).
        io_timeout: an I/O step making no progress for this long fails (seconds).
        connect_timeout: bound on connecting to a peer (seconds).
        connections_per_peer: pooled connections to each peer.
        pinned: ask for mlocked staging memory (falls back, and says so in stats).
        runtime_threads: threads of the engine's I/O runtime.
        shared_runtime: run on the process's shared I/O runtime of
            ``runtime_threads`` threads (every engine asking for a shared runtime of
            that size uses the same one; it starts with the first and stops when the
            last closes) instead of a runtime of its own. Several engines in one
            process (tests, benchmarks, a process with a prefill and a decode engine)
            then use one set of threads instead of taking turns on the same cores; an
            engine with its own runtime (False) is isolated from its neighbours'
            tasks. ``stats()["runtime"]`` says which it got.
        wait_spin_us: how long (microseconds) a thread waiting on a transfer
            (:meth:`Transfer.wait`, :meth:`get_blocking`, ...) polls for its outcome,
            with the GIL released and yielding its CPU to any runnable thread, before
            it sleeps; and how long after a transfer starts one runtime worker keeps
            polling for I/O instead of sleeping ("lingering"). A transfer that
            finishes within it (a miss, a small chunk) is then seen at once, not after
            sleeping threads' wake-ups (tens of microseconds each, more on virtual
            machines whose idle CPUs halt). The budget adapts: transfers taking longer
            than this shrink it to nothing (a throughput run spins no CPU), short
            ones grow it back. 0: never spin or linger.
        directory: where peers are found. ``{name: "host:port"}``: a static map of peers
            that may be named instead of addressed. ``"etcd://HOST:PORT[,HOST:PORT...]"``:
            the etcd peer directory (what ``kvferry serve --directory`` uses): a
            listening engine registers itself (``peer_id``, its address or
            ``advertise``, ``role``) on a lease of ``directory_ttl`` seconds; peers are
            then named by id, :meth:`peers` lists them and :meth:`locate` finds which
            hold a key. Transfers to a peer the directory reports restarted fail with
            ``PeerRestartedError``, to one it dropped with ``PeerLostError``, at once.
            Needs a build with the ``etcd`` feature (``kvferry.HAS_ETCD``).
        namespace: the etcd namespace (records live under ``NAME/peers/``).
        directory_ttl: TTL of this engine's etcd registration (seconds).
        role: ``"prefill"``, ``"decode"`` or ``"both"``, registered in the directory.
        advertise: the address registered in the directory (default: the bound one;
            required when listening on an unspecified address such as 0.0.0.0).
        device_latency_us: simulated time per device copy (``device="sim"``).
        device_timeout: bound on each device copy, from its submission (seconds).
        tls_cert, tls_key, tls_ca: PEM files of this engine's certificate chain, its
            private key and the CA that signs every peer's certificate: mutual TLS 1.3
            on every connection, in and out (what ``kvferry serve --tls-cert
            --tls-key --tls-ca`` uses; a peer without a certificate from that CA is
            refused with ``AuthError``). All three or none. With ``secret`` as well,
            the HMAC handshake runs inside TLS.
        store_capacity: most chunks the copy-in store holds (least recently used
            are evicted).
        lease_grace: how long an eager get's staged pages outlive its connection when
            it closes without ``Done`` (seconds; 0 releases them at once).
        max_gets: staging requests served at once; more get an immediate "busy" miss.
        peer_quota_pages: staging pages one peer may hold at once (default: half the
            arena), so that one peer cannot lock the whole arena.
        connection_quota_pages: staging pages the requests of one connection may hold
            (default: the peer quota).
        source_quota_pages: staging pages peers without a TLS certificate may hold
            from one source address (IPv6: a /64), whatever peer ids they claim
            (default: three quarters of the arena, or the peer quota if larger).
        unproven_quota_pages: staging pages all peers without a TLS certificate may
            hold together (default: seven eighths of the arena, or the peer quota).
        min_rate, min_rate_grace: a frame moving slower than ``min_rate`` bytes per
            second fails once it took longer than ``min_rate_grace`` seconds (0: off).
        idle_timeout: idle connections are closed after this long (seconds).
        max_connections: accepted connections at once; more are refused.
        max_control_bytes, max_bulk_bytes: the largest control frame and the largest
            bulk frame (chunk) accepted, in bytes.
        transport: ``"auto"`` (the default): a producer on this host is read straight
            from its memory (``process_vm_readv``: one copy, every chunk verified
            against the producer's checksums), the socket elsewhere or when the kernel
            refuses (the reason is in ``stats()["movers"]``); ``"tcp"``: every byte on
            the connection, as a producer and as a consumer.

    Each option's default and check live once, in the library
    (``kvferry::engine::EngineOptions``; ``_kvferry.EngineOptions.defaults()``): a
    bad value raises ``InvalidArgumentError`` naming the option.
    """

    def __init__(
        self,
        listen: str | None = "127.0.0.1:0",
        secret: str | bytes | None = None,
        arena_bytes: int = 64 << 20,
        device: str = "host",
        peer_id: str | None = None,
        *,
        page_size: int = 1 << 20,
        copy_threads: int | None = None,
        store_bytes: int = 64 << 20,
        store_block_bytes: int = 64 << 10,
        lease_ttl: float = 10.0,
        ttl: float = 10.0,
        max_ttl: float | None = None,
        io_timeout: float = 5.0,
        connect_timeout: float = 3.0,
        connections_per_peer: int = 4,
        pinned: bool = True,
        runtime_threads: int = 2,
        directory: Mapping[str, str] | str | None = None,
        device_latency_us: int = 0,
        device_timeout: float = 5.0,
        namespace: str = "kvferry",
        directory_ttl: float = 10.0,
        role: str = "both",
        advertise: str | None = None,
        wait_spin_us: int = DEFAULT_WAIT_SPIN_US,
        shared_runtime: bool = True,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        store_capacity: int = 100_000,
        lease_grace: float = 2.0,
        max_gets: int = 64,
        peer_quota_pages: int | None = None,
        connection_quota_pages: int | None = None,
        source_quota_pages: int | None = None,
        unproven_quota_pages: int | None = None,
        min_rate: int = 64 << 10,
        min_rate_grace: float = 5.0,
        idle_timeout: float = 300.0,
        max_connections: int = 4096,
        max_control_bytes: int = 1 << 20,
        max_bulk_bytes: int = 256 << 20,
        transport: str = "auto",
    ) -> None:
        device = str(device)  # also a torch.device
        if isinstance(secret, str):
            secret = secret.encode()
        etcd: str | None = None
        if isinstance(directory, str):
            if not directory.startswith("etcd://"):
                raise InvalidArgumentError(
                    f"directory {directory!r}: give a {{name: 'host:port'}} mapping or an "
                    "'etcd://HOST:PORT[,HOST:PORT...]' URL"
                )
            etcd, directory = directory, None
        self._directory = dict(directory or {})
        # Every value is checked once, by the library's options (kvferry::engine::
        # EngineOptions, which also holds each default; tests compare them with these
        # keywords'): a bad one raises InvalidArgumentError naming it.
        self._e = _kvferry.Engine(
            _kvferry.EngineOptions(
                listen=listen,
                secret=secret,
                arena_bytes=int(arena_bytes),
                page_size=int(page_size),
                peer_id=peer_id,
                copy_threads=copy_threads,
                store_bytes=int(store_bytes),
                store_block_bytes=int(store_block_bytes),
                store_capacity=store_capacity,
                lease_ttl=float(lease_ttl),
                ttl=float(ttl),
                max_ttl=None if max_ttl is None else float(max_ttl),
                lease_grace=lease_grace,
                max_gets=max_gets,
                peer_quota_pages=peer_quota_pages,
                connection_quota_pages=connection_quota_pages,
                source_quota_pages=source_quota_pages,
                unproven_quota_pages=unproven_quota_pages,
                io_timeout=float(io_timeout),
                connect_timeout=float(connect_timeout),
                connections_per_peer=int(connections_per_peer),
                min_rate=min_rate,
                min_rate_grace=min_rate_grace,
                idle_timeout=idle_timeout,
                max_connections=max_connections,
                max_control_bytes=max_control_bytes,
                max_bulk_bytes=max_bulk_bytes,
                transport=transport,
                pinned=bool(pinned),
                runtime_threads=runtime_threads,
                shared_runtime=bool(shared_runtime),
                device=device,
                device_latency_us=int(device_latency_us),
                device_timeout=float(device_timeout),
                etcd=etcd,
                namespace=namespace,
                directory_ttl=float(directory_ttl),
                role=role,
                advertise=advertise,
                wait_spin_us=wait_spin_us,
                tls_cert=None if tls_cert is None else os.fspath(tls_cert),
                tls_key=None if tls_key is None else os.fspath(tls_key),
                tls_ca=None if tls_ca is None else os.fspath(tls_ca),
            )
        )
        self.device = device
        self._cuda = is_cuda_name(device)

    # -- identity and lifecycle ---------------------------------------------------

    @property
    def address(self) -> str | None:
        """``"host:port"`` peers reach this engine on (None if client-only)."""
        return self._e.address

    @property
    def peer_id(self) -> str:
        """This engine's peer id."""
        return self._e.peer_id

    @property
    def incarnation(self) -> int:
        """Changes every time an engine starts: a restarted peer is a new incarnation."""
        return self._e.incarnation

    def stats(self) -> dict[str, Any]:
        """Every counter: ``arena``, ``producer``, ``consumer``, ``store``, ``copy``,
        ``server``, ``registered``, ``device``: kind, operations, stuck,
        memory_used on a sim engine; kind, device, name on a cuda engine; and
        ``runtime``: ``shared`` (the process's shared runtime or its own),
        ``threads``, ``engines`` (how many engines run on it) and ``linger_polls``
        (I/O polls a worker made lingering after short waits, see ``wait_spin_us``);
        absent once closed. ``consumer.bytes_received`` and ``producer.bytes_sent``
        count payload bytes on the wire (frame headers not counted): a selected get
        (:class:`Selection`) adds exactly its selected bytes to both. ``movers`` lists,
        per producer read from, the mover chosen (``"cma"`` or ``"socket"``), its
        ``fallback`` reason and ``pid``; ``consumer.cma_transfers`` and
        ``consumer.cma_bytes`` count same-host reads."""
        stats: dict[str, Any] = json.loads(self._e.stats_json())
        device = json.loads(self._e.device_stats_json())
        if device:
            stats["device"] = device
        rt = self._e.runtime_info()
        if rt is not None:
            stats["runtime"] = {"shared": rt[0], "threads": rt[1], "engines": rt[2], "linger_polls": rt[3]}
        return stats

    def close(self, timeout: float = 5.0) -> dict[str, Any]:
        """Stops serving, releases publications and staged leases, waits (at most
        ``timeout`` seconds) for transfers to drain and pages to come back, and returns
        what was still out (``clean`` is True when nothing was). Idempotent."""
        if self._e.closed:
            return {"outstanding_pages": 0, "quarantined_pages": 0, "draining_transfers": 0, "clean": True}
        return self._e.close(float(timeout))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Engine(peer_id={self.peer_id!r}, address={self.address!r})"

    # -- memory ----------------------------------------------------------------

    def alloc_device(self, nbytes: int, shape: Sequence[int] | None = None) -> DeviceMemory:
        """Allocates ``nbytes`` of device memory on a ``device="sim"`` engine (zeroed)
        or a ``"cuda:N"`` one (``cuMemAlloc``, not initialised, like ``torch.empty``).
        ``shape`` (optional, e.g. ``[2, num_blocks, ...]``) is how
        :meth:`register_kv_caches` reads its blocks. The memory is not addressable from
        Python: ``write(data, offset)`` and ``read(offset, n)`` copy synchronously."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgumentError(f"nbytes must be a positive int, got {nbytes!r}")
        dims = None if shape is None else [int(d) for d in shape]
        return self._e.alloc_device(nbytes, dims)

    def adopt_host_memory(self, obj: Any, *, name: str = "adopted", shape: Sequence[int] | None = None) -> DeviceMemory:
        """On a ``device="sim"`` engine: adopts host memory you already have (a
        writable buffer: torch CPU tensor, numpy array, ...) as the sim device's memory,
        without copying. Registered with :meth:`register_kv_caches`, it then moves
        through the device data path — staging pages, device-to-host and host-to-device
        copies on the sim device's streams, bounded event waits, injected faults —
        exactly as device memory would, so code written for an accelerator runs (and is
        tested) on a machine without one. ``shape`` (default: the object's) is how
        :meth:`register_kv_caches` reads its blocks. ``obj`` is kept alive while the
        memory is in use; do not write blocks a transfer owns."""
        if shape is None:
            raw = getattr(obj, "shape", None)
            shape = None if raw is None else tuple(raw)
        dims = None if shape is None else [int(d) for d in shape]
        # The byte view holds the object's buffer export, as host registration does.
        return self._e.adopt_host_memory(name, byte_view(obj, name), dims)

    def _as_device(self, obj: Any, what: str) -> DeviceMemory | None:
        """``obj`` as device memory of this engine, or None for host memory: a
        :class:`DeviceMemory`, or on a cuda engine a CUDA ``__dlpack__`` object (torch
        CUDA tensor) or a raw ``(ptr, nbytes, "cuda:N")`` tuple, wrapped without copying.
        A CUDA tensor on a host or sim engine is refused."""
        if isinstance(obj, DeviceMemory):
            return obj
        if self._cuda and is_raw(obj) and is_cuda_name(obj[2]):
            ptr, nbytes, dev = obj
            if not isinstance(nbytes, int) or nbytes <= 0:
                raise InvalidArgumentError(f"{what}: nbytes must be a positive int, got {nbytes!r}")
            if ptr <= 0 or ptr >= 1 << 64:
                raise InvalidArgumentError(f"{what}: ptr must be a non-null device address, got {ptr!r}")
            return self._e.wrap_device_ptr(what, ptr, nbytes, str(dev), None)
        if is_cuda_tensor(obj):
            if not self._cuda:
                raise InvalidArgumentError(
                    f"{what}: {type(obj).__name__} lives in CUDA device memory; register it on an "
                    f"Engine(device='cuda:N') (this engine's device is {self.device!r})"
                )
            return self._e.wrap_dlpack(what, detached(obj))
        return None

    def register_kv_cache(self, obj: Any, block_bytes: int, *, name: str = "kv") -> Region:
        """Registers one buffer of consecutive blocks of ``block_bytes`` each (a numpy
        array, bytearray, memoryview, mmap, torch CPU tensor, any ``__dlpack__``
        object, a raw ``(ptr, nbytes, "cpu")`` tuple, or device memory: a
        :class:`DeviceMemory`, and on a ``"cuda:N"`` engine a torch CUDA tensor, a
        ``__dlpack__`` object in CUDA memory of that GPU (C-contiguous) or a raw
        ``(ptr, nbytes, "cuda:N")`` tuple). The engine keeps the object alive until it
        is deregistered and every transfer touching it has drained (a raw tuple has no
        object: keep its memory alive yourself until then)."""
        if not isinstance(block_bytes, int) or block_bytes <= 0:
            raise InvalidArgumentError(f"block_bytes must be a positive int, got {block_bytes!r}")
        dev = self._as_device(obj, name)
        if dev is not None:
            obj = dev
            if obj.nbytes % block_bytes:
                raise InvalidArgumentError(
                    f"{name}: device memory of {obj.nbytes} bytes is not a whole number of {block_bytes}-byte blocks"
                )
            return self._e.register_device(name, [(obj, [(0, block_bytes, block_bytes)])], obj.nbytes // block_bytes)
        if is_raw(obj):
            ptr, nbytes = check_raw(obj, name)
            if nbytes % block_bytes:
                raise InvalidArgumentError(f"{name}: {nbytes} bytes is not a whole number of {block_bytes}-byte blocks")
            return self._e.register_raw(name, ptr, nbytes, [(0, block_bytes, block_bytes)], nbytes // block_bytes, None)
        mv = byte_view(obj, name)
        if mv.nbytes % block_bytes:
            raise InvalidArgumentError(
                f"{name}: buffer of {mv.nbytes} bytes is not a whole number of {block_bytes}-byte blocks"
            )
        return self._e.register_spans(name, [(mv, [(0, block_bytes, block_bytes)])], mv.nbytes // block_bytes)

    def register_kv_caches(self, caches: Mapping[str, Any], num_blocks: int | None = None, *, name: str = "kv") -> Region:
        """Registers per-layer paged caches (``{layer_name: tensor}``, vLLM's layout)
        as one region: block *i* spans every layer, in the mapping's order, K then V
        where a tensor is ``[2, num_blocks, ...]`` (else ``[num_blocks, ...]``)."""
        if not caches:
            raise InvalidArgumentError("no caches to register")
        devs = {layer: self._as_device(t, f"{name}[{layer}]") for layer, t in caches.items()}
        if any(d is not None for d in devs.values()):
            if not all(d is not None for d in devs.values()):
                raise InvalidArgumentError(f"{name}: device memory and host buffers cannot form one region")
            return self._register_device_layers(devs, num_blocks, name)
        parts = []
        blocks = num_blocks
        for layer, t in caches.items():
            what = f"{name}[{layer}]"
            mv = byte_view(t, what)
            raw_shape: Any = getattr(t, "shape", None) or memoryview(t).shape
            shape = tuple(raw_shape)
            nb, spans = layer_spans(mv.nbytes, shape, blocks, what)
            blocks = nb
            parts.append((mv, spans))
        assert blocks is not None
        return self._e.register_spans(name, parts, blocks)

    def _register_device_layers(self, caches: Mapping[str, Any], num_blocks: int | None, name: str) -> Region:
        dparts = []
        blocks = num_blocks
        for layer, mem in caches.items():
            what = f"{name}[{layer}]"
            shape = tuple(mem.shape) if mem.shape is not None else ((num_blocks,) if num_blocks else ())
            if not shape:
                raise InvalidArgumentError(f"{what}: device memory without a shape needs num_blocks")
            nb, spans = layer_spans(mem.nbytes, shape, blocks, what)
            blocks = nb
            dparts.append((mem, spans))
        assert blocks is not None
        return self._e.register_device(name, dparts, blocks)

    def register(self, obj: Any, *, name: str = "buffer") -> Region:
        """Registers a plain buffer (or device memory, as :meth:`register_kv_cache`
        takes it) as a region of one block."""
        dev = self._as_device(obj, name)
        if dev is not None:
            return self._e.register_device(name, [(dev, [(0, dev.nbytes, dev.nbytes)])], 1)
        mv = byte_view(obj, name)
        return self._e.register_spans(name, [(mv, [(0, mv.nbytes, mv.nbytes)])], 1)

    def deregister(self, region: Region, timeout: float = 5.0) -> None:
        """Deregisters ``region`` once nothing uses it, waiting at most ``timeout``
        seconds; raises ``InUseError`` if transfers or publications still hold it."""
        self._e.deregister(region, float(timeout))

    # -- offering KV -----------------------------------------------------------

    def publish(self, key: Key, region: Region, block_ids: Any, ttl: float | None = None, *, once: bool = True) -> None:
        """Publishes blocks of ``region`` under ``key``, zero copy: peers' gets read
        them straight from your memory. They are pinned — do not write them — until
        :meth:`released` reports the key: after a consumer's ``Done`` (``once``), after
        ``ttl`` seconds (default and cap: the engine's ``ttl``/``max_ttl``), or after
        :meth:`release`."""
        self._e.publish(key, region, _ids(block_ids), None if ttl is None else float(ttl), bool(once))

    def put(self, key: Key, data: Any) -> None:
        """Copies ``data`` into the engine's store under ``key`` (copy in: reuse
        ``data`` at once)."""
        self._e.put(key, byte_view(data, "put"))

    def release(self, key: Key) -> bool:
        """Releases a publication now (reported by :meth:`released` once its sends
        stopped). False if ``key`` is not published."""
        return self._e.unpublish(key)

    def released(self) -> list[tuple[Key, str]]:
        """``[(key, reason)]`` of publications released since the last call; reason is
        ``done``, ``declined`` (a consumer's ``release_remote``), ``expired``, ``released``,
        ``replaced`` or ``shutdown``."""
        return self._e.take_released()
