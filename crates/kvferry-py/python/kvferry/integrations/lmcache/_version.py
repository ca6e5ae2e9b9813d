# mypy: disable-error-code="import-untyped"
# (lmcache ships no type information: its classes are Any here.)
"""Which lmcache is installed: the integration is pinned to one release
(``LMCACHE_VERSION`` in the package), and :func:`~._channel.install` refuses another.
"""

from __future__ import annotations

import lmcache


def installed_version() -> str:
    """The installed lmcache version."""
    return str(getattr(lmcache, "__version__", None) or _dist_version())


def _dist_version() -> str:
    import importlib.metadata as md

    return md.version("lmcache")
