"""LMCache's multiprocess (MP) server, a real process from lmcache 0.5.6
(``python -m lmcache.v1.multiprocess.server``), with the kvferry L2 adapter loaded
through its ``plugin`` adapter type, over a real ``kvferry serve``.

The client is LMCache's own: the MP server client of ``lmcache bench server``
(``ServerBenchClient``) in its CPU mode — KV caches in CPU tensors, registered with the
server (``REGISTER_KV_CACHE``) and moved over POSIX shared memory with STORE / LOOKUP /
RETRIEVE, the requests vLLM's ``LMCacheMPConnector`` sends. No GPU is needed: the
server's L1 is host memory and the CPU path is LMCache's.

To make a retrieve come from L2, each test clears the server's L1 (LMCache's ``clear``
request) after the store reached kvferry; a lookup then prefetches from the kvferry
adapter into L1 and the retrieve copies it into the client's KV blocks, which are
compared byte for byte with what was stored.

One MP server serves the module (its start-up, imports included, is most of the time);
each test uses its own token sequences and leaves the kvferry server running. A
sequence's blocks start at ``seq * 8 % 120``; none may start at block 0, which the MP
server treats as vLLM's null block (``--null-block-id``) and never stores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import SECRET, Serve

pytestmark = pytest.mark.usefixtures("need_lmcache")

TIMEOUT = 1.0
"""The adapter's ``timeout`` (adapter_params): the bound on every kvferry call."""
BOUND = TIMEOUT + 2.0 + 3.0
"""A lookup's bound with a dead or hung peer: timeout, drain grace, slack for a loaded host."""
START_BUDGET = 240.0
SHAPE = "(2,128,16,4,64):float16:2"  # 2 layers of [K/V, 128 blocks, 16 tokens, 4 heads, 64]: 32 KiB a chunk
TOKENS = 128  # 8 chunks of 16 tokens


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_cmd(port: int, server: str, secret: str) -> list[str]:
    """The MP server's command line with the kvferry L2 adapter (the form docs/lmcache.md gives)."""
    spec = {
        "type": "plugin",
        "module_path": "kvferry.integrations.lmcache",
        "class_name": "KvferryL2Adapter",
        "adapter_params": {"server": server, "secret": secret, "timeout": TIMEOUT},
    }
    return [
        sys.executable, "-m", "lmcache.v1.multiprocess.server",
        "--host", "127.0.0.1", "--port", str(port), "--chunk-size", "16",
        "--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--disable-metrics",
        "--l2-adapter", json.dumps(spec),
    ]  # fmt: skip


