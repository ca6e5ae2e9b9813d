"""CUDA engines (``Engine(device="cuda:N")``): torch CUDA tensors, ``__dlpack__``
objects in CUDA memory and raw ``(ptr, nbytes, "cuda:N")`` tuples registered without
copying, published by a device-to-host gather and received by a host-to-device
scatter, bytes compared with torch.

The GPU tests need a CUDA GPU, torch with CUDA and a build with the ``cuda`` feature;
they skip with the reason otherwise (``scripts/gpu-check.sh`` runs them on a GPU
machine). The rest runs anywhere: a cuda engine without a GPU is a clear error, CUDA
tensors are refused by host and sim engines, bad device names are refused, and the
DLPack reader is checked against numpy's own exports."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import numpy as np
import pytest

import kvferry
from kvferry import _kvferry

if TYPE_CHECKING:
    import torch
    from typing_extensions import CapsuleType

BLOCK = 4096


class FakeCudaTensor:
    """Claims to live in CUDA memory (DLPack device type 2); must never be read."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def __dlpack__(self, *args: object, **kwargs: object) -> object:
        raise AssertionError("a host or sim engine must refuse before reading the tensor")


# -- runs anywhere --------------------------------------------------------------


def test_cuda_engine_opens_or_says_why() -> None:
    try:
        eng = kvferry.Engine(device="cuda:0")
    except (kvferry.DeviceError, kvferry.InvalidArgumentError) as e:
        msg = str(e)
        assert "cuda" in msg.lower(), msg
        if kvferry.HAS_CUDA:
            # Built with CUDA: no driver library or no GPU here, and it says which.
            assert isinstance(e, kvferry.DeviceError), (type(e), msg)
            assert "CUDA" in msg and ("driver" in msg or "device" in msg), msg
        else:
            assert isinstance(e, kvferry.InvalidArgumentError), (type(e), msg)
            assert "--features cuda" in msg, msg
        return
    # A GPU is here: the engine opened on it.
    with eng:
        assert eng.device == "cuda:0" and eng._e.device == "cuda"
        assert eng.stats()["device"]["device"] == "cuda:0"
    assert eng.close()["clean"]


@pytest.mark.parametrize("device", ["cuda:x", "cuda:", "cuda0", "cuda:-1", "cuda:1.5", "tpu", "", "gpu:0"])
def test_bad_device_names_are_refused(device: str) -> None:
    with pytest.raises(kvferry.InvalidArgumentError) as e:
        kvferry.Engine(device=device)
    assert repr(device) in str(e.value) or device in str(e.value)


@pytest.mark.parametrize("device", ["host", "sim"])
def test_cuda_tensors_are_refused_by_host_and_sim_engines(device: str) -> None:
    with kvferry.Engine(device=device) as eng:
        t = FakeCudaTensor()
        with pytest.raises(kvferry.InvalidArgumentError, match="CUDA device memory"):
            eng.register_kv_cache(t, block_bytes=BLOCK)
        with pytest.raises(kvferry.InvalidArgumentError, match="CUDA device memory"):
            eng.register_kv_caches({"layer.0": t})
        with pytest.raises(kvferry.InvalidArgumentError, match="CUDA device memory"):
            eng.register(t)
        with pytest.raises(kvferry.InvalidArgumentError, match="cuda:N"):
            eng.register_kv_cache((0x7F0000000000, 64 * BLOCK, "cuda:0"), block_bytes=BLOCK)
        # Wrapping device memory is for cuda engines only.
        with pytest.raises(kvferry.InvalidArgumentError):
            eng._e.wrap_device_ptr("raw", 0x7F0000000000, BLOCK, "cuda:0")
        assert eng.close()["clean"]


def test_dlpack_reader_matches_numpy_exports() -> None:
    a = np.arange(64 * 1024, dtype=np.uint16).reshape(64, 1024)
    ptr, nbytes, dev_type, dev_id, shape = _kvferry.dlpack_info(a)
    assert (ptr, nbytes, dev_type, dev_id, shape) == (a.ctypes.data, a.nbytes, 1, 0, [64, 1024])
    # A view at an offset: the address includes it.
    v = a[3:]
    ptr, nbytes, _, _, shape = _kvferry.dlpack_info(v)
    assert (ptr, nbytes, shape) == (a.ctypes.data + 3 * 1024 * 2, 61 * 1024 * 2, [61, 1024])
    # Size-1 dimensions may carry any stride; scalars are one element.
    assert _kvferry.dlpack_info(a[5:6])[1] == 1024 * 2
    assert _kvferry.dlpack_info(np.array(1.5))[1] == 8
    assert _kvferry.dlpack_info(np.zeros((4, 3), dtype=np.complex128))[1] == 4 * 3 * 16
    for bad, why in [
        (a.T, "not C-contiguous"),
        (a[:, ::2], "not C-contiguous"),
        (np.zeros((0, 16), dtype=np.uint8), "empty"),
    ]:
        with pytest.raises(kvferry.InvalidArgumentError, match=why):
            _kvferry.dlpack_info(bad)


