"""Two real LMCache 0.5.6 engines sharing KV through LMCache's controller (``python -m
lmcache.v1.api_server``, a real process) and its P2P backend, with the kvferry channel
installed (``transfer_channel: kvferry``): engine B finds engine A's chunks through the
controller and gets them — A's P2P backend writes them into B's pages through the
kvferry channel — and they are A's bytes.

The test drives B's ``P2PBackend`` through the calls LMCache's storage manager makes
on its asynchronous loading path (``batched_async_contains`` with a lookup id, then
``batched_get_non_blocking``); KV moves between CPU tensors and the engines through
the small test connector of ``conftest.py`` (LMCache ships none for CPU tensors).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any




def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the controller never listened on {port}")


def _engine(name: str, pull: int, reply: int, connector: Any) -> Any:
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=16,
        local_cpu=True,
        max_local_cpu_size=0.05,
        enable_p2p=True,
        p2p_host="127.0.0.1",
        p2p_init_ports=[_port()],
        p2p_lookup_ports=[_port()],
        transfer_channel="kvferry",
        enable_controller=True,
        lmcache_instance_id=name,
        controller_pull_url=f"127.0.0.1:{pull}",
        controller_reply_url=f"127.0.0.1:{reply}",
        lmcache_worker_ports=[_port()],
    )
    md = LMCacheMetadata(
        model_name="kvferry-p2p", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.float16, kv_shape=(2, 2, 16, 2, 16), chunk_size=16,
    )
    e = LMCacheEngineBuilder.get_or_create(name, cfg, md, connector(2, 2, 16), lambda t, r: None, lambda o, r: o)
    e.post_init()
    return e


def p2p_main() -> None:
    """Runs in a child process (LMCache's P2P machinery keeps process-wide state and
    threads that would outlive the test in the pytest process)."""
    import torch

    from conftest import cpu_connector_class

    cpu_connector = cpu_connector_class()
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from kvferry.integrations.lmcache import KvferryTransferChannel, install

    install()
    http, pull, reply = _port(), _port(), _port()
    ctl = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.api_server", "--host", "127.0.0.1", "--port", str(http), "--monitor-ports", '{"pull": %d, "reply": %d}' % (pull, reply)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    names = []
    try:
        _wait_port(http)
        a = _engine("kvferry-p2p-a", pull, reply, cpu_connector)
        names.append("kvferry-p2p-a")
        b = _engine("kvferry-p2p-b", pull, reply, cpu_connector)
        names.append("kvferry-p2p-b")
        pa = a.storage_manager.storage_backends["P2PBackend"]
        pb = b.storage_manager.storage_backends["P2PBackend"]
        assert isinstance(pa.transfer_channel, KvferryTransferChannel) and isinstance(pb.transfer_channel, KvferryTransferChannel)
        tokens = torch.arange(64)
        g = torch.Generator().manual_seed(11)
        kv = torch.randn(2, 2, 64, 2, 16, generator=g).to(torch.float16)
        a.store(tokens, kvcaches=kv)
        keys = [k for _, _, k in b.token_database.process_tokens(tokens=tokens)]
        # the controller learns of A's chunks asynchronously (batched admit messages)
        deadline = time.monotonic() + 60
        hits = 0
        while hits < len(keys):
            assert time.monotonic() < deadline, f"the controller never reported A's chunks ({hits}/{len(keys)})"
            lid = f"lk-{time.monotonic_ns()}"
            hits = asyncio.run_coroutine_threadsafe(pb.batched_async_contains(lid, keys, pin=False), pb.loop).result(60)
            if hits < len(keys):
                time.sleep(0.2)
        spec = {"cum_chunk_lengths": [16 * i for i in range(len(keys) + 1)]}
        objs = asyncio.run_coroutine_threadsafe(pb.batched_get_non_blocking(lid, keys, transfer_spec=spec), pb.loop).result(60)
        assert len(objs) == len(keys)
        for i, o in enumerate(objs):
            want = kv[:, :, i * 16 : (i + 1) * 16].permute(1, 0, 2, 3, 4).reshape(2, 2, 16, 32)
            assert torch.equal(o.tensor, want), f"chunk {i}: not A's bytes"
            o.ref_count_down()
        print("P2P-OK", len(objs), flush=True)
    finally:
        for n in names:
            try:
                LMCacheEngineBuilder.destroy(n)
            except Exception:  # noqa: BLE001 - teardown
                pass
        ctl.kill()
        ctl.wait(10)


def test_p2p_backend_gets_the_other_engines_bytes_through_the_kvferry_channel(need_lmcache):
    here = Path(__file__).resolve().parent
    # a hang dumps every thread's stack (to stderr, shown by the assert) and exits
    code = (
        "import faulthandler, sys, os; faulthandler.dump_traceback_later(150, exit=True); "
        f"sys.path.insert(0, {str(here)!r}); import test_p2p; test_p2p.p2p_main(); sys.stdout.flush(); os._exit(0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert "P2P-OK 4" in out.stdout, (out.stdout[-3000:], out.stderr[-3000:])
