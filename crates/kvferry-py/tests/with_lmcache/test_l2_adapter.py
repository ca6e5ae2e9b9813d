"""The kvferry L2 adapter built by LMCache's own plugin factory, in this process, over a
real ``kvferry serve``: the paths an MP server cannot show from outside (a refused
secret at construction, the size check, L1 handed back after a hung peer, close).

The adapter is made exactly as LMCache's MP server makes it: the ``--l2-adapter`` JSON
parsed by ``parse_args_to_l2_adapters_config`` (type ``plugin``) and built by
``create_l2_adapter`` with an ``L1MemoryDesc``; its L1 objects are LMCache's
``TensorMemoryObj`` views of one aligned buffer (LMCache's L2 bench helpers), and every
wait goes through the adapter's event fds, as LMCache's controllers wait.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

import pytest

from .conftest import SECRET

pytestmark = pytest.mark.usefixtures("need_lmcache")

TIMEOUT = 1.0
OBJ = 64 << 10  # one L1 object: 16 aligned 4 KiB blocks


def build(server: str, **params: Any) -> tuple[Any, Any]:
    """(adapter, L1 buffer) through LMCache's --l2-adapter parsing and factory."""
    from lmcache.cli.commands.bench.l2_adapter_bench.data import create_l1_memory_desc, make_aligned_tensor
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    spec = {
        "type": "plugin",
        "module_path": "kvferry.integrations.lmcache",
        "class_name": "KvferryL2Adapter",
        "adapter_params": {"server": server, "secret": SECRET, "timeout": TIMEOUT, **params},
    }
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    buf = make_aligned_tensor(16 * OBJ, align_bytes=4096)
    return create_l2_adapter(cfg, l1_memory_desc=create_l1_memory_desc(buf, align_bytes=4096)), buf


def objects(buf: Any, n: int, first: int, fill: int, size: int = OBJ) -> list[Any]:
    from lmcache.cli.commands.bench.l2_adapter_bench.data import make_memory_objects

    return list(make_memory_objects(buf, n, size, first * OBJ, fill_offset=fill))


def keys(n: int, offset: int) -> list[Any]:
    from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys

    return list(make_object_keys(n, model_name="kvferry-l2-test", key_offset=offset))


def wait(efd: int, poll: Any, bound: float) -> Any:
    """The task's result, waited for on its event fd as LMCache's controllers wait;
    fails the test past ``bound`` seconds."""
    from lmcache.cli.commands.bench.l2_adapter_bench.data import wait_eventfd

    deadline = time.monotonic() + bound
    while True:
        r = poll()
        if r is not None:
            return r
        left = deadline - time.monotonic()
        assert left > 0, f"task not completed within {bound} s"
        wait_eventfd(efd, timeout=min(left, 0.5))


def store(a: Any, ks: list[Any], objs: list[Any], bound: float = 10.0) -> Any:
    tid = a.submit_store_task(ks, objs)
    got: dict[int, Any] = {}

    def poll() -> Any:
        got.update(a.pop_completed_store_tasks())
        return got.get(tid)

    return wait(a.get_store_event_fd(), poll, bound)


def lookup(a: Any, ks: list[Any], bound: float = 10.0) -> list[int]:
    tid = a.submit_lookup_and_lock_task(ks, {})
    bm = wait(a.get_lookup_and_lock_event_fd(), lambda: a.query_lookup_and_lock_result(tid), bound)
    return [i for i in range(len(ks)) if bm.test(i)]


def load(a: Any, ks: list[Any], objs: list[Any], bound: float = 10.0) -> list[int]:
    tid = a.submit_load_task(ks, objs)
    bm = wait(a.get_load_event_fd(), lambda: a.query_load_result(tid), bound)
    return [i for i in range(len(ks)) if bm.test(i)]


def landing_users(a: Any) -> int:
    return sum(r.users for _, _, r, _ in a._landing._regions.values())


