"""The check the integration suites (``with_lmcache``, ``with_sglang``) run before any
test: is the pinned version of the integrated package installed here and usable, and
what to do when a suite cannot run — skip with the reason, or fail when its
``KVFERRY_REQUIRE_*`` variable is ``1`` (CI, where a skip would hide a broken set-up)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest


def why_not_pinned(dist: str, pinned: str, needs: tuple[str, ...], how: str) -> str | None:
    """None when distribution ``dist`` is installed at exactly ``pinned`` and the
    modules ``needs`` can be found; else why not, ending with ``how`` to fix it."""
    try:
        version = importlib.metadata.version(dist)
    except Exception as e:  # noqa: BLE001 - any failure means: not usable here
        return f"{dist} is not installed ({e}); {how}"
    if version != pinned:
        return f"kvferry's {dist} integration is pinned to {dist}=={pinned}, found {version}; {how}"
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        return f"{dist} {version} lacks {' and '.join(missing)} here; {how}"
    return None


def skip_or_fail(why: str | None, require_var: str) -> None:
    """Skips the test with ``why`` — or fails it when ``require_var`` is ``1``; nothing
    when ``why`` is None."""
    if why is None:
        return
    if os.environ.get(require_var) == "1":
        pytest.fail(f"{require_var}=1 but {why}")
    pytest.skip(why)
