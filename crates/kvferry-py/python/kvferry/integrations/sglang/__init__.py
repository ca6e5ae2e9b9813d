# mypy: disable-error-code="import-untyped,import-not-found"
"""kvferry as a transfer backend of SGLang's prefill/decode disaggregation
(``sglang==0.5.23``): ``--disaggregation-transfer-backend kvferry``.

- :class:`KvferryKVManager`: one per scheduler rank, over one kvferry ``Engine`` that
  registers SGLang's KV and auxiliary buffers once;
- :class:`KvferryKVSender` (prefill) and :class:`KvferryKVReceiver` (decode): one per
  request, with ``KVPoll`` states as SGLang's schedulers expect them and a
  ``failure_exception`` naming the cause;
- :class:`KvferryKVBootstrapServer`: SGLang's own HTTP bootstrap server;
- :mod:`.plugin`: the ``sglang.srt.plugins`` entry point that makes the backend name
  valid and routes it here, without patching SGLang.

See ``docs/sglang.md``. Importing this package without sglang raises an ``ImportError``
naming what to install; another sglang version is refused by :func:`check_version`
(the plugin calls it) with a message naming both versions.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

SGLANG_VERSION = "0.5.23"
"""The sglang release this backend is written and tested against."""

_HOW = (
    "kvferry.integrations.sglang needs sglang=="
    + SGLANG_VERSION
    + " beside torch: run scripts/install-sglang.sh, or `pip install --no-deps sglang=="
    + SGLANG_VERSION
    + " ipython gguf` into an environment with torch, zmq and aiohttp (e.g. vLLM's)"
)


def installed_version() -> str | None:
    """The installed sglang's version, or None."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(version: str | None = None) -> None:
    """Raises ``RuntimeError`` unless ``version`` (default: the installed sglang's) is
    :data:`SGLANG_VERSION`."""
    v = installed_version() if version is None else version
    if v != SGLANG_VERSION:
        raise RuntimeError(
            f"kvferry's SGLang backend supports sglang=={SGLANG_VERSION} only, but sglang "
            f"{v or '(not installed)'} is installed: its transfer-backend interface differs between "
            f"releases. Install sglang=={SGLANG_VERSION} (scripts/install-sglang.sh) or pick another "
            "--disaggregation-transfer-backend."
        )


try:
    import sglang.srt.disaggregation.base.conn as _base  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by the test of the message
    raise ImportError(f"{_HOW} ({e})") from e

from ._bootstrap import BootstrapError, KvferryKVBootstrapServer
from ._conn import KvferryKVReceiver, KvferryKVSender, KvferryTransferError
from ._manager import KvferryKVManager
from ._options import Options
from ._plan import PairingError


def classes() -> dict[str, Any]:
    """SGLang's ``KVClassType`` values mapped to this backend's classes."""
    return {
        "manager": KvferryKVManager,
        "sender": KvferryKVSender,
        "receiver": KvferryKVReceiver,
        "bootstrap_server": KvferryKVBootstrapServer,
    }


__all__ = [
    "SGLANG_VERSION",
    "BootstrapError",
    "KvferryKVBootstrapServer",
    "KvferryKVManager",
    "KvferryKVReceiver",
    "KvferryKVSender",
    "KvferryTransferError",
    "Options",
    "PairingError",
    "check_version",
    "classes",
    "installed_version",
]