def test_round_trip_and_size_check(serve: Any) -> None:
    """Store, lookup and load through LMCache's factory: every byte comes back, into
    other L1 objects; an object of another size is a miss with its bytes untouched."""
    import torch

    s = serve(secret=SECRET)
    a, buf = build(s.address)
    try:
        ks = keys(4, 100)
        src = objects(buf, 4, 0, fill=7)
        for i, o in enumerate(src):  # distinct, non-constant bytes per object
            o.raw_data.copy_(torch.randint(0, 256, (OBJ,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
        assert store(a, ks, src).is_successful()
        assert lookup(a, ks) == [0, 1, 2, 3]
        assert lookup(a, keys(2, 900)) == []
        dst = objects(buf, 4, 4, fill=0)
        assert load(a, ks, dst) == [0, 1, 2, 3]
        for s_obj, d_obj in zip(src, dst):
            assert torch.equal(s_obj.raw_data, d_obj.raw_data)
        small = objects(buf, 1, 8, fill=3, size=OBJ // 2)
        assert load(a, ks[:1], small) == []
        assert bool((small[0].raw_data == 3).all()), "a size mismatch must leave the object untouched"
        assert a.get_usage().total_bytes_used == 4 * OBJ
        assert landing_users(a) == 0
    finally:
        a.close()


def test_wrong_secret_is_refused(serve: Any) -> None:
    """A secret the server refuses fails construction with AuthError naming the server
    and the setting (the MP server does not start with a tier that cannot work)."""
    import kvferry

    s = serve(secret=SECRET)
    with pytest.raises(kvferry.AuthError) as e:
        build(s.address, secret="not-the-secret-0123456789abcdef0123")
    assert s.address in str(e.value) and "secret" in str(e.value)


def test_hung_peer_is_a_bounded_miss_and_l1_is_handed_back(serve: Any) -> None:
    """A SIGSTOPped server: lookup, load and store complete within the timeout plus the
    drain grace, as misses/failure, and no transfer holds L1 when the load completes;
    once it resumes, the chunks stored before load whole."""
    import torch

    s = serve(secret=SECRET)
    a, buf = build(s.address)
    try:
        ks = keys(3, 200)
        src = objects(buf, 3, 0, fill=11)
        assert store(a, ks, src).is_successful()
        assert s.proc is not None
        s.proc.send_signal(signal.SIGSTOP)
        try:
            bound = TIMEOUT + 2.0 + 2.0  # timeout, drain grace, slack for a loaded host
            t0 = time.monotonic()
            dst = objects(buf, 3, 4, fill=0)
            assert load(a, ks, dst, bound=bound) == []
            assert landing_users(a) == 0, "a completed load must hold no L1 block"
            assert lookup(a, ks, bound=bound) == []
            assert not store(a, keys(1, 300), objects(buf, 1, 8, fill=1), bound=bound).is_successful()
            assert time.monotonic() - t0 < 3 * bound
            assert a.report_status()["is_healthy"] is False
        finally:
            s.proc.send_signal(signal.SIGCONT)
        dst = objects(buf, 3, 4, fill=0)
        assert load(a, ks, dst) == [0, 1, 2]
        for s_obj, d_obj in zip(src, dst):
            assert torch.equal(s_obj.raw_data, d_obj.raw_data)
    finally:
        a.close()
    assert a.close_report["clean"], a.close_report


def test_dead_and_restarted_peer(serve: Any) -> None:
    """A SIGKILLed server is a prompt miss; restarted (empty) on its port it is a miss,
    never stale bytes, and the adapter stores and loads again without a restart."""
    s = serve(secret=SECRET)
    a, buf = build(s.address)
    try:
        ks = keys(2, 400)
        assert store(a, ks, objects(buf, 2, 0, fill=5)).is_successful()
        s.kill()
        assert lookup(a, ks, bound=TIMEOUT + 4.0) == []
        assert load(a, ks, objects(buf, 2, 4, fill=0), bound=TIMEOUT + 4.0) == []
        s.start(s.address)
        assert lookup(a, ks) == []
        dst = objects(buf, 2, 4, fill=9)
        assert load(a, ks, dst) == []
        assert all(bool((o.raw_data == 9 + i).all()) for i, o in enumerate(dst)), "a miss writes nothing"
        assert store(a, ks, objects(buf, 2, 0, fill=5)).is_successful()
        assert load(a, ks, dst) == [0, 1]
        assert all(bool((o.raw_data == 5 + i).all()) for i, o in enumerate(dst))
    finally:
        a.close()
    assert a.close_report["clean"], a.close_report