class Mp:
    """The MP server process, LMCache's CPU client, and the kvferry server behind it."""

    def __init__(self, serve: Serve) -> None:
        from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
        from lmcache.cli.commands.bench.server_bench.config import BenchConfig

        self.serve = serve
        port = _port()
        cmd = server_cmd(port, serve.address, SECRET)
        self.log: list[str] = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
        t0 = time.monotonic()
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if "cache server is running..." in line:
                break
            assert time.monotonic() - t0 < START_BUDGET, "MP server did not start:\n" + "".join(self.log[-40:])
        else:
            raise AssertionError("MP server exited:\n" + "".join(self.log[-40:]))
        self.started_s = time.monotonic() - t0
        # keep draining its output (a full pipe would stall it)
        import threading

        threading.Thread(target=self._drain, daemon=True).start()
        cfg = BenchConfig(
            rpc_url=f"tcp://127.0.0.1:{port}", http_url="", mode="cpu", transfer_mode="lmcache_driven", tp_size=1,
            use_mla=False, num_tokens=TOKENS, kvcache_shape_spec=SHAPE, num_blocks=128, block_size=16,
        )  # fmt: skip
        self.client = ServerBenchClient(cfg, lambda msg: None)
        self.client.start()
        self.kv: dict[str, Any] = self.client._workers[0].kv_caches
        self.keys: dict[str, Any] = {}

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)

    def request(self, seq: int) -> Any:
        return self.client.create_request(seq, f"{seq}-{uuid.uuid4().hex[:8]}", "test")

    def blocks(self, req: Any) -> list[Any]:
        return [t[:, req.block_offset : req.block_offset + req.num_blocks] for t in self.kv.values()]

    def store(self, seq: int) -> list[Any]:
        """Random KV into the sequence's blocks, stored; returns a copy of the blocks."""
        import torch

        req = self.request(seq)
        g = torch.Generator().manual_seed(seq)
        for b in self.blocks(req):
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
        res = self.client.store(req, 0, req.num_full_tokens)
        assert res is not None and res.successful_worker_ranks == (0,), res
        return [b.clone() for b in self.blocks(req)]

    def clear_l1(self) -> None:
        from lmcache.cli.commands.bench.server_bench.helpers import _TIMEOUT, _wait_for_result

        assert self.client._req_client is not None
        assert _wait_for_result(self.client._req_client.clear(False)) is not _TIMEOUT

    def lookup(self, req: Any, budget: float = 30.0) -> tuple[int, float]:
        """(chunks hit, seconds): LMCache's LOOKUP, then its prefetch status polled
        until the server answered (fails the test past ``budget``)."""
        from lmcache.cli.commands.bench.server_bench.helpers import _TIMEOUT, _make_key, _send_lookup, _wait_for_result

        rc = self.client._req_client
        key = _make_key(req.token_ids, req.request_id, start=0, end=req.num_full_tokens, world_size=1)
        self.keys[req.request_id] = key
        t0 = time.monotonic()
        assert _send_lookup(rc, key)
        while True:
            r = _wait_for_result(rc.query_prefetch_status(req.request_id))
            if r is not _TIMEOUT and r is not None:
                return int(r), time.monotonic() - t0
            assert time.monotonic() - t0 < budget, "prefetch status not answered"
            time.sleep(0.02)

    def release(self, req: Any) -> None:
        """Frees the read locks a lookup not followed by a retrieve holds, and ends its
        session (so that clearing L1 clears its chunks)."""
        from lmcache.cli.commands.bench.server_bench.helpers import _TIMEOUT, _wait_for_result

        rc = self.client._req_client
        assert _wait_for_result(rc.free_lookup_locks(self.keys.pop(req.request_id), 1)) is not _TIMEOUT
        self.client.end_session(req)

    def object_keys(self, seq: int) -> list[Any]:
        """The L2 ObjectKeys the MP server stores the sequence's chunks under, computed
        as the server computes them (its token hasher, blake3, and ``ipc_key_to_object_keys``)."""
        from lmcache.cli.commands.bench.server_bench.helpers import _make_key
        from lmcache.v1.distributed.api import ipc_key_to_object_keys
        from lmcache.v1.multiprocess.token_hasher import TokenHasher

        req = self.request(seq)
        key = _make_key(req.token_ids, req.request_id, start=0, end=req.num_full_tokens, worker_id=0, world_size=1)
        hashes = TokenHasher(chunk_size=16).compute_chunk_hashes(list(req.token_ids), end=req.num_full_tokens)
        return list(ipc_key_to_object_keys(key, hashes, [0])[0])

    def held_by_kvferry(self, seq: int) -> int:
        """How many leading chunks of the sequence the kvferry server holds (data, of one
        chunk's size, and size record), asked with a kvferry client of its own."""
        import kvferry
        from kvferry.integrations.lmcache._l2 import data_key, size_key

        chunk = 2 * 2 * 16 * 4 * 64 * 2  # layers x K/V x tokens x heads x head size x float16
        names: list[str] = []
        for k in self.object_keys(seq):
            names += [size_key(k), data_key(k, chunk)]
        with kvferry.Engine(listen=None, secret=SECRET) as e:
            return int(e.lookup(self.serve.address, names, timeout=5.0)) // 2

    def in_l2(self, seq: int, total: int, budget: float = 30.0) -> None:
        """Waits until the kvferry server holds every chunk of the sequence (LMCache's
        store controller writes L1 to L2 in the background)."""
        t0 = time.monotonic()
        while (held := self.held_by_kvferry(seq)) < total:
            assert time.monotonic() - t0 < budget, f"only {held}/{total} chunks reached kvferry; MP server log:\n{self.tail()}"
            time.sleep(0.1)

    def retrieve_from_l2(self, seq: int, expect: list[Any]) -> None:
        """L1 cleared, LOOKUP (prefetch from kvferry), RETRIEVE into zeroed blocks:
        every byte equals ``expect``."""
        import torch

        self.clear_l1()
        req = self.request(seq)
        hits, _ = self.lookup(req)
        assert hits == req.total_chunks
        for b in self.blocks(req):
            b.zero_()
        assert all(not bool(b.any()) for b in self.blocks(req))
        res = self.client.retrieve(req, 0, req.num_full_tokens)
        assert res is not None and res.successful_worker_ranks == (0,), res
        for got, want in zip(self.blocks(req), expect):
            assert torch.equal(got, want)
        self.keys.pop(req.request_id)
        self.client.end_session(req)

    def tail(self, n: int = 40) -> str:
        """The MP server's last log lines that are not INFO."""
        return "".join([x for x in self.log if " INFO" not in x][-n:])

    def alive(self) -> bool:
        """The MP server answers a request (NOOP) within 5 s."""
        from lmcache.cli.commands.bench.server_bench.helpers import _TIMEOUT, _wait_for_result

        assert self.client._req_client is not None
        return _wait_for_result(self.client._req_client.noop()) not in (_TIMEOUT, None)

    def close(self) -> bool:
        """Stops the client and the server (SIGINT, LMCache's shutdown path); True when
        the server shut down within 20 s, else it is killed."""
        try:
            self.client.close()
        finally:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
                    return False
        return True


