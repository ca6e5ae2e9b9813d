"""Typed stubs of ``kvferry._kvferry``, the PyO3 extension module (``src/*.rs``).

This is the low-level layer: :mod:`kvferry` (``_engine.py``) wraps it with defaults,
argument checking and friendlier shapes. Parameter names are the Rust ones (PyO3
accepts them as keywords). Every parameter without a default here is required by the
extension, ``None`` included where the type allows it.

Keys: a ``str`` (hashed into a chunk key) or exactly 32 ``bytes`` (used as is); the
extension raises ``kvferry.InvalidArgumentError`` for anything else. Lists of keys must
be real ``list`` objects. Durations are seconds (positive, finite).
"""

import builtins
from collections.abc import Callable, Sequence
from typing import Any, final

from typing_extensions import Buffer

_Key = str | bytes
_Span = tuple[int, int, int]  # (offset, stride, length) in bytes

__all__ = [
    "Engine",
    "EngineOptions",
    "Region",
    "Transfer",
    "Staged",
    "DeviceMemory",
    "BlockIds",
    "key_bytes",
    "check_block_ids",
    "check_selection",
    "crc32c",
    "dlpack_info",
    "bounded_wait",
    "CompletionEvent",
    "_bounded_wait_stats",
    "__version__",
    "HAS_ETCD",
    "HAS_CUDA",
    "ERROR_CODES",
    "ERROR_CLASSES",
    "Error",
    "InvalidArgumentError",
    "TimeoutError",
    "CancelledError",
    "PeerLostError",
    "PeerRestartedError",
    "AuthError",
    "BusyError",
    "NotFoundError",
    "LeaseExpiredError",
    "ChecksumError",
    "InUseError",
    "ClosedError",
    "DeviceError",
    "SelectionError",
]

__version__: str
"""The crate's version (``CARGO_PKG_VERSION``)."""
HAS_ETCD: bool
"""Whether this build can use an etcd peer directory (cargo feature ``etcd``)."""
HAS_CUDA: bool
"""Whether this build can open ``Engine(device="cuda:N")`` (cargo feature ``cuda``; the
driver is loaded at run time, so a machine without a GPU still refuses to open one)."""
ERROR_CODES: list[str]
"""Every error code (``Error.code``'s possible values), in a fixed order."""
ERROR_CLASSES: list[str]
"""The names of the exception classes below, base first."""

# The exception classes are created by the extension from one list (src/errors.rs).
class Error(Exception):
    code: str
    peer: str | None
    key: str | None
    op: str | None
    waited: float | None
    dirty: bool

class InvalidArgumentError(Error, ValueError): ...
class TimeoutError(Error, builtins.TimeoutError): ...  # noqa: A001 - deliberately shadows
class CancelledError(Error): ...
class PeerLostError(Error, ConnectionError): ...
class PeerRestartedError(Error): ...
class AuthError(Error, PermissionError): ...
class BusyError(Error): ...
class NotFoundError(Error, LookupError): ...
class LeaseExpiredError(Error): ...
class ChecksumError(Error): ...
class InUseError(Error): ...
class ClosedError(Error): ...
class DeviceError(Error): ...
class SelectionError(InvalidArgumentError): ...


def key_bytes(key: _Key) -> bytes:
    """The 32-byte chunk key the engine uses for ``key``: a ``str`` hashed, 32 bytes as is."""

_Selection = tuple[list[int] | None, list[tuple[int, int]] | None, list[tuple[int, int]] | None]

def check_selection(
    blocks: list[int] | None, src_ranges: list[tuple[int, int]] | None, dst_ranges: list[tuple[int, int]] | None
) -> None:
    """Checks a selection's lists as ``kvferry.Selection`` builds them; raises
    ``SelectionError``."""

@final
class BlockIds:
    """A block-id list :func:`check_block_ids` checked and converted; the engine's
    methods take it without walking the ids again. Immutable."""
    def __len__(self) -> int: ...
    def tolist(self) -> list[int]:
        """The ids as a list."""

def check_block_ids(ids: list[int], what: str) -> BlockIds:
    """Checks a non-empty list of block ids in ``0..2**32`` (ints or ``__index__``
    objects) and returns them converted; raises ``InvalidArgumentError`` naming
    ``what`` and the first bad one."""

def crc32c(data: Buffer) -> int:
    """crc32c (Castagnoli) of a C-contiguous buffer, the wire's checksum; the GIL is
    released while it runs."""

