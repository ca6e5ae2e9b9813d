"""The etcd peer directory from Python: ``Engine(directory="etcd://…")`` against a real
etcd started on loopback ports for each test (skipped with a message where the
``etcd`` binary or the package's etcd support is missing, except under ``CI=true``,
where that is a failure)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvferry

BLOCK = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _need(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} (CI needs it)")
    pytest.skip(what)


@pytest.fixture
def etcd_url() -> Iterator[str]:
    if not kvferry.HAS_ETCD:
        _need("this build of kvferry has no etcd support (build with --features etcd)")
    if shutil.which("etcd") is None:
        _need("the etcd binary is not installed (apt-get install etcd-server)")
    with tempfile.TemporaryDirectory(prefix="kvferry-etcd-py-") as d:
        # A port picked free may be taken before etcd binds it: pick again.
        for attempt in range(6):
            proc, client = _start_etcd(d, attempt)
            if proc is not None:
                break
        else:
            pytest.fail("etcd could not bind free ports in 6 attempts")
        try:
            yield f"etcd://127.0.0.1:{client}"
        finally:
            proc.kill()
            proc.wait()


def _start_etcd(d: str, attempt: int) -> tuple[subprocess.Popen[bytes] | None, int]:
    """Starts etcd on fresh ports and waits until healthy; (None, _) when a port was
    taken meanwhile."""
    client, peer = _free_port(), _free_port()
    c, p = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    log_path = os.path.join(d, f"etcd-{attempt}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", os.path.join(d, f"data-{attempt}"),
             "--listen-client-urls", c, "--advertise-client-urls", c,
             "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
             "--initial-cluster", f"t={p}"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{c}/health", timeout=0.5) as r:
                if b'"health":"true"' in r.read():
                    return proc, client
        except OSError:
            pass
        if proc.poll() is not None:
            text = open(log_path).read()
            if "address already in use" in text:
                return None, client
            pytest.fail(f"etcd exited while starting:\n{text}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("etcd not healthy after 20 s")
        time.sleep(0.05)


def _wait_listed(eng: kvferry.Engine, ids: set[str], timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        view = eng.peers()
        if {p["peer_id"] for p in view["peers"]} >= ids:
            return view
        assert time.monotonic() < deadline, f"never listed {ids}: {view}"
        time.sleep(0.02)


def test_peers_are_found_by_id_through_etcd(etcd_url: str) -> None:
    ns = f"py-{os.getpid()}-{time.monotonic_ns()}"
    with kvferry.Engine(directory=etcd_url, namespace=ns, peer_id="prefill-0", role="prefill",
                        directory_ttl=2.0) as prefill, \
         kvferry.Engine(directory=etcd_url, namespace=ns, peer_id="decode-0", role="decode",
                        directory_ttl=2.0) as decode:
        view = _wait_listed(decode, {"prefill-0", "decode-0"})
        assert view["stale"] is False
        rec = next(p for p in view["peers"] if p["peer_id"] == "prefill-0")
        assert rec["address"] == prefill.address
        assert rec["incarnation"] == prefill.incarnation
        assert rec["role"] == "prefill"

        kv = np.random.default_rng(1).integers(0, 255, (16, BLOCK), dtype=np.uint8)
        src = prefill.register_kv_cache(kv, block_bytes=BLOCK)
        prefill.publish("req-dir", src, block_ids=[2, 3], once=False)
        # Located by asking the live peers, then fetched by peer id (no address given).
        found = decode.locate("req-dir", timeout=2.0)
        assert [(p, a) for p, a, _ in found] == [("prefill-0", prefill.address)]
        out = np.zeros_like(kv)
        dst = decode.register_kv_cache(out, block_bytes=BLOCK)
        decode.get_blocking("prefill-0", "req-dir", dst, block_ids=[7, 8], timeout=5.0)
        assert (out[7:9] == kv[2:4]).all()
        assert decode.locate("nobody-has-this", timeout=2.0) == []


def test_a_closed_peer_leaves_the_directory_and_its_id_can_be_reused(etcd_url: str) -> None:
    ns = f"py-{os.getpid()}-{time.monotonic_ns()}"
    with kvferry.Engine(directory=etcd_url, namespace=ns, peer_id="watcher") as watcher:
        first = kvferry.Engine(directory=etcd_url, namespace=ns, peer_id="p")
        _wait_listed(watcher, {"p"})
        # A second live process cannot take the same id: a clear error names it.
        with pytest.raises(kvferry.Error, match="p"):
            kvferry.Engine(directory=etcd_url, namespace=ns, peer_id="p")
        old = first.incarnation
        first.close()
        deadline = time.monotonic() + 5
        while any(p["peer_id"] == "p" for p in watcher.peers()["peers"]):
            assert time.monotonic() < deadline, "a cleanly closed engine stayed listed"
            time.sleep(0.02)
        with kvferry.Engine(directory=etcd_url, namespace=ns, peer_id="p") as again:
            view = _wait_listed(watcher, {"p"})
            rec = next(p for p in view["peers"] if p["peer_id"] == "p")
            assert rec["incarnation"] == again.incarnation != old


def test_a_bad_directory_is_a_clear_error_and_an_unreachable_one_is_bounded() -> None:
    with pytest.raises(kvferry.InvalidArgumentError, match="etcd://"):
        kvferry.Engine(directory="zookeeper://x:1")
    if not kvferry.HAS_ETCD:
        with pytest.raises(kvferry.InvalidArgumentError, match="etcd"):
            kvferry.Engine(directory="etcd://127.0.0.1:1")
        return
    port = _free_port()  # nothing listens there
    t = time.monotonic()
    with pytest.raises(kvferry.Error, match=f"127.0.0.1:{port}"):
        kvferry.Engine(directory=f"etcd://127.0.0.1:{port}", connect_timeout=1.0)
    assert time.monotonic() - t < 8.0, "an unreachable etcd must fail within its bound"


def test_without_etcd_peers_lists_the_static_map() -> None:
    with kvferry.Engine() as a, kvferry.Engine(directory={"a": "127.0.0.1:1"}) as b:
        assert a.peers() == {"stale": False, "peers": []}
        assert b.peers()["peers"] == [{"peer_id": "a", "address": "127.0.0.1:1"}]
        with pytest.raises(kvferry.InvalidArgumentError, match="directory"):
            b.locate("k")