@pytest.fixture(scope="module")
def mp(need_lmcache: None) -> Iterator[Mp]:
    serve = Serve(secret=SECRET)
    m = None
    try:
        m = Mp(serve)
        print(f"MP server started in {m.started_s:.1f} s")
        yield m
        stopped = m.close()
        # LMCache's shutdown closes the adapter: its engine reports nothing outstanding
        # (no staging page out, no transfer draining, L1 deregistered first).
        time.sleep(0.2)  # the output thread has the last lines
        closing = [x for x in m.log if "kvferry L2 adapter: closed" in x or "kvferry L2 adapter: engine closed with" in x]
        assert stopped and closing and "closed clean" in closing[-1], m.tail()
    finally:
        if m is not None and m.proc.poll() is None:
            m.close()
        serve.kill()


@pytest.fixture
def peer(mp: Mp) -> Iterator[Serve]:
    """The kvferry server behind the MP server, running again after each test."""
    yield mp.serve
    p = mp.serve.proc
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGCONT)
    else:
        mp.serve.start(mp.serve.address)


def test_round_trip_through_kvferry(mp: Mp, peer: Serve) -> None:
    """Stored through the MP server, evicted from L1, retrieved from kvferry: every byte."""
    want = mp.store(11)
    mp.in_l2(11, TOKENS // 16)
    mp.retrieve_from_l2(11, want)


def test_restarted_peer_is_a_miss(mp: Mp, peer: Serve) -> None:
    """A kvferry server restarted (empty) behind the MP server: a miss, never stale
    bytes; stored again, it serves again without restarting LMCache."""
    want = mp.store(12)
    mp.in_l2(12, TOKENS // 16)
    peer.restart()
    mp.clear_l1()
    req = mp.request(12)
    hits, _ = mp.lookup(req)
    mp.release(req)
    assert hits == 0
    want = mp.store(12)
    mp.in_l2(12, TOKENS // 16)
    mp.retrieve_from_l2(12, want)


def test_dead_peer_is_a_bounded_miss(mp: Mp, peer: Serve) -> None:
    """A SIGKILLed kvferry server: the lookup is a miss within the bound; the MP server
    keeps answering and storing."""
    mp.store(13)
    mp.in_l2(13, TOKENS // 16)
    peer.kill()
    mp.clear_l1()
    req = mp.request(13)
    hits, took = mp.lookup(req)
    mp.release(req)
    assert hits == 0 and took < BOUND, (hits, took)
    assert mp.alive()
    mp.store(14)  # L1 takes it; the L2 store fails (bounded) in the background
    assert mp.alive()


def test_hung_peer_is_a_bounded_miss(mp: Mp, peer: Serve) -> None:
    """A SIGSTOPped kvferry server: the lookup is a miss within the bound and the MP
    server keeps answering; once it resumes, the chunks load whole, byte for byte."""
    want = mp.store(21)
    mp.in_l2(21, TOKENS // 16)
    assert peer.proc is not None
    peer.proc.send_signal(signal.SIGSTOP)
    try:
        mp.clear_l1()
        req = mp.request(21)
        hits, took = mp.lookup(req)
        mp.release(req)
        assert hits == 0 and took < BOUND, (hits, took)
        assert mp.alive()
    finally:
        peer.proc.send_signal(signal.SIGCONT)
    mp.retrieve_from_l2(21, want)



def test_wrong_secret_refused_at_start(mp: Mp) -> None:
    """An MP server whose adapter has a secret the kvferry server refuses does not
    start: it exits, its log naming the kvferry server and the secret setting."""
    proc = subprocess.Popen(server_cmd(_port(), mp.serve.address, "not-the-secret-0123456789abcdef01"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=START_BUDGET)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode != 0
    assert "AuthError" in out and f"server {mp.serve.address} refused this client's secret" in out, out[-3000:]
    assert "cache server is running" not in out
