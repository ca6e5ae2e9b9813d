"""Device engines (``Engine(device="sim")``): KV in simulated device memory, published
by a device-to-host gather and received by a host-to-device scatter, with the sim
backend's faults; release_remote; and a CUDA check that runs where torch sees a GPU
(the CUDA engine itself is tested in test_cuda.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from numpy.typing import NDArray

import kvferry
from device_cache import BLOCK, device_cache


def _pattern(nblocks: int, seed: int) -> NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 255, (nblocks, BLOCK), dtype=np.uint8)


def _blocks(mem: kvferry.DeviceMemory, first: int, n: int) -> NDArray[np.uint8]:
    return np.frombuffer(mem.read(first * BLOCK, n * BLOCK), dtype=np.uint8).reshape(n, BLOCK)


def test_sim_device_round_trip_is_byte_exact() -> None:
    with kvferry.Engine(device="sim", device_latency_us=100) as p, kvferry.Engine(device="sim") as d:
        assert p.address is not None and d.address is not None
        data = _pattern(64, 1)
        src_mem, src = device_cache(p, 64, data)
        assert src.device == "sim" and src.num_blocks == 64 and src.block_bytes == BLOCK
        p.publish("req-1", src, [3, 4, 5])
        dst_mem, dst = device_cache(d, 64)
        assert d.get_blocking(p.address, "req-1", dst, [10, 11, 12], timeout=5.0) == 1
        assert (_blocks(dst_mem, 10, 3) == data[3:6]).all()
        assert (_blocks(dst_mem, 0, 10) == 0).all() and (_blocks(dst_mem, 13, 51) == 0).all()
        # Device to host and host to device, too.
        out = np.zeros((8, BLOCK), dtype=np.uint8)
        host_dst = d.register_kv_cache(out, block_bytes=BLOCK)
        p.publish("req-2", src, [7, 9])
        assert d.get_blocking(p.address, "req-2", host_dst, [0, 1]) == 1
        assert (out[:2] == data[[7, 9]]).all()
        host_src = d.register_kv_cache(data.copy(), block_bytes=BLOCK)
        d.publish("back", host_src, [60, 61])
        assert p.get_blocking(d.address, "back", src, [0, 1]) == 1
        assert (_blocks(src_mem, 0, 2) == data[60:62]).all()
        assert p.stats()["device"]["operations"] >= 2 and d.stats()["device"]["stuck"] == 0
        for e in (p, d):
            st = e.stats()
            assert st["arena"]["leased_pages"] == 0, st["arena"]
        assert p.close()["clean"] and d.close()["clean"]


def test_sim_device_fault_is_typed_and_leaks_nothing() -> None:
    with kvferry.Engine(device="sim") as p, kvferry.Engine(device="sim", device_timeout=0.3) as d:
        assert p.address is not None
        data = _pattern(16, 2)
        _, src = device_cache(p, 16, data)
        p.publish("k", src, [1, 2], once=False)
        dst_mem, dst = device_cache(d, 16)

        # The consumer's host-to-device landing copy fails: a typed error, the
        # staging pages come back, nothing is left draining.
        d._e._inject_device_fault("fail_copy", "next")
        with pytest.raises(kvferry.DeviceError) as ei:
            d.get_blocking(p.address, "k", dst, [4, 5], timeout=5.0)
        assert ei.value.op == "get"
        st = d.stats()
        assert st["consumer"]["draining"] == 0 and st["arena"]["leased_pages"] == 0

        # A landing copy that never completes: DeviceError within the device timeout;
        # its staging pages are quarantined (never reused) until the device confirms.
        d._e._inject_device_fault("never_complete", "next")
        t0 = time.monotonic()
        with pytest.raises(kvferry.DeviceError):
            d.get_blocking(p.address, "k", dst, [6, 7], timeout=5.0)
        assert time.monotonic() - t0 < 2.0
        assert d.stats()["arena"]["quarantined_pages"] > 0
        d._e._release_device()  # late completion: the pages come back
        deadline = time.monotonic() + 5
        while d.stats()["arena"]["quarantined_pages"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.stats()["arena"]["quarantined_pages"] == 0

        # The producer's gather fails: the consumer gets a typed error, not bytes.
        p._e._inject_device_fault("fail_copy", "next")
        with pytest.raises(kvferry.Error):
            d.get_blocking(p.address, "k", dst, [8, 9], timeout=5.0)
        assert (_blocks(dst_mem, 8, 2) == 0).all()

        # After the faults, the same transfer lands byte-exact.
        assert d.get_blocking(p.address, "k", dst, [10, 11], timeout=5.0) == 1
        assert (_blocks(dst_mem, 10, 2) == data[1:3]).all()
        assert p.release("k")
        assert d.close()["clean"] and p.close()["clean"]


def test_sim_device_layers_and_deregister() -> None:
    with kvferry.Engine(device="sim") as p, kvferry.Engine(device="sim") as d:
        assert p.address is not None
        nb, half = 8, 512  # per layer: [2, nb, 512 bytes]
        layers = {}
        raw = {}
        for i in range(2):
            arr = np.random.default_rng(10 + i).integers(0, 255, (2, nb, half), dtype=np.uint8)
            mem = p.alloc_device(arr.nbytes, shape=arr.shape)
            mem.write(arr.data)
            layers[f"l{i}"], raw[f"l{i}"] = mem, arr
        src = p.register_kv_caches(layers)
        assert src.num_blocks == nb and src.block_bytes == 2 * 2 * half
        p.publish("r", src, [2, 5])
        dl = {f"l{i}": d.alloc_device(2 * nb * half, shape=(2, nb, half)) for i in range(2)}
        dst = d.register_kv_caches(dl)
        assert d.get_blocking(p.address, "r", dst, [0, 1]) == 1
        for name, mem in dl.items():
            got = np.frombuffer(mem.read(), dtype=np.uint8).reshape(2, nb, half)
            assert (got[:, [0, 1]] == raw[name][:, [2, 5]]).all()
        # Deregistering a published device region waits, then raises InUseError;
        # once released it succeeds and the region refuses further use.
        p.publish("pinned", src, [0], once=False)
        with pytest.raises(kvferry.InUseError):
            p.deregister(src, timeout=0.05)
        p.release("pinned")
        p.deregister(src, timeout=5.0)
        with pytest.raises(kvferry.InvalidArgumentError, match="deregistered"):
            p.publish("again", src, [0])


def test_device_memory_arguments() -> None:
    with kvferry.Engine(device="sim") as e, kvferry.Engine() as host, kvferry.Engine(device="sim") as other:
        mem = e.alloc_device(BLOCK * 4)
        with pytest.raises(kvferry.InvalidArgumentError):
            mem.write(b"x" * 10, BLOCK * 4)
        with pytest.raises(kvferry.InvalidArgumentError):
            e.register_kv_cache(mem, block_bytes=3000)
        with pytest.raises(kvferry.InvalidArgumentError, match="no device"):
            host.alloc_device(BLOCK)
        with pytest.raises(kvferry.InvalidArgumentError, match="another engine"):
            other.register_kv_cache(mem, block_bytes=BLOCK)
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.Engine(device="tpu")


def test_release_remote_frees_a_publication_at_once() -> None:
    with kvferry.Engine(ttl=60.0) as p, kvferry.Engine(listen=None) as d:
        assert p.address is not None
        data = _pattern(8, 3)
        src = p.register_kv_cache(data, block_bytes=BLOCK)
        # Not published yet: misses are retried, then it lands once published.
        t = d.release_remote(p.address, "late", timeout=5.0, retry_miss=3.0)
        time.sleep(0.1)
        p.publish("late", src, [1])
        assert t.wait(5.0) == 1
        p.publish("now", src, [2, 3])
        t0 = time.monotonic()
        assert d.release_remote(p.address, ["now"]).wait(5.0) == 1
        deadline = time.monotonic() + 2
        released: list[tuple[str | bytes, str]] = []
        while time.monotonic() < deadline and len(released) < 2:
            released += p.released()
            time.sleep(0.005)
        assert sorted(released) == [("late", "declined"), ("now", "declined")]  # Release, not Done
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(kvferry.NotFoundError):
            d.release_remote(p.address, "never").wait(5.0)


def test_release_remote_of_more_keys_than_one_message_releases_them_all() -> None:
    """4,097 keys (one more than a ``Release`` message carries) released in one call:
    every publication is freed at once (the call sends several messages), none waits
    for its lease. Issue 41, defect 1: the call was refused whole and the blocks stayed
    pinned until the lease ended."""
    n = 4097
    with kvferry.Engine(ttl=60.0) as p, kvferry.Engine(listen=None) as d:
        assert p.address is not None
        src = p.register_kv_cache(_pattern(8, 3), block_bytes=BLOCK)
        keys = [f"slot-{i}" for i in range(n)]
        for k in keys:
            p.publish(k, src, [1])
        assert d.release_remote(p.address, keys, timeout=10.0).wait(10.0) == n
        deadline = time.monotonic() + 5
        released: dict[str | bytes, str] = {}
        while time.monotonic() < deadline and len(released) < n:
            released.update(p.released())
            time.sleep(0.005)
        assert len(released) == n and set(released.values()) == {"declined"}


def test_cuda_engine() -> None:
    try:
        import torch
    except ImportError:
        pytest.skip("no CUDA GPU: torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: torch.cuda.is_available() is False")
    # A build without the cuda feature says so clearly; one with it opens the GPU
    # (test_cuda.py moves bytes through it).
    if not kvferry.HAS_CUDA:
        with pytest.raises(kvferry.InvalidArgumentError, match="cuda"):
            kvferry.Engine(device="cuda:0")
        return
    with kvferry.Engine(device="cuda:0") as eng:
        assert eng.stats()["device"]["kind"] == "cuda"
