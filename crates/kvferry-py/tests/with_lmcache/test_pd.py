"""LMCache 0.5.6's PD backend (prefill sender → decode receiver) with the kvferry
channel installed (``transfer_channel: kvferry``), with LMCache's default
implementation (``pd_backend_mode: async``, ``PDBackendAsync``) and with its
synchronous one (``pd_backend_mode: sync``, ``PDBackend``).

Two real ``LMCacheEngine`` s in one child process: the sender stores a token
sequence's KV with a disaggregation spec naming the receiver; LMCache's PD backend
asks the receiver to allocate pages (its ZMQ alloc socket), writes the chunks into
them through the kvferry channel (the sender publishes its pages, the receiver's
kvferry socket writes them straight into its own pages), then notifies the proxy.
The test plays the proxy (a ZMQ PULL socket): once the notification for the request
arrives, the receiver retrieves the sequence and gets the sender's bytes exactly. A
second request with other bytes checks nothing stale is returned.

The sender's channel has no init URL (LMCache's PD sender only connects): its kvferry
engine starts at the first receiver, on the local address that routes to it. KV moves
between CPU tensors and the engines through the test connector of ``conftest.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHUNK = 16
SHAPE = (2, 2, CHUNK, 2, 16)  # layers, K/V, tokens, heads, head dim
_T0 = time.monotonic()


def _phase(what: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f} s] {what}", flush=True)


@dataclass
class Disagg:
    """The fields of LMCache's ``DisaggSpec`` (``lmcache.integration.vllm``, which
    imports vLLM) that the PD backends read."""

    req_id: str
    receiver_id: str
    receiver_host: str
    receiver_init_port: list[int]
    receiver_alloc_port: list[int]
    is_last_prefill: bool = True
    num_transferred_tokens: int = 0
    total_chunks: int = 0
    receiver_query_port: list[int] | None = field(default=None)


def _engine(name: str, mode: str, role: str, ports: dict[str, int], connector: Any) -> Any:
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    pd: dict[str, Any] = {
        "enable_pd": True,
        "pd_role": role,
        "pd_backend_mode": mode,
        "transfer_channel": "kvferry",
        "pd_buffer_device": "cpu",
        "pd_buffer_size": 64 * 4096,  # 64 chunks of 4 KiB
    }
    if role == "receiver":
        pd.update(pd_peer_host="127.0.0.1", pd_peer_init_port=[ports["init"]], pd_peer_alloc_port=[ports["alloc"]])
    else:
        pd.update(pd_proxy_host="127.0.0.1", pd_proxy_port=ports["proxy"])
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, **pd)
    md = LMCacheMetadata(
        model_name="kvferry-pd", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.float16, kv_shape=SHAPE, chunk_size=CHUNK,
    )
    e = LMCacheEngineBuilder.get_or_create(name, cfg, md, connector(2, 2, 16), lambda t, r: None, lambda o, r: o)
    e.post_init()
    return e


def pd_main(mode: str) -> None:
    """Runs in a child process (the PD backends keep threads and event loops that
    would outlive the test in the pytest process)."""
    _phase("child started")
    import msgspec
    import torch
    import zmq

    from conftest import cpu_connector_class
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from kvferry.integrations.lmcache import KvferryTransferChannel, install

    install()
    _phase("imports done")
    from procs import free_port

    ports = {"init": free_port(), "alloc": free_port(), "proxy": free_port()}
    ctx = zmq.Context()
    proxy = ctx.socket(zmq.PULL)
    proxy.setsockopt(zmq.LINGER, 0)
    proxy.bind(f"tcp://127.0.0.1:{ports['proxy']}")
    names: list[str] = []
    try:
        conn = cpu_connector_class()
        rx = _engine(f"kvferry-pd-rx-{mode}", mode, "receiver", ports, conn)
        names.append(f"kvferry-pd-rx-{mode}")
        tx = _engine(f"kvferry-pd-tx-{mode}", mode, "sender", ports, conn)
        names.append(f"kvferry-pd-tx-{mode}")
        _phase("engines up")
        for e in (rx, tx):
            ch = e.storage_manager.storage_backends["PDBackend"].transfer_channel
            assert isinstance(ch, KvferryTransferChannel), type(ch)
        for round_, (tokens, seed) in enumerate([(torch.arange(64), 5), (torch.arange(1000, 1048), 6)]):
            n = len(tokens)
            g = torch.Generator().manual_seed(seed)
            kv = torch.randn(2, 2, n, 2, 16, generator=g).to(torch.float16)
            req = f"req-{mode}-{round_}"
            spec = Disagg(
                req_id=req,
                receiver_id=f"127.0.0.1{ports['init']}",
                receiver_host="127.0.0.1",
                receiver_init_port=[ports["init"]],
                receiver_alloc_port=[ports["alloc"]],
                total_chunks=n // CHUNK,
            )
            tx.store(tokens, kvcaches=kv, transfer_spec=spec)
            # LMCache's completion signal: the proxy hears of the request only after
            # every chunk was written into the receiver's pages.
            assert proxy.poll(60_000), f"{req}: no proxy notification within 60 s"
            notif = msgspec.msgpack.decode(proxy.recv())
            assert notif.get("req_id") == req, notif
            _phase(f"{req}: written, proxy notified")
            out = torch.zeros_like(kv)
            got = int(rx.retrieve(tokens, kvcaches=out).sum().item())
            assert got == n, f"{req}: the receiver retrieved {got} of {n} tokens"
            assert torch.equal(out, kv), f"{req}: the receiver's bytes are not the sender's"
            _phase(f"{req}: retrieved, bytes equal")
        # LMCache 0.5.6's PD backends do not close: both terminate a zmq context while
        # a socket of their own on it is still open, so ``Context.term`` blocks for
        # ever — the sync ``PDBackend`` its alloc-loop REP socket on the process-wide
        # context, the async ``PDBackendAsync`` (sender) its proxy PUSH socket, which
        # its ``close`` never closes. That is LMCache's teardown, not the channel's:
        # the test closes the kvferry channels itself, bounded, and leaves the process
        # (``os._exit``) without LMCache's close.
        for e in (tx, rx):
            ch = e.storage_manager.storage_backends["PDBackend"].transfer_channel
            t0 = time.monotonic()
            ch.close()
            took = time.monotonic() - t0
            assert took < 10.0, f"the kvferry channel took {took:.1f} s to close"
        _phase("kvferry channels closed")
        names.clear()
        print("PD-OK", mode, flush=True)
    finally:
        for name in reversed(names):
            try:
                LMCacheEngineBuilder.destroy(name)
            except Exception:  # noqa: BLE001 - teardown
                pass
        proxy.close(0)
        ctx.term()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_pd_backend_sender_writes_the_receivers_pages_through_the_kvferry_channel(need_lmcache: None, mode: str) -> None:
    here = Path(__file__).resolve().parent
    # a hang dumps every thread's stack (to stderr, shown by the assert) and exits
    code = (
        "import faulthandler, sys, os; faulthandler.dump_traceback_later(400, exit=True); "
        f"sys.path.insert(0, {str(here)!r}); import test_pd; test_pd.pd_main({mode!r}); sys.stdout.flush(); os._exit(0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=500)
    print(out.stdout[-3000:])
    assert f"PD-OK {mode}" in out.stdout, (out.stdout[-3000:], out.stderr[-5000:])