def dlpack_info(obj: object) -> tuple[int, int, int, int, list[int]]:
    """Test hook (not API): ``(ptr, nbytes, device_type, device_id, shape)`` of what
    ``obj.__dlpack__()`` exports (``ptr`` includes ``byte_offset``). Raises
    ``InvalidArgumentError`` for a tensor that is not C-contiguous, is empty, or has
    elements that are not whole bytes."""

@final
class Region:
    """A registered KV cache (from ``Engine.register_spans``/``register_raw``).

    Holds the registration and, through it, the Python objects whose memory it uses.
    Not constructible from Python.
    """

    @property
    def name(self) -> str:
        """The region's name."""
    @property
    def num_blocks(self) -> int:
        """Blocks in the region."""
    @property
    def block_bytes(self) -> int:
        """Bytes of one block (across every buffer of the region)."""
    @property
    def readonly(self) -> bool:
        """True when the memory is read-only (publishable, not a destination)."""
    @property
    def device(self) -> str:
        """Where the memory lives: ``"host"``, or the device kind (``"sim"``, ``"cuda"``)."""
    @property
    def users(self) -> int:
        """Transfers and publications holding the region right now."""

@final
class DeviceMemory:
    """Device memory from ``Engine.alloc_device`` (a sim or cuda engine), or wrapped
    by ``Engine.wrap_dlpack`` / ``wrap_device_ptr`` (a cuda engine; it holds the wrapped
    object until it and every transfer touching it are gone). Not addressable from
    Python: ``write`` and ``read`` copy synchronously, outside stream order. Not
    constructible from Python."""

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
    @property
    def device(self) -> str:
        """The device kind (``"sim"`` or ``"cuda"``)."""
    @property
    def shape(self) -> list[int] | None:
        """The shape given at allocation or exported by the wrapped tensor, or None."""
    def write(self, data: Buffer, offset: int = 0) -> None:
        """Copies ``data`` (a C-contiguous buffer) to ``offset``."""
    def read(self, offset: int = 0, n: int | None = None) -> bytes:
        """``n`` bytes at ``offset`` (default: to the end)."""

@final
class Transfer:
    """A transfer in flight (from ``Engine.get``). Not constructible from Python."""

    def wait(self, timeout: float | None = None) -> int:
        """Waits (at most ``timeout`` seconds; ``None``: no bound) and returns the chunks
        landed. Raises the transfer's error, or ``kvferry.TimeoutError`` when ``timeout``
        passed first (the transfer goes on). Ctrl-C cancels it, waits for the drain, and
        raises ``KeyboardInterrupt``. The GIL is released while waiting."""
    def done(self) -> bool:
        """True once the transfer finished (landed or failed)."""
    def drained(self) -> bool:
        """True once nothing writes the destination any more (never blocks); a failed
        transfer can be done and not yet drained."""
    def cancel(self, timeout: float | None = None) -> bool:
        """Cancels and returns after the drain: True, or False if the drain outlived
        ``timeout`` (default 10 s; 0: at once; it goes on in the background)."""
    @property
    def error(self) -> BaseException | None:
        """The transfer's exception if it failed, else None (also None while running)."""
    @property
    def result(self) -> int | None:
        """Chunks landed, once finished successfully; else None."""
    def add_done_callback(self, callback: Callable[[], object]) -> None:
        """Calls ``callback()`` once the transfer finished (from an engine thread,
        holding the GIL); at once if it already has."""

@final
class Staged:
    """A staged lease on a peer (delayed pull), from ``Engine.stage``. Not
    constructible from Python."""

    @property
    def peer(self) -> str:
        """The peer holding the lease."""
    @property
    def incarnation(self) -> int:
        """The peer's incarnation that granted it."""
    @property
    def chunks(self) -> int:
        """Chunks staged (a prefix of the keys asked for; with a selection, every key)."""
    @property
    def selected_bytes(self) -> int | None:
        """Bytes staged for a selection (what a resolve moves), else None."""
    @property
    def ttl_left(self) -> float:
        """Seconds left on the lease (by this side's conservative clock)."""

@final
class EngineOptions:
    """Everything an engine is started with: a thin wrapper over the library's
    ``kvferry::engine::EngineOptions``, where each option's name, type, default and
    check are declared once (see ``kvferry.Engine`` for each option). An unknown
    name or a value of the wrong type raises ``InvalidArgumentError`` naming it."""

    def __new__(cls, **options: Any) -> EngineOptions: ...
    @staticmethod
    def defaults() -> dict[str, Any]:
        """The library's defaults, ``{name: value}`` (durations in seconds)."""
    def as_dict(self) -> dict[str, Any]:
        """These options, ``{name: value}`` (durations in seconds, the secret hidden)."""

