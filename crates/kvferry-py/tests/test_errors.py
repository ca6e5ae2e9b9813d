"""Exceptions carry stable codes: the classes come from the extension's one list, and
real failures (over real sockets) raise the class and code their cause names."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import kvferry
from kvferry import _kvferry, errors

BLOCK = 4096


def test_the_python_names_are_the_extensions_classes() -> None:
    assert set(errors.__all__) - {"ERROR_CODES"} == set(_kvferry.ERROR_CLASSES)
    for name in _kvferry.ERROR_CLASSES:
        cls = getattr(errors, name)
        assert cls is getattr(_kvferry, name) is getattr(kvferry, name)
        assert issubclass(cls, errors.Error) and cls.__module__ == "kvferry.errors"
        assert cls.__doc__, name
        assert cls.code in kvferry.ERROR_CODES, (name, cls.code)
    # Builtin bases, so `except ValueError` and friends keep working.
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.TimeoutError, TimeoutError)
    assert issubclass(errors.PeerLostError, ConnectionError)
    assert issubclass(errors.AuthError, PermissionError)
    assert issubclass(errors.NotFoundError, LookupError)
    assert len(set(kvferry.ERROR_CODES)) == len(kvferry.ERROR_CODES)


def test_an_instance_made_in_python_has_its_class_default_code() -> None:
    e = errors.TimeoutError("late")
    assert e.code == "timeout" and e.peer is None and e.waited is None and not e.dirty
    assert str(e) == "late"


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def test_real_failures_carry_their_codes() -> None:
    kv = np.arange(8 * BLOCK, dtype=np.uint8).reshape(8, BLOCK)
    with kvferry.Engine(peer_id="p", transport="tcp") as p, kvferry.Engine(peer_id="d") as d:
        assert p.address is not None
        src = p.register_kv_cache(kv, block_bytes=BLOCK)
        out = np.zeros_like(kv)
        dst = d.register_kv_cache(out, block_bytes=BLOCK)

        with pytest.raises(kvferry.NotFoundError) as miss:
            d.get_blocking(p.address, "nobody-published-this", dst, [0], timeout=5.0)
        assert miss.value.code == "not_found" and miss.value.peer == p.address

        with pytest.raises(kvferry.PeerLostError) as lost:
            d.get_blocking(f"127.0.0.1:{_dead_port()}", "k", dst, [0], timeout=5.0)
        assert lost.value.code == "peer_lost"

        with pytest.raises(kvferry.InvalidArgumentError) as bad:
            d.get_blocking(p.address, "k", dst, [99], timeout=5.0)
        assert bad.value.code in kvferry.ERROR_CODES and bad.value.code in ("invalid_argument", "layout_mismatch")

        # A publication sent slowly: a short timeout is a timeout, with the time waited.
        p._e._inject_faults(send_delay_us=400_000)
        p.publish("slow", src, [1], once=False)
        t0 = time.monotonic()
        with pytest.raises(kvferry.TimeoutError) as late:
            d.get_blocking(p.address, "slow", dst, [1], timeout=0.1)
        assert late.value.code == "timeout"
        assert late.value.waited is not None and 0.09 <= late.value.waited <= time.monotonic() - t0 + 0.01
        p._e._inject_faults(send_delay_us=0)

    with pytest.raises(kvferry.ClosedError) as closed:
        p.put("k", b"x")
    assert closed.value.code == "closed"


def test_a_wrong_secret_is_auth_failed() -> None:
    with kvferry.Engine(secret="s" * 32) as p, kvferry.Engine(secret="t" * 32) as d:
        assert p.address is not None
        out = np.zeros((4, BLOCK), dtype=np.uint8)
        dst = d.register_kv_cache(out, block_bytes=BLOCK)
        with pytest.raises(kvferry.AuthError) as ei:
            d.get_blocking(p.address, "k", dst, [0], timeout=5.0)
        assert ei.value.code == "auth_failed"
