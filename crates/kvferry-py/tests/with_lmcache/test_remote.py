"""The kvferry remote tier under LMCache 0.5.6's real ``LMCacheEngine`` (on CPU), against
a real ``kvferry serve`` process: store -> drop the local copy -> retrieve identical
bytes; 1,000 chunks with their own patterns; the server SIGKILLed mid-retrieve; the
server restarted (misses, never stale bytes); a wrong secret (a clear error at start-up).

The engine moves KV through a small CPU connector defined in ``conftest.py`` (LMCache
ships none for CPU tensors). Skipped without lmcache 0.5.6 (see ``conftest.py``).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

pytestmark = pytest.mark.usefixtures("need_lmcache")


def test_store_drop_local_retrieve_identical_bytes(serve, lmc):
    import torch

    srv = serve()
    e = lmc(srv.address)
    assert "RemoteBackend-kvferry" in e.backends
    tokens = torch.arange(5 * e.chunk)
    kv = e.kv(len(tokens), seed=1)
    e.store(tokens, kv)
    # the server holds every chunk (data and metadata), found by kvferry's lookup
    keys = [k for _, _, k in e.engine.token_database.process_tokens(tokens=tokens)]
    assert e.connector.batched_contains(keys) == 5
    e.drop_local()
    assert e.backends["LocalCPUBackend"].hot_cache == {} or len(e.backends["LocalCPUBackend"].hot_cache) == 0
    n, out = e.retrieve(tokens)
    assert n == len(tokens)
    assert torch.equal(out, kv)


def test_thousand_chunks_each_with_its_own_pattern(serve, lmc):
    import torch

    srv = serve(blocks=8192)
    e = lmc(srv.address, chunk=16, layers=2, heads=2, head_dim=16)  # 4 KiB chunks
    nchunks = 1000
    tokens = torch.arange(nchunks * e.chunk)
    kv = torch.empty(e.L, 2, len(tokens), e.H, e.D, dtype=torch.float16)
    for c in range(nchunks):  # chunk c: its own values, distinct from every other chunk
        base = torch.arange(e.chunk * e.H * e.D, dtype=torch.float32).reshape(e.chunk, e.H, e.D)
        kv[:, :, c * e.chunk : (c + 1) * e.chunk] = ((base + c * 7.0) % 2048).to(torch.float16)
        kv[0, 0, c * e.chunk] = float(c)
    e.store(tokens, kv, wait=120)
    e.drop_local()
    n, out = e.retrieve(tokens)
    assert n == len(tokens)
    bad = [c for c in range(nchunks) if not torch.equal(out[:, :, c * e.chunk : (c + 1) * e.chunk], kv[:, :, c * e.chunk : (c + 1) * e.chunk])]
    assert not bad, f"chunks with wrong bytes: {bad[:10]}"


def test_server_sigkilled_mid_retrieve_is_a_miss_within_the_timeout(serve, lmc):
    import torch

    # Every sent chunk is delayed 20 ms (the server's own fault injection), so the
    # 96-chunk retrieve takes about 2 s and the SIGKILL surely lands mid-retrieve,
    # however fast the server or loaded the host.
    srv = serve(blocks=60000, arena="128MiB", extra=["--fault-slow-ppm", "1000000", "--fault-slow-us", "20000"])
    timeout = 3.0
    # 1 MiB chunks (chunk of 256 tokens x 2 layers x 8 heads x 64 dims x fp16 x K,V)
    e = lmc(srv.address, chunk=256, layers=2, heads=8, head_dim=64, cpu_gb=0.3, timeout=timeout)
    tokens = torch.arange(96 * e.chunk)
    kv = e.kv(len(tokens), seed=3)
    e.store(tokens, kv, wait=120)
    e.drop_local()
    killer = threading.Timer(0.2, srv.kill)
    killer.start()
    t0 = time.monotonic()
    n, out = e.retrieve(tokens)
    took = time.monotonic() - t0
    killer.join()
    # a miss or a prefix, within LMCache's blocking timeout (timeout + 2) and a small bound
    assert took < timeout + 2 + 3.0, took
    assert n % e.chunk == 0 and n < len(tokens), n
    assert torch.equal(out[:, :, :n], kv[:, :, :n]), "a retrieved prefix has wrong bytes"
    # the engine keeps working: a new store is served from the local tier, and the
    # dead server is a miss, fast
    tokens2 = torch.arange(10_000, 10_000 + 2 * e.chunk)
    kv2 = e.kv(len(tokens2), seed=4)
    e.engine.store(tokens2, kvcaches=kv2)
    n2, out2 = e.retrieve(tokens2)
    assert n2 == len(tokens2) and torch.equal(out2, kv2)
    keys = [k for _, _, k in e.engine.token_database.process_tokens(tokens=tokens)]
    t0 = time.monotonic()
    assert e.connector.batched_contains(keys) == 0
    assert time.monotonic() - t0 < timeout + 1


def test_server_restarted_is_all_misses_never_stale_bytes(serve, lmc):
    import torch

    srv = serve()
    e = lmc(srv.address)
    tokens = torch.arange(4 * e.chunk)
    kv = e.kv(len(tokens), seed=5)
    e.store(tokens, kv)
    e.drop_local()
    n, out = e.retrieve(tokens)
    assert n == len(tokens) and torch.equal(out, kv)
    srv.restart()  # same address, empty store
    e.drop_local()
    n, out = e.retrieve(tokens)
    assert n == 0
    assert not out.any(), "bytes came back from a restarted server"
    # and the tier works again against the new process
    kv2 = e.kv(len(tokens), seed=6)
    e.store(tokens, kv2)
    e.drop_local()
    n, out = e.retrieve(tokens)
    assert n == len(tokens) and torch.equal(out, kv2)


def test_server_side_eviction_is_a_miss(serve, lmc):
    import torch

    # a store of 40 tiny blocks: 2 blocks per 4 KiB chunk plus 1 per metadata record,
    # so storing 30 chunks evicts the first ones (LRU)
    srv = serve(blocks=40)
    e = lmc(srv.address)
    tokens = torch.arange(30 * e.chunk)
    kv = e.kv(len(tokens), seed=7)
    e.engine.store(tokens, kvcaches=kv)
    last = e.keys(tokens)[-1:]
    deadline = time.monotonic() + 30
    while e.connector.batched_contains(last) < 1:  # the last put arrived
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert e.connector.batched_contains(e.keys(tokens)) < 30  # the first ones were evicted
    e.drop_local()
    n, out = e.retrieve(tokens)
    assert n < len(tokens)  # the evicted first chunks are misses (a retrieve is a prefix)
    assert torch.equal(out[:, :, :n], kv[:, :, :n])


def test_hung_server_is_a_miss_within_the_timeout(lmc):
    """A server that accepts connections and never answers: every call comes back
    within the configured timeout, as a miss."""
    import socket

    import torch

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        lsock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(lsock.accept()[0])
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        timeout = 1.5
        e = lmc("127.0.0.1:%d" % lsock.getsockname()[1], timeout=timeout)
        assert "RemoteBackend-kvferry" in e.backends  # start-up only warned
        from kvferry.integrations.lmcache import KvferryRemoteConnector

        t0 = time.monotonic()  # the start-up probe is bounded by the timeout
        KvferryRemoteConnector(None, e.backends["LocalCPUBackend"], e.engine.config)._close()
        assert time.monotonic() - t0 < timeout + 2
        tokens = torch.arange(3 * e.chunk)  # nothing local: the retrieve asks the server
        t0 = time.monotonic()
        n, out = e.retrieve(tokens)
        took = time.monotonic() - t0
        assert n == 0 and not out.any()
        assert took < timeout * 3 + 3, took
        t0 = time.monotonic()
        assert e.connector.batched_contains(e.keys(tokens)) == 0
        assert time.monotonic() - t0 < timeout + 2
    finally:
        stop.set()
        th.join()
        for c in held:
            c.close()
        lsock.close()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_wrong_secret_is_a_clear_error_at_start_up(serve, lmc):
    from lmcache.v1.exceptions import IrrecoverableException

    from kvferry.integrations.lmcache import KvferryRemoteConnector

    srv = serve()
    rec = _Records()
    lg = logging.getLogger("lmcache.v1.storage_backend")
    lg.addHandler(rec)
    try:
        e = lmc(srv.address, secret="not-the-secret-of-this-server-000000")
    finally:
        lg.removeHandler(rec)
    # LMCache logs the plugin's start-up error and runs without that tier
    assert "RemoteBackend-kvferry" not in e.backends
    msg = [m for m in rec.messages if "kvferry" in m and "secret" in m]
    assert msg, rec.messages
    assert srv.address in msg[0] and "kvferry.secret" in msg[0]
    # constructed directly, the connector raises it
    local = e.backends["LocalCPUBackend"]
    with pytest.raises(IrrecoverableException, match="refused this client's secret"):
        KvferryRemoteConnector(None, local, e.engine.config)


def test_cancelled_get_returns_only_after_its_transfers_drained(lmc):
    """LMCache cancels a get that outlived ``blocking_timeout_secs``. The server here is
    an in-process kvferry engine (any engine can be the tier's peer) whose sends are
    slowed by its fault hook, so the get is still landing when it is cancelled, three
    times: until it returns, the landing region is held; the instant it returns, no
    transfer holds it and the objects it allocated were released."""
    import asyncio

    import torch

    import kvferry

    secret = "kvferry-lmcache-test-secret-0123456789"  # conftest's SECRET
    # A socket server: the test slows its sends to catch the get in flight.
    server = kvferry.Engine(
        secret=secret, store_bytes=64 << 20, store_block_bytes=4096, arena_bytes=64 << 20, transport="tcp"
    )
    try:
        e = lmc(server.address, timeout=10.0)
        conn = e.connector
        tokens = torch.arange(16 * e.chunk)
        kv = e.kv(len(tokens), seed=9)
        e.store(tokens, kv)
        e.drop_local()
        keys = e.keys(tokens)
        server._e._inject_faults(send_delay_us=100_000)
        loop = e.remote.loop

        async def make():
            return asyncio.ensure_future(conn.batched_get(keys))

        task = asyncio.run_coroutine_threadsafe(make(), loop).result(5)
        deadline = time.monotonic() + 10
        region = None
        while region is None or region.users == 0:
            regions = list(conn._landing._regions.values())
            region = regions[0][2] if regions else None
            assert time.monotonic() < deadline, "the get never started landing"
            time.sleep(0.001)
        # three cancels, 40 ms apart; until the get returns, sample at the same instant
        # "not returned" and "a transfer holds LMCache's buffer"; the instant it
        # returned, nothing may hold it
        held = 0
        t0 = time.monotonic()
        cancels = [0.05, 0.09, 0.13]  # samples before the first show the landing under way
        while True:
            now = time.monotonic() - t0
            if cancels and now >= cancels[0]:
                cancels.pop(0)
                loop.call_soon_threadsafe(task.cancel)
            done = task.done()
            users = region.users  # read after done: if done, nothing may hold the buffer
            if done:
                assert users == 0, f"the get returned while {users} transfer(s) still held LMCache's buffer"
                break
            if users > 0:
                held += 1
            assert now < 20, "the cancelled get never returned"
            time.sleep(0.001)
        assert task.cancelled()
        assert held > 0
        # the tier still serves: a fresh get lands the right bytes
        server._e._inject_faults(send_delay_us=0)
        n, out = e.retrieve(tokens)
        assert n == len(tokens) and torch.equal(out, kv)
    finally:
        server.close()


def test_mutual_tls_to_the_server(serve, lmc, tmp_path):
    """``kvferry.tls_cert/tls_key/tls_ca``: the tier reaches a ``kvferry serve`` run with
    mutual TLS and moves identical bytes; a certificate from another CA is refused at
    start-up (LMCache's IrrecoverableException, as for a wrong secret)."""
    import torch
    from _pki import HAVE_OPENSSL, make_pki
    from lmcache.v1.exceptions import IrrecoverableException

    if not HAVE_OPENSSL:
        pytest.skip("needs the openssl command to make certificates")
    pki = make_pki(tmp_path, {"server": "ca", "client": "ca", "rogue": "other_ca"})
    srv = serve(extra=["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]), "--tls-ca", str(pki["ca"])])

    def tls(who: str) -> dict[str, str]:
        return {"kvferry.tls_cert": str(pki[f"{who}_cert"]), "kvferry.tls_key": str(pki[f"{who}_key"]), "kvferry.tls_ca": str(pki["ca"])}

    e = lmc(srv.address, extra=tls("client"))
    tokens = torch.arange(3 * e.chunk)
    kv = e.kv(len(tokens), seed=7)
    e.store(tokens, kv)
    e.drop_local()
    n, out = e.retrieve(tokens)
    assert n == len(tokens) and torch.equal(out, kv)
    # A certificate from another CA: the connector refuses to start, naming TLS (LMCache
    # logs that and runs without the tier).
    from kvferry.integrations.lmcache import KvferryRemoteConnector

    rogue = lmc(srv.address, extra=tls("rogue"))
    assert "RemoteBackend-kvferry" not in rogue.backends
    with pytest.raises(IrrecoverableException, match="TLS certificate"):
        KvferryRemoteConnector(None, rogue.backends["LocalCPUBackend"], rogue.engine.config)


@pytest.mark.parametrize("how", ["auto", "tcp", "env-tcp"])
def test_a_server_on_this_host_is_read_from_its_memory_unless_tcp(serve, lmc, monkeypatch, how):
    """``kvferry.transport`` (or ``KVFERRY_TRANSPORT`` when the key is unset): ``auto``
    reads a ``kvferry serve`` on this host with ``process_vm_readv`` (the tier's engine
    names the CMA mover and counts its bytes); ``tcp`` keeps every byte on the socket.
    The bytes are identical either way."""
    import torch

    srv = serve()
    if how == "env-tcp":
        monkeypatch.setenv("KVFERRY_TRANSPORT", "tcp")
        extra = {}
    else:
        # An explicit key wins over the environment (CI reruns this suite with
        # KVFERRY_TRANSPORT=tcp).
        extra = {"kvferry.transport": how}
    e = lmc(srv.address, extra=extra)
    tokens = torch.arange(3 * e.chunk)
    kv = e.kv(len(tokens), seed=7)
    e.store(tokens, kv)
    e.drop_local()
    n, out = e.retrieve(tokens)
    assert n == len(tokens) and torch.equal(out, kv)
    s = e.connector.engine.stats()
    if how == "auto":
        [m] = s["movers"]
        assert m["mover"] == "cma" and m["fallback"] is None, m
        assert s["consumer"]["cma_transfers"] >= 1 and s["consumer"]["cma_bytes"] > 0
    else:
        assert s["movers"] == [] and s["consumer"]["cma_transfers"] == 0, s["movers"]



def test_a_bad_transport_is_named(monkeypatch):
    from kvferry.integrations.lmcache import RemoteOptions

    class Cfg:
        extra_config = {"kvferry.server": "h:1", "kvferry.transport": "rdma"}

    with pytest.raises(ValueError, match="kvferry.transport.*'rdma'"):
        RemoteOptions.from_config(Cfg(), None)
    Cfg.extra_config = {"kvferry.server": "h:1"}
    monkeypatch.setenv("KVFERRY_TRANSPORT", "shm")
    with pytest.raises(ValueError, match="KVFERRY_TRANSPORT.*'shm'"):
        RemoteOptions.from_config(Cfg(), None)
    monkeypatch.setenv("KVFERRY_TRANSPORT", "tcp")
    assert RemoteOptions.from_config(Cfg(), None).transport == "tcp"
    Cfg.extra_config = {"kvferry.server": "h:1", "kvferry.transport": "auto"}
    assert RemoteOptions.from_config(Cfg(), None).transport == "auto"  # the key wins
