"""The exceptions kvferry raises: one hierarchy under :class:`Error`.

Every exception carries structured attributes beside its message:

- ``peer``: the peer involved (``"host:port"`` or a directory name), or None
- ``key``: the chunk key involved, or None
- ``op``: the operation that failed (``"get"``, ``"pull"``, ``"push"``, ...), or None
- ``waited``: seconds the caller waited, for timeouts, or None
- ``dirty``: True when destination blocks may have been partly written (a direct
  transfer that failed midway); their content is then undefined, never a landed chunk
"""

from __future__ import annotations

import builtins


class Error(Exception):
    """Base class of every kvferry error."""

    peer: str | None = None
    key: str | None = None
    op: str | None = None
    waited: float | None = None
    dirty: bool = False


class InvalidArgumentError(Error, ValueError):
    """An argument is unusable: bad block ids, a non-contiguous array, a wrong dtype..."""


class SelectionError(InvalidArgumentError):
    """A :class:`kvferry.Selection` does not fit the publication or the destination.
    The message names the mismatch: a block position past the publication's blocks
    (``block position N of M``), a range outside a piece (``range (o, l) exceeds piece
    i of P bytes``), per-piece totals that differ (``the source selects S bytes, the
    destination lands D``), piece counts that differ, block counts that differ,
    overlapping destination ranges, or keys that cannot be selected from (store
    chunks, different caches). Raised by the consumer before anything is sent where it
    can tell, else by the producer's refusal."""


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - deliberately shadows
    """The operation did not finish within its timeout; the transfer was cancelled and
    drains in the background."""


class CancelledError(Error):
    """The transfer was cancelled (``Transfer.cancel()`` or Ctrl-C)."""


class PeerLostError(Error, ConnectionError):
    """The peer closed, reset, could not be reached, or is shutting down."""


class PeerRestartedError(Error):
    """The peer restarted (its incarnation changed) since the lease or handle was made."""


class AuthError(Error, PermissionError):
    """Authentication failed: wrong or missing shared secret."""


class BusyError(Error):
    """The peer (or this engine) had no room right now: staging arena, quota or store
    full, or too many concurrent requests. Retrying later may succeed."""


class NotFoundError(Error, LookupError):
    """The peer holds none of the keys asked for (a miss)."""


class LeaseExpiredError(Error):
    """A staged lease expired (or was unknown) before it was pulled."""


class ChecksumError(Error):
    """Received bytes did not match the checksum computed by the producer; nothing was
    landed as valid (direct transfers leave the blocks ``dirty``)."""


class InUseError(Error):
    """A region is still used by transfers or publications."""


class ClosedError(Error):
    """The engine is closed."""


class DeviceError(Error):
    """A device copy (gathering published device blocks, or landing received ones)
    failed or did not complete within the engine's ``device_timeout``; staging pages
    it may still target are quarantined, never reused, until the device confirms."""


__all__ = [
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
