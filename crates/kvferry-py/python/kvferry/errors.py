"""The exceptions kvferry raises: one hierarchy under :class:`Error`.

The classes are created by the Rust extension (``kvferry._kvferry``) from one list and
re-exported here. Every exception carries, beside its message:

- ``code``: what went wrong, a stable string (``"timeout"``, ``"not_found"``,
  ``"quota_exceeded"``, ...; every code is in :data:`ERROR_CODES`). Match on it rather
  than on the message, which may be reworded. An instance created from Python carries
  its class's default code.
- ``peer``: the peer involved (``"host:port"`` or a directory name), or None
- ``key``: the chunk key involved, or None
- ``op``: the operation that failed (``"get"``, ``"pull"``, ``"push"``, ...), or None
- ``waited``: seconds the caller waited, for timeouts, or None
- ``dirty``: True when destination blocks may have been partly written (a direct
  transfer that failed midway); their content is then undefined, never a landed chunk

Classes (each also derives from the builtin named, so ``except ValueError`` and the like
keep working): ``Error``; ``InvalidArgumentError`` (``ValueError``); ``TimeoutError``
(the builtin ``TimeoutError``); ``CancelledError``; ``PeerLostError``
(``ConnectionError``); ``PeerRestartedError``; ``AuthError`` (``PermissionError``);
``BusyError``; ``NotFoundError`` (``LookupError``); ``LeaseExpiredError``;
``ChecksumError``; ``InUseError``; ``ClosedError``; ``DeviceError``; ``SelectionError`` (an
``InvalidArgumentError``: a :class:`kvferry.Selection` that does not fit).
"""

from __future__ import annotations

from ._kvferry import (
    ERROR_CLASSES,
    ERROR_CODES,
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
    "ERROR_CODES",
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
]
assert set(__all__) - {"ERROR_CODES"} == set(ERROR_CLASSES), "kvferry.errors is out of step with the extension"