def test_dlpack_reader_refuses_what_is_not_a_dltensor_capsule() -> None:
    class NotACapsule:
        def __dlpack__(self) -> bytes:
            return b"not a capsule"

    class Broken:
        def __dlpack__(self) -> object:
            raise RuntimeError("export failed")

    with pytest.raises(kvferry.InvalidArgumentError, match="did not return a capsule"):
        _kvferry.dlpack_info(NotACapsule())
    with pytest.raises(kvferry.InvalidArgumentError, match="export failed"):
        _kvferry.dlpack_info(Broken())
    capsule = np.arange(8, dtype=np.uint8).__dlpack__()

    class Consumed:
        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

        def __dlpack__(self, *args: object, **kwargs: object) -> CapsuleType:
            return capsule

    np.from_dlpack(Consumed())  # numpy consumes (renames) the capsule
    with pytest.raises(kvferry.InvalidArgumentError, match="unconsumed"):
        _kvferry.dlpack_info(Consumed())


# -- needs a CUDA GPU, torch with CUDA and a cuda build ---------------------------


def _need_gpu() -> None:
    """Skips, saying why, unless a CUDA GPU, torch with CUDA and a cuda build are here."""
    if not kvferry.HAS_CUDA:
        pytest.skip("no CUDA GPU: this build of kvferry has no CUDA support (--features cuda)")
    try:
        import torch
    except ImportError:
        pytest.skip("no CUDA GPU: torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: torch.cuda.is_available() is False")


def _pattern(nblocks: int, seed: int) -> torch.Tensor:
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    host = torch.randint(0, 256, (nblocks, BLOCK), dtype=torch.uint8, generator=g)
    return host.to("cuda:0")


def test_torch_cuda_tensor_round_trip() -> None:
    _need_gpu()
    import torch

    with kvferry.Engine(device="cuda:0") as prefill, kvferry.Engine(device="cuda:0") as decode:
        assert prefill.address is not None and decode.address is not None
        kv = _pattern(64, 1)
        src = prefill.register_kv_cache(kv, block_bytes=BLOCK)
        assert src.device == "cuda" and src.num_blocks == 64 and src.block_bytes == BLOCK
        torch.cuda.synchronize()  # kv's writes are done before kvferry reads it
        prefill.publish("req-1", src, [3, 4, 5])
        out = torch.zeros_like(kv)
        dst = decode.register_kv_cache(out, block_bytes=BLOCK)
        assert decode.get_blocking(prefill.address, "req-1", dst, [10, 11, 12], timeout=10.0) == 1
        assert torch.equal(out[10:13], kv[3:6])
        assert int(out[:10].count_nonzero()) == 0 and int(out[13:].count_nonzero()) == 0
        # Device to host, and host to device.
        host_out = np.zeros((8, BLOCK), dtype=np.uint8)
        host_dst = decode.register_kv_cache(host_out, block_bytes=BLOCK)
        prefill.publish("req-2", src, [7, 9])
        assert decode.get_blocking(prefill.address, "req-2", host_dst, [0, 1], timeout=10.0) == 1
        assert (host_out[:2] == kv[[7, 9]].cpu().numpy()).all()
        back = np.random.default_rng(2).integers(0, 255, (4, BLOCK), dtype=np.uint8)
        decode.publish("back", decode.register_kv_cache(back, block_bytes=BLOCK), [1, 2])
        assert prefill.get_blocking(decode.address, "back", src, [60, 61], timeout=10.0) == 1
        assert (kv[60:62].cpu().numpy() == back[1:3]).all()
        for e in (prefill, decode):
            assert e.stats()["arena"]["leased_pages"] == 0
        assert prefill.close()["clean"] and decode.close()["clean"]


