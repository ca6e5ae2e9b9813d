"""kvferry: moves the KV cache of LLM inference between engines — never corrupts,
never leaks, never hangs.

    import kvferry
    with kvferry.Engine() as prefill, kvferry.Engine() as decode:
        src = prefill.register_kv_cache(kv, block_bytes=4096)
        prefill.publish("req-1", src, block_ids=[3, 4, 5])
        dst = decode.register_kv_cache(out, block_bytes=4096)
        decode.get_blocking(prefill.address, "req-1", dst, block_ids=[10, 11, 12], timeout=5.0)
"""

from . import errors
from ._engine import DeviceMemory, Engine, Region, Selection, Transfer
from .bounded_wait import bounded_wait
from ._kvferry import HAS_CUDA, HAS_ETCD, Staged, __version__, key_bytes
from .errors import (
    AuthError,
    BusyError,
    CancelledError,
    ChecksumError,
    ClosedError,
    DeviceError,
    Error,
    InUseError,
    InvalidArgumentError,
    LeaseExpiredError,
    NotFoundError,
    PeerLostError,
    PeerRestartedError,
    SelectionError,
    TimeoutError,
)

__all__ = [
    "Engine",
    "Region",
    "Transfer",
    "Selection",
    "DeviceMemory",
    "Staged",
    "key_bytes",
    "bounded_wait",
    "errors",
    "Error",
    "InvalidArgumentError",
    "SelectionError",
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
    "__version__",
    "HAS_ETCD",
    "HAS_CUDA",
]