@final
class Engine:
    """The kvferry engine. It owns a tokio runtime; every call that waits or copies
    releases the GIL."""

    def __new__(cls, options: EngineOptions) -> Engine:
        """Starts an engine (listening on ``listen``, or client-only for None);
        ``device`` is ``"host"``, ``"sim"`` (a simulated accelerator) or ``"cuda"`` /
        ``"cuda:N"`` (GPU N; ``DeviceError`` without a driver or GPU,
        ``InvalidArgumentError`` in a build without the ``cuda`` feature)."""
    @property
    def device(self) -> str:
        """The engine's device kind: ``"host"``, ``"sim"`` or ``"cuda"``."""
    def alloc_device(self, nbytes: int, shape: Sequence[int] | None = None) -> DeviceMemory:
        """Allocates ``nbytes`` of device memory: zeroed on a sim engine, not
        initialised on a cuda engine."""
    def adopt_host_memory(self, name: str, obj: object, shape: Sequence[int] | None = None) -> DeviceMemory:
        """On a sim engine: host memory adopted as the sim device's memory (no copy)."""
    def wrap_dlpack(self, name: str, obj: object) -> DeviceMemory:
        """Wraps the CUDA memory a ``__dlpack__`` object exports (a torch CUDA tensor;
        C-contiguous, on this engine's GPU), without copying; holds ``obj`` and its
        capsule. A cuda engine only."""
    def wrap_device_ptr(self, name: str, ptr: int, nbytes: int, device: str, owner: object | None = None) -> DeviceMemory:
        """Wraps raw device memory (``ptr``, ``nbytes`` on ``device``, ``"cuda:N"``),
        which the driver must confirm is memory of this engine's GPU; ``owner`` is kept
        alive with it, and the caller guarantees the memory lives as long. A cuda
        engine only."""
    def register_device(self, name: str, parts: Sequence[tuple[DeviceMemory, Sequence[_Span]]], blocks: int) -> Region:
        """Registers device memory ``parts`` (each with its spans) as one KV cache of
        ``blocks`` blocks; published blocks are gathered device-to-host into staging
        pages, received ones scattered host-to-device from them."""
    def release_remote(
        self, keys: list[_Key], peer: str, timeout: float, retry_miss: float = 0.0, incarnation: int | None = None
    ) -> Transfer:
        """Tells ``peer`` these keys will not be fetched (a ``Release`` request: nothing
        is staged): its ``once`` publications are released now. Misses are retried for ``retry_miss``
        seconds. Returns at once; the result is the number of keys released."""
    def device_stats_json(self) -> str:
        """The device's counters as a JSON object (``{}`` without a device)."""
    def _inject_device_fault(self, fault: str, trigger: str = "next") -> None:
        """Test hook (not API): arms a sim fault (``never_complete``, ``fail_copy``,
        ``stall``, ``slow:N``) for the ``next``, ``every`` or N-th device operation."""
    def _release_device(self) -> None:
        """Test hook (not API): disarms sim faults and lets stuck operations complete."""
    @property
    def address(self) -> str | None:
        """``"host:port"`` peers reach this engine on (None for a client-only engine)."""
    @property
    def peer_id(self) -> str:
        """This engine's peer id."""
    @property
    def incarnation(self) -> int:
        """This engine's incarnation (a new one at every start)."""
    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""
    def runtime_info(self) -> tuple[bool, int, int, int] | None:
        """``(shared, threads, engines holding it, polls made lingering)`` of this
        engine's runtime; None once closed."""
    def stats_json(self) -> str:
        """Every counter, as a JSON object."""
    def register_spans(self, name: str, parts: Sequence[tuple[Buffer, Sequence[_Span]]], blocks: int) -> Region:
        """Registers ``parts`` (C-contiguous byte buffers, each with its spans) as one KV
        cache of ``blocks`` blocks; block *i* is every part's spans at *i*, in order."""
    def register_raw(
        self,
        name: str,
        ptr: int,
        nbytes: int,
        spans: Sequence[_Span],
        blocks: int,
        owner: object | None = None,
    ) -> Region:
        """Registers raw host memory at ``ptr`` (``nbytes``), laid out by ``spans``;
        ``owner`` is kept alive as long as the region. The caller guarantees the memory
        stays valid while ``owner`` lives."""
    def deregister(self, region: Region, timeout: float) -> None:
        """Deregisters ``region`` once unused (at most ``timeout`` seconds); raises
        ``InUseError`` if transfers or publications still hold it."""
    def publish(self, key: _Key, region: Region, block_ids: BlockIds | Sequence[int], ttl: float | None, once: bool) -> None:
        """Publishes blocks of ``region`` under ``key``, zero copy (``ttl`` None: the
        engine's default)."""
    def unpublish(self, key: _Key) -> bool:
        """Releases a publication; False if ``key`` is not published."""
    def take_released(self) -> list[tuple[_Key, str]]:
        """``[(key, reason)]`` of publications released since the last call (the key
        object as published, or its 32 bytes)."""
    def put(self, key: _Key, data: Buffer) -> None:
        """Copies ``data`` (a C-contiguous byte buffer) into the store under ``key``."""
    def get(
        self,
        keys: list[_Key],
        peer: str,
        region: Region,
        block_ids: Sequence[BlockIds | Sequence[int]],
        timeout: float,
        path: str,
        incarnation: int | None = None,
        select: _Selection | None = None,
        await_published: float = 0.0,
    ) -> Transfer:
        """Starts an eager get of ``keys`` from ``peer`` into ``block_ids`` (one list per
        key) of ``region``; ``path`` is ``"direct"`` or ``"staged"``. With
        ``incarnation``, any other incarnation of the peer fails the transfer with
        ``PeerRestartedError`` before anything is staged. With ``await_published``
        (seconds), a first key not published yet is waited for that long (the peer
        answers when it is published) before the get misses. Returns at once."""
    def pull(
        self,
        keys: list[_Key],
        peer: str,
        region: Region,
        block_ids: Sequence[BlockIds | Sequence[int]],
        timeout: float,
        path: str,
        select: _Selection | None = None,
    ) -> int:
        """Delayed pull (stage, then resolve); returns the chunks landed."""
    def stage(self, peer: str, keys: list[_Key], timeout: float, select: _Selection | None = None) -> Staged:
        """Delayed pull, step one: ``peer`` stages ``keys`` under a lease. Raises
        ``NotFoundError`` when it holds none of them."""
    def resolve(
        self,
        staged: Staged,
        region: Region,
        block_ids: Sequence[BlockIds | Sequence[int]],
        timeout: float,
        path: str,
        select: _Selection | None = None,
    ) -> int:
        """Delayed pull, step two: moves a staged handle's chunks into ``region``;
        returns the chunks landed."""
    def push(self, peer: str, key: _Key, data: Buffer, timeout: float) -> None:
        """Pushes ``data`` into ``peer``'s store under ``key``."""
    def peers_json(self) -> str | None:
        """The etcd directory's live peers as JSON (None without one)."""
    def locate(self, keys: list[_Key], timeout: float) -> list[tuple[str, str, int]]:
        """Which live peers hold ``keys``: ``[(peer_id, address, hits)]``, best first."""
    def lookup(self, peer: str, keys: list[_Key], timeout: float) -> int:
        """How many leading ``keys`` ``peer`` holds."""
    def close(self, timeout: float) -> dict[str, Any]:
        """Closes the engine (drains, at most ``timeout`` seconds); returns
        ``{"outstanding_pages": int, "quarantined_pages": int,
        "draining_transfers": int, "clean": bool}``. Idempotent."""
    def _inject_faults(self, send_delay_us: int | None = None, corrupt_next_sends: int | None = None) -> None:
        """Test hook (not API): delays every chunk sent by ``send_delay_us``; corrupts
        the next ``corrupt_next_sends`` chunks on the wire."""

def bounded_wait(event: Any, timeout: float, *, what: str | None = None) -> float:
    """Waits for ``event`` at most ``timeout`` seconds, GIL released (``CompletionEvent``
    on its notifier; CUDA events through a driver host function, else ``cuEventQuery``;
    others polled with ``query()``); returns the seconds waited or raises
    ``TimeoutError`` naming ``what``, the device and the time waited."""

def _bounded_wait_stats() -> dict[str, int]:
    """Counts of bounded waits by path (``notify``, ``cuda_notify``, ``cuda_poll``,
    ``query``), ``polls``, and (cuda builds) the CUDA watch streams."""

@final
class CompletionEvent:
    """An event completed with ``set()``; ``bounded_wait`` sleeps on it without polling."""

    def __new__(cls, *, device: str = ...) -> CompletionEvent: ...
    def set(self) -> bool: ...
    def query(self) -> bool: ...
    def is_set(self) -> bool: ...
    @property
    def device(self) -> str: ...
