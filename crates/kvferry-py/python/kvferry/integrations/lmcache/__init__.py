# mypy: disable-error-code="import-untyped"
# mypy: allow-subclassing-any
# (lmcache ships no type information: its classes are Any here.)
"""kvferry for LMCache (``lmcache==0.5.6``): an MP-mode L2 adapter, a remote KV tier and a P2P/PD transfer channel.

Three pieces, each documented in ``docs/lmcache.md``:

- :class:`KvferryL2Adapter`: an L2 adapter for LMCache's multiprocess (MP) server,
  loaded through its ``plugin`` adapter type (``module_path`` / ``class_name`` /
  ``adapter_params``), over a kvferry peer.
- :class:`KvferryRemoteConnector` (and :class:`KvferryConnectorAdapter` for
  ``kvferry://HOST:PORT`` and ``plugin://kvferry`` URLs): LMCache's remote storage
  tier over a kvferry peer (a ``kvferry serve`` process, or any engine named by peer
  id through an etcd directory). Loaded without patching LMCache, through its
  ``remote_storage_plugins`` configuration.
- :class:`KvferryTransferChannel`: a ``BaseTransferChannel`` for LMCache's P2P and PD
  backends, installed as channel type ``"kvferry"`` by :func:`install` (LMCache has no
  channel registry, so :func:`install` replaces its factory where the backends
  imported it).

Importing this package without lmcache raises an ``ImportError`` naming what to
install; with another lmcache version than :data:`LMCACHE_VERSION` the remote tier
still imports (its interface is a stable plugin API) but :func:`install` refuses.
"""

from __future__ import annotations

LMCACHE_VERSION = "0.5.6"
"""The lmcache release this integration is tested against."""

_HOW = (
    "kvferry.integrations.lmcache needs lmcache=="
    + LMCACHE_VERSION
    + " beside torch: run scripts/install-lmcache.sh, or `pip install --no-deps lmcache=="
    + LMCACHE_VERSION
    + " sortedcontainers aiofile aiofiles` into an environment with torch (e.g. vLLM's)"
)

try:
    import lmcache as _lmcache  # noqa: F401
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector as _RC  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by the test of the message
    raise ImportError(f"{_HOW} ({e})") from e

from ._channel import ChannelError, KvferryTransferChannel, install
from ._l2 import KvferryL2Adapter, KvferryL2AdapterConfig
from ._options import RemoteOptions
from ._remote import KvferryConnectorAdapter, KvferryRemoteConnector
from ._version import installed_version

__all__ = [
    "LMCACHE_VERSION",
    "KvferryRemoteConnector",
    "KvferryConnectorAdapter",
    "RemoteOptions",
    "installed_version",
    "KvferryTransferChannel",
    "ChannelError",
    "install",
    "KvferryL2Adapter",
    "KvferryL2AdapterConfig",
]
