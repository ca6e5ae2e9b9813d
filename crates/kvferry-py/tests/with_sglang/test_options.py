# mypy: disable-error-code="import-untyped,import-not-found"
"""The backend's environment options: defaults, and a bad value refused naming the
variable (pure: no processes)."""

from __future__ import annotations

import pytest


def test_transport_option(need_sglang: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.integrations.sglang._options import Options

    monkeypatch.delenv("KVFERRY_SGLANG_TRANSPORT", raising=False)
    assert Options.from_env().transport == "auto"
    monkeypatch.setenv("KVFERRY_SGLANG_TRANSPORT", "tcp")
    assert Options.from_env().transport == "tcp"
    monkeypatch.setenv("KVFERRY_SGLANG_TRANSPORT", "rdma")
    with pytest.raises(ValueError, match="KVFERRY_SGLANG_TRANSPORT='rdma': expected 'auto' or 'tcp'"):
        Options.from_env()