def test_raw_device_pointer_and_layered_caches() -> None:
    _need_gpu()
    import torch

    with kvferry.Engine(device="cuda:0") as prefill, kvferry.Engine(device="cuda:0") as decode:
        assert prefill.address is not None and decode.address is not None
        # vLLM's per-layer layout: [2, num_blocks, block_size, heads, head_dim], fp16.
        shape = (2, 16, 16, 4, 32)  # 4 KiB per K or V block
        layers = {f"layer.{i}": torch.randn(shape, dtype=torch.float16, device="cuda:0") for i in range(3)}
        src = prefill.register_kv_caches(layers)
        assert src.num_blocks == 16 and src.block_bytes == 3 * 2 * 16 * 4 * 32 * 2
        torch.cuda.synchronize()
        prefill.publish("layers", src, [2, 5])
        outs = {k: torch.zeros_like(v) for k, v in layers.items()}
        dst = decode.register_kv_caches(outs)
        assert decode.get_blocking(prefill.address, "layers", dst, [0, 1], timeout=10.0) == 1
        for k in layers:
            assert torch.equal(outs[k][:, 0], layers[k][:, 2]) and torch.equal(outs[k][:, 1], layers[k][:, 5])
        # Raw (ptr, nbytes, "cuda:0"): the caller keeps the memory alive.
        raw = torch.zeros((8, BLOCK), dtype=torch.uint8, device="cuda:0")
        rdst = decode.register_kv_cache((raw.data_ptr(), raw.nbytes, "cuda:0"), block_bytes=BLOCK)
        prefill.publish("raw", prefill.register_kv_cache(layers["layer.0"][0], block_bytes=BLOCK), [3])
        assert decode.get_blocking(prefill.address, "raw", rdst, [6], timeout=10.0) == 1
        want = layers["layer.0"][0].reshape(16, -1).view(torch.uint8)[3]
        assert torch.equal(raw[6], want)
        decode.deregister(rdst)
        assert prefill.close()["clean"] and decode.close()["clean"]


def test_cuda_memory_is_checked_and_kept_alive() -> None:
    _need_gpu()
    import torch

    with kvferry.Engine(device="cuda:0") as prefill, kvferry.Engine(device="cuda:0") as decode:
        assert prefill.address is not None and decode.address is not None
        kv = _pattern(32, 3)
        src = prefill.register_kv_cache(kv, block_bytes=BLOCK)
        torch.cuda.synchronize()
        prefill.publish("k", src, [0, 1])
        out = torch.zeros_like(kv)
        dst = decode.register_kv_cache(out, block_bytes=BLOCK)
        addr = out.data_ptr()
        del out  # the region keeps the tensor alive: its memory is not reused
        gc.collect()
        filler = torch.ones((32, BLOCK), dtype=torch.uint8, device="cuda:0")
        assert filler.data_ptr() != addr
        assert decode.get_blocking(prefill.address, "k", dst, [4, 5], timeout=10.0) == 1
        # The bytes landed in the tensor's memory, which is still valid: send them back.
        decode.publish("k-back", dst, [4, 5])
        assert prefill.get_blocking(decode.address, "k-back", src, [10, 11], timeout=10.0) == 1
        assert torch.equal(kv[10:12], kv[0:2])
        del filler
        # Not C-contiguous, another GPU, host memory: refused with the reason.
        with pytest.raises(kvferry.InvalidArgumentError, match="C-contiguous"):
            decode.register_kv_cache(kv.t(), block_bytes=BLOCK)
        with pytest.raises(kvferry.InvalidArgumentError, match="cuda:1"):
            decode.register_kv_cache((kv.data_ptr(), kv.nbytes, "cuda:1"), block_bytes=BLOCK)
        host = np.zeros(8 * BLOCK, dtype=np.uint8)
        with pytest.raises(kvferry.InvalidArgumentError, match="not device memory"):
            decode.register_kv_cache((host.ctypes.data, host.nbytes, "cuda:0"), block_bytes=BLOCK)
        with pytest.raises(kvferry.InvalidArgumentError, match="not device memory|not inside a CUDA allocation"):
            decode.register_kv_cache((kv.data_ptr(), kv.nbytes + (1 << 40), "cuda:0"), block_bytes=BLOCK)
        # Allocated by the engine: write and read back through the driver.
        mem = decode.alloc_device(4 * BLOCK)
        assert mem.device == "cuda"
        data = np.random.default_rng(4).integers(0, 255, 4 * BLOCK, dtype=np.uint8)
        mem.write(data.data)  # its buffer: numpy types an array as a Buffer only on Python >= 3.12
        assert mem.read() == data.tobytes()
        decode.deregister(dst)
        assert prefill.close()["clean"] and decode.close()["clean"]
