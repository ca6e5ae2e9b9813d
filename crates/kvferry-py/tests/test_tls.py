"""Mutual TLS from Python: engines with certificates from one CA move bytes; a peer
with a certificate from another CA, or none, is refused with AuthError; half a TLS
configuration is a clear InvalidArgumentError. Certificates are made per test with the
openssl command (a fresh machine of this project's kind has it; the test skips, saying
so, where it is missing)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypedDict

import numpy as np
import pytest

import kvferry
from _pki import HAVE_OPENSSL, make_pki

BLOCK = 4096

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL, reason="needs the openssl command to make certificates")


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    return make_pki(tmp_path, {"prefill": "ca", "decode": "ca", "stranger": "other_ca"})


class Tls(TypedDict):
    """An engine's TLS keyword arguments."""

    tls_cert: os.PathLike[str]
    tls_key: os.PathLike[str]
    tls_ca: os.PathLike[str]


def _tls(pki: dict[str, Path], who: str, ca: str = "ca") -> Tls:
    return {"tls_cert": pki[f"{who}_cert"], "tls_key": pki[f"{who}_key"], "tls_ca": pki[ca]}


def test_mutual_tls_round_trip_and_refusals(pki: dict[str, Path]) -> None:
    kv = np.random.default_rng(1).integers(0, 255, (8, BLOCK), dtype=np.uint8)
    with kvferry.Engine(peer_id="prefill", **_tls(pki, "prefill")) as p:
        assert p.address is not None
        src = p.register_kv_cache(kv, block_bytes=BLOCK)
        p.publish("k", src, [2, 5], once=False)
        with kvferry.Engine(peer_id="decode", listen=None, **_tls(pki, "decode")) as d:
            out = np.zeros_like(kv)
            dst = d.register_kv_cache(out, block_bytes=BLOCK)
            assert d.get_blocking(p.address, "k", dst, [0, 1], timeout=10.0) == 1
            assert (out[0] == kv[2]).all() and (out[1] == kv[5]).all()
        # A certificate from another CA: refused, and the server keeps serving.
        with kvferry.Engine(peer_id="stranger", listen=None, **_tls(pki, "stranger", ca="ca")) as s:
            out = np.zeros_like(kv)
            dst = s.register_kv_cache(out, block_bytes=BLOCK)
            with pytest.raises(kvferry.AuthError) as ei:
                s.get_blocking(p.address, "k", dst, [0], timeout=10.0)
            assert ei.value.code in ("auth_failed", "auth_required")
            assert not out.any()
        # No TLS at all against a TLS server: refused too.
        with kvferry.Engine(peer_id="plain", listen=None) as c:
            out = np.zeros_like(kv)
            dst = c.register_kv_cache(out, block_bytes=BLOCK)
            with pytest.raises(kvferry.Error):
                c.get_blocking(p.address, "k", dst, [0], timeout=10.0)
            assert not out.any()
        with kvferry.Engine(peer_id="decode2", listen=None, **_tls(pki, "decode")) as d:
            out = np.zeros_like(kv)
            dst = d.register_kv_cache(out, block_bytes=BLOCK)
            assert d.get_blocking(p.address, "k", dst, [3, 4], timeout=10.0) == 1
            assert (out[3] == kv[2]).all()


def test_half_a_tls_configuration_is_refused(pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(kvferry.InvalidArgumentError, match="tls_cert, tls_key and tls_ca go together") as ei:
        kvferry.Engine(tls_cert=pki["prefill_cert"], tls_ca=pki["ca"])
    assert ei.value.code == "invalid_argument"
    with pytest.raises(kvferry.InvalidArgumentError) as bad:
        kvferry.Engine(tls_cert=tmp_path / "missing.pem", tls_key=pki["prefill_key"], tls_ca=pki["ca"])
    assert bad.value.code == "invalid_config" and "missing.pem" in str(bad.value)
