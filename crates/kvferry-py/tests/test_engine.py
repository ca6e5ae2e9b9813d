"""The Python engine end to end over real loopback sockets."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
from numpy.typing import NDArray

import kvferry
from kvferry import _kvferry

BLOCK = 4096

Pair = tuple[kvferry.Engine, kvferry.Engine]


@pytest.fixture
def pair() -> Iterator[Pair]:
    # The socket mover: several tests here delay or corrupt the producer's socket
    # sends. test_same_host.py tests the same-host mover an engine picks by default.
    with kvferry.Engine(peer_id="prefill", transport="tcp") as p, kvferry.Engine(peer_id="decode") as d:
        yield p, d


def kv(n: int = 64, seed: int = 0) -> NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 255, (n, BLOCK), dtype=np.uint8)


def test_identity_stats_and_clean_close() -> None:
    e = kvferry.Engine(peer_id="me")
    assert e.address is not None
    host, port = e.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert e.peer_id == "me" and e.incarnation != 0
    s = e.stats()
    assert s["arena"]["total_pages"] == 64 and s["registered"] == 0
    report = e.close()
    assert report["clean"], report
    assert e.close()["clean"]  # idempotent
    with pytest.raises(kvferry.ClosedError):
        e.put("k", b"x")


def test_batched_get_with_numpy_keys_and_ids(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    src_arr = kv()
    src = p.register_kv_cache(src_arr, block_bytes=BLOCK)
    for i in range(4):
        p.publish(f"k{i}", src, [i * 2, i * 2 + 1])
    out = np.zeros_like(src_arr)
    dst = d.register_kv_cache(out, block_bytes=BLOCK)
    keys = np.array([f"k{i}" for i in range(4)])
    ids = np.arange(40, 48).reshape(4, 2)
    assert d.get_blocking(p.address, keys, dst, ids) == 4
    assert (out[40:48] == src_arr[0:8]).all()
    # once=True (default): every Done released its publication
    released = sorted(p.released())
    assert released == [(f"k{i}", "done") for i in range(4)]


def test_partial_hit_and_miss(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    src_arr = kv()
    src = p.register_kv_cache(src_arr, block_bytes=BLOCK)
    p.publish("a", src, [1], once=False)
    out = np.zeros_like(src_arr)
    dst = d.register_kv_cache(out, block_bytes=BLOCK)
    assert d.get_blocking(p.address, ["a", "nope"], dst, [[5], [6]]) == 1
    assert (out[5] == src_arr[1]).all() and not out[6].any()
    with pytest.raises(kvferry.NotFoundError) as ei:
        d.get_blocking(p.address, "nope", dst, [7])
    assert ei.value.peer == p.address


def test_staged_path_and_copy_in_store(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    data = np.random.default_rng(1).integers(0, 255, 3 * BLOCK, dtype=np.uint8)
    p.put("stored", data)
    data[:] = 0  # copy in: the caller may reuse its buffer at once
    out = np.zeros((8, BLOCK), dtype=np.uint8)
    dst = d.register_kv_cache(out, block_bytes=BLOCK)
    assert d.get_blocking(p.address, "stored", dst, [2, 3, 4], path="staged") == 1
    assert out[2:5].tobytes() == np.random.default_rng(1).integers(0, 255, 3 * BLOCK, dtype=np.uint8).tobytes()


def test_push_lookup_and_pull(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    payload = bytes(range(256)) * 64  # 16 KiB
    d.push(p.address, "pushed", payload)
    assert d.lookup(p.address, ["pushed", "other"]) == 1
    out = bytearray(16 * BLOCK)
    dst = d.register_kv_cache(out, block_bytes=BLOCK)
    assert d.pull(p.address, "pushed", dst, [4, 5, 6, 7]) == 1
    assert bytes(out[4 * BLOCK : 8 * BLOCK]) == payload
    h = d.stage(p.address, ["pushed"])
    assert h.chunks == 1 and h.ttl_left > 1
    assert d.resolve(h, dst, [8, 9, 10, 11], path="staged") == 1
    assert bytes(out[8 * BLOCK : 12 * BLOCK]) == payload


def test_per_layer_caches_vllm_layout(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    layers, nb, piece = 3, 16, 256
    src = {f"layer.{i}": np.random.default_rng(i).integers(0, 255, (2, nb, piece), dtype=np.uint8) for i in range(layers)}
    dst_arrays = {f"layer.{i}": np.zeros((2, nb, piece), dtype=np.uint8) for i in range(layers)}
    s = p.register_kv_caches(src)
    t = d.register_kv_caches(dst_arrays)
    assert s.num_blocks == nb and s.block_bytes == layers * 2 * piece
    p.publish("req", s, [1, 2])
    assert d.get_blocking(p.address, "req", t, [7, 9]) == 1
    for name in src:
        for kvh in (0, 1):
            assert (dst_arrays[name][kvh, 7] == src[name][kvh, 1]).all()
            assert (dst_arrays[name][kvh, 9] == src[name][kvh, 2]).all()
            assert not dst_arrays[name][kvh, 8].any()


def test_block_ids_are_checked_whole_and_named(pair: Pair) -> None:
    """Every block id is checked (in the binding, at native speed): the first bad one
    is named with its position, in a batch with its row; floats and strings are
    refused (they were once truncated or parsed); NumPy arrays, ranges, tuples and
    NumPy integer scalars are accepted."""
    p, d = pair
    assert p.address is not None
    src = kv(8, seed=3)
    p.publish("k", p.register_kv_cache(src, block_bytes=BLOCK), list(range(8)))
    p.publish("k2", p.register_kv_cache(kv(8, seed=4), block_bytes=BLOCK), [0, 1])
    arr = np.zeros((64, BLOCK), dtype=np.uint8)
    dst = d.register_kv_cache(arr, block_bytes=BLOCK)
    cases: list[tuple[object, str]] = [
        ([0, 1, -1], r"block_ids: block ids must be in 0\.\.2\*\*32, got -1 at position 2"),
        ([0, 1 << 32], r"got 4294967296 at position 1"),
        ([0, 1.0], r"block_ids must be a sequence of ints, got 1\.0 at position 1"),
        (["0"], r"got '0' at position 0"),
        ([0, None], r"got None at position 1"),
        (7, r"block_ids must be a sequence of ints, got 7"),
        ([], r"block_ids is empty"),
    ]
    for ids, message in cases:
        with pytest.raises(kvferry.InvalidArgumentError, match=message):
            d.get_blocking(p.address, "k", dst, ids, timeout=2.0)
    with pytest.raises(kvferry.InvalidArgumentError, match=r"block_ids\[1\]: .* got -3 at position 1"):
        d.get_blocking(p.address, ["k", "k2"], dst, [list(range(8)), [9, -3]], timeout=2.0)
    assert d.stats()["consumer"]["failed"] == 0  # refused before any transfer
    accepted: list[tuple[int, object]] = [
        (16, np.arange(16, 24)),
        (24, range(24, 32)),
        (32, tuple(range(32, 40))),
        (40, [np.int64(b) for b in range(40, 48)]),
    ]
    for first, ids in accepted:
        assert d.get_blocking(p.address, "k", dst, ids, timeout=5.0) == 1
        assert (arr[first : first + 8] == src).all()
        p.publish("k", p.register_kv_cache(src, block_bytes=BLOCK), list(range(8)))


def test_block_ids_are_converted_once_in_the_binding(pair: Pair) -> None:
    """``check_block_ids`` returns the ids converted (``BlockIds``), and the engine's
    methods take that as it is, without walking the ids as Python objects again; a
    plain list is still taken there. Both land the right bytes, in one batch."""
    p, d = pair
    assert p.address is not None
    src, src2 = kv(8, seed=5), kv(2, seed=6)
    p.publish("k", p.register_kv_cache(src, block_bytes=BLOCK), list(range(8)))
    p.publish("k2", p.register_kv_cache(src2, block_bytes=BLOCK), [0, 1])
    checked = _kvferry.check_block_ids(list(range(8, 16)), "block_ids")
    assert isinstance(checked, _kvferry.BlockIds)
    assert len(checked) == 8 and checked.tolist() == list(range(8, 16))
    assert repr(checked) == "BlockIds(8 ids, 8..15)"
    arr = np.zeros((64, BLOCK), dtype=np.uint8)
    dst = d.register_kv_cache(arr, block_bytes=BLOCK)
    # straight to the binding: a checked row and a plain row in one batch
    landed = d._e.pull(["k", "k2"], p.address, dst, [checked, [30, 31]], 5.0, "direct")
    assert landed == 2
    assert (arr[8:16] == src).all() and (arr[30:32] == src2).all()
    assert not arr[:8].any() and not arr[16:30].any()


def test_bad_input_is_typed_and_named(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    arr = kv()
    dst = d.register_kv_cache(arr, block_bytes=BLOCK)
    with pytest.raises(kvferry.InvalidArgumentError, match="out of range"):
        d.get_blocking(p.address, "k", dst, [64])
    with pytest.raises(kvferry.InvalidArgumentError, match="listed twice"):
        d.get_blocking(p.address, "k", dst, [1, 1])
    with pytest.raises(kvferry.InvalidArgumentError, match="not C-contiguous"):
        d.register_kv_cache(arr[:, ::2], block_bytes=BLOCK // 2)
    with pytest.raises(kvferry.InvalidArgumentError, match="whole number"):
        d.register_kv_cache(arr, block_bytes=5000)
    with pytest.raises(kvferry.InvalidArgumentError, match="neither a buffer"):
        d.register_kv_cache(object(), block_bytes=BLOCK)
    with pytest.raises(kvferry.InvalidArgumentError, match="read-only"):
        ro = np.zeros((4, BLOCK), dtype=np.uint8)
        ro.flags.writeable = False
        d.get_blocking(p.address, "k", d.register_kv_cache(ro, block_bytes=BLOCK), [0])
    with pytest.raises(kvferry.InvalidArgumentError, match="device"):
        kvferry.Engine(device="cuda:x")  # "cuda:0" is valid: see test_cuda.py
    with pytest.raises(ValueError):  # InvalidArgumentError is also a ValueError
        d.get_blocking(p.address, "k", dst, [], timeout=1.0)
    assert d.stats()["consumer"]["failed"] == 0  # refused before any transfer


def test_wrong_secret_is_auth_error() -> None:
    with kvferry.Engine(secret="s" * 32) as p, kvferry.Engine(secret="t" * 32) as d:
        assert p.address is not None
        out = np.zeros((4, BLOCK), dtype=np.uint8)
        dst = d.register_kv_cache(out, block_bytes=BLOCK)
        with pytest.raises(kvferry.AuthError):
            d.get_blocking(p.address, "k", dst, [0], timeout=5.0)
    with kvferry.Engine(secret="s" * 32) as p, kvferry.Engine(secret="s" * 32) as d:
        assert p.address is not None
        src = p.register_kv_cache(kv(4), block_bytes=BLOCK)
        p.publish("k", src, [0])
        dst = d.register_kv_cache(np.zeros((4, BLOCK), dtype=np.uint8), block_bytes=BLOCK)
        assert d.get_blocking(p.address, "k", dst, [0]) == 1


def test_timeout_is_bounded_and_nothing_leaks(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    p._e._inject_faults(send_delay_us=2_000_000)
    src = p.register_kv_cache(kv(), block_bytes=BLOCK)
    p.publish("slow", src, [0, 1], once=False)
    dst = d.register_kv_cache(np.zeros((64, BLOCK), dtype=np.uint8), block_bytes=BLOCK)
    t0 = time.monotonic()
    with pytest.raises(kvferry.TimeoutError) as ei:
        d.get_blocking(p.address, "slow", dst, [0, 1], timeout=0.2)
    took = time.monotonic() - t0
    assert isinstance(ei.value, TimeoutError)  # the builtin too
    assert 0.2 <= took < 0.2 + 0.1, took  # bounded: the 2 s send is not waited for
    assert ei.value.waited is not None and ei.value.waited >= 0.2
    deadline = time.monotonic() + 5
    while d.stats()["consumer"]["draining"] and time.monotonic() < deadline:
        time.sleep(0.01)
    a = d.stats()["arena"]
    assert a["free_pages"] == a["total_pages"], a


def test_other_thread_runs_while_waiting_and_ctrl_c_cancels(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    p._e._inject_faults(send_delay_us=3_000_000)
    src = p.register_kv_cache(kv(), block_bytes=BLOCK)
    p.publish("slow", src, [0], once=False)
    dst = d.register_kv_cache(np.zeros((64, BLOCK), dtype=np.uint8), block_bytes=BLOCK)
    stop = threading.Event()
    count = [0]

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    def interrupt() -> None:
        time.sleep(0.3)
        sent[0] = time.monotonic()
        import _thread

        _thread.interrupt_main()

    sent = [0.0]
    threading.Thread(target=spin, daemon=True).start()
    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        d.get_blocking(p.address, "slow", dst, [5], timeout=10.0, path="staged")
    raised = time.monotonic()
    stop.set()
    # Far inside the 3 s the send is held for: the cancel did not wait for it (0.5 s
    # leaves room for a loaded 2-core host to schedule the interrupt and the drain).
    assert raised - sent[0] < 0.5, raised - sent[0]
    assert count[0] > 1000, "the other thread was starved while we waited"
    # The drain finished before KeyboardInterrupt was raised: nothing is out.
    s = d.stats()
    assert s["consumer"]["draining"] == 0
    assert s["arena"]["free_pages"] == s["arena"]["total_pages"], s["arena"]


def test_registered_memory_outlives_python_references(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    p._e._inject_faults(send_delay_us=300_000)
    src_arr = kv()
    src = p.register_kv_cache(src_arr, block_bytes=BLOCK)
    p.publish("slow", src, [3, 4], once=False)
    out = np.zeros((64, BLOCK), dtype=np.uint8)
    addr = out.ctypes.data
    alive = weakref.ref(out)
    dst = d.register_kv_cache(out, block_bytes=BLOCK)
    t = d.get(p.address, "slow", dst, [20, 21])
    with pytest.raises(kvferry.InUseError):
        d.deregister(dst, timeout=0.05)
    del out
    gc.collect()
    assert alive() is not None, "the engine keeps the array alive while a transfer writes it"
    assert t.wait(5.0) == 1
    import ctypes

    landed = ctypes.string_at(addr + 20 * BLOCK, 2 * BLOCK)
    assert landed == src_arr[3:5].tobytes()
    d.deregister(dst, timeout=1.0)
    del dst
    gc.collect()
    assert alive() is None, "deregistered and drained: the array is freed"


def test_asyncio_await_and_cancel(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    src_arr = kv()
    src = p.register_kv_cache(src_arr, block_bytes=BLOCK)
    for i in range(8):
        p.publish(f"a{i}", src, [i])
    out = np.zeros((64, BLOCK), dtype=np.uint8)
    dst = d.register_kv_cache(out, block_bytes=BLOCK)

    peer = p.address

    async def main() -> list[int]:
        ts = [d.get(peer, f"a{i}", dst, [10 + i]) for i in range(8)]
        return await asyncio.gather(*ts)

    assert asyncio.run(main()) == [1] * 8
    assert (out[10:18] == src_arr[0:8]).all()
    p._e._inject_faults(send_delay_us=2_000_000)
    p.publish("slow", src, [9], once=False)
    t = d.get(p.address, "slow", dst, [30])
    assert not t.done()
    assert t.cancel() is True
    assert t.done() and isinstance(t.error, kvferry.CancelledError)
    assert d.stats()["consumer"]["draining"] == 0


def test_publication_released_by_ttl_and_explicitly(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    src = p.register_kv_cache(kv(), block_bytes=BLOCK)
    p.publish("short", src, [0], ttl=0.2)
    p.publish("manual", src, [1])
    assert p.release("manual") is True and p.release("manual") is False
    time.sleep(0.5)
    assert sorted(p.released()) == [("manual", "released"), ("short", "expired")]
    dst = d.register_kv_cache(np.zeros((4, BLOCK), dtype=np.uint8), block_bytes=BLOCK)
    with pytest.raises(kvferry.NotFoundError):
        d.get_blocking(p.address, "short", dst, [0])


def test_corruption_is_detected_and_reported_dirty(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    src = p.register_kv_cache(kv(), block_bytes=BLOCK)
    p.publish("c", src, [0, 1], once=False)
    p._e._inject_faults(corrupt_next_sends=1)
    dst = d.register_kv_cache(np.zeros((64, BLOCK), dtype=np.uint8), block_bytes=BLOCK)
    with pytest.raises(kvferry.ChecksumError) as ei:
        d.get_blocking(p.address, "c", dst, [0, 1])
    assert ei.value.dirty is True
    assert d.get_blocking(p.address, "c", dst, [0, 1]) == 1  # the next one is clean


def test_engines_share_the_process_runtime_unless_asked_not_to() -> None:
    # A thread count no other test uses, so engines other tests leave to the garbage
    # collector do not count here.
    a = kvferry.Engine(runtime_threads=5)
    b = kvferry.Engine(runtime_threads=5, listen=None)
    own = kvferry.Engine(runtime_threads=5, shared_runtime=False)
    assert a.address is not None
    try:
        rt = {k: v for k, v in a.stats()["runtime"].items() if k != "linger_polls"}
        assert rt == {"shared": True, "threads": 5, "engines": 2}
        rt = {k: v for k, v in own.stats()["runtime"].items() if k != "linger_polls"}
        assert rt == {"shared": False, "threads": 5, "engines": 1}
        src_arr = kv(8)
        a.publish("k", a.register_kv_cache(src_arr, block_bytes=BLOCK), [1, 2], once=False)
        out = np.zeros_like(src_arr)
        dst = b.register_kv_cache(out, block_bytes=BLOCK)
        assert b.get_blocking(a.address, "k", dst, [5, 6]) == 1
        own.close()
        # Closing an engine leaves the shared runtime to the others: a transfer after
        # a neighbour closed still lands.
        c = kvferry.Engine(runtime_threads=5, listen=None)
        assert c.stats()["runtime"]["engines"] == 3
        assert c.close()["clean"]
        out[:] = 0
        assert b.get_blocking(a.address, "k", dst, [5, 6]) == 1
        assert (out[5:7] == src_arr[1:3]).all()
        assert "runtime" not in c.stats()  # closed: it holds no runtime any more
        assert b.stats()["runtime"]["engines"] == 2
    finally:
        for e in (a, b, own):
            assert e.close()["clean"]


def test_wait_spin_and_runtime_options_are_checked() -> None:
    # Wrong values and wrong types on purpose: the constructor's runtime check is what
    # is tested, so the type checker is told these calls are meant to be ill-typed.
    for bad in (-1, 1_000_001, 1.5, True, "10"):
        with pytest.raises(kvferry.InvalidArgumentError, match="wait_spin_us"):
            kvferry.Engine(wait_spin_us=bad)  # type: ignore[arg-type]
    for bad_threads in (0, -2, 1.0):
        with pytest.raises(kvferry.InvalidArgumentError, match="runtime_threads"):
            kvferry.Engine(runtime_threads=bad_threads)  # type: ignore[arg-type]


@pytest.mark.parametrize("spin_us", [0, 200])
def test_waits_return_the_same_outcomes_spinning_or_not(spin_us: int) -> None:
    # Hits, misses and timeouts come out the same whether a waiter spins first or
    # sleeps at once; a wait that times out is bounded either way.
    # A socket producer: the timeouts below come from delaying its sends.
    with kvferry.Engine(wait_spin_us=spin_us, transport="tcp") as p, kvferry.Engine(
        wait_spin_us=spin_us, listen=None
    ) as d:
        assert p.address is not None
        src_arr = kv(8)
        p.publish("hit", p.register_kv_cache(src_arr, block_bytes=BLOCK), [0], once=False)
        out = np.zeros_like(src_arr)
        dst = d.register_kv_cache(out, block_bytes=BLOCK)
        for i in range(200):
            assert d.get_blocking(p.address, "hit", dst, [3]) == 1
            with pytest.raises(kvferry.NotFoundError):
                d.get_blocking(p.address, f"miss-{i}", dst, [4])
        assert (out[3] == src_arr[0]).all()
        p._e._inject_faults(send_delay_us=1_000_000)
        t = d.get(p.address, "hit", dst, [5], timeout=5.0)
        t0 = time.monotonic()
        with pytest.raises(kvferry.TimeoutError):
            t.wait(0.05)
        assert time.monotonic() - t0 < 0.05 + 0.02
        assert t.cancel()


def test_short_waits_make_a_worker_linger_and_a_zero_spin_never_does() -> None:
    for spin_us, lingers in ((0, False), (500, True)):
        with (
            kvferry.Engine(wait_spin_us=spin_us, shared_runtime=False) as p,
            kvferry.Engine(wait_spin_us=spin_us, shared_runtime=False, listen=None) as d,
        ):
            assert p.address is not None
            dst = d.register_kv_cache(np.zeros((4, BLOCK), dtype=np.uint8), block_bytes=BLOCK)
            for i in range(50):
                with pytest.raises(kvferry.NotFoundError):
                    d.get_blocking(p.address, f"miss-{i}", dst, [0])
            polls = d.stats()["runtime"]["linger_polls"]
            assert (polls > 0) == lingers, (spin_us, polls)
            assert p.stats()["runtime"]["linger_polls"] == 0  # it started no transfer
