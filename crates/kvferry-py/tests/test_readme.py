"""The README's Python example, verbatim."""


def test_readme_example() -> None:
    import numpy as np
    import kvferry

    with kvferry.Engine() as prefill, kvferry.Engine() as decode:   # loopback, ephemeral ports
        kv = np.random.default_rng(0).integers(0, 255, (64, 4096), dtype=np.uint8)  # 64 blocks of 4 KiB
        src = prefill.register_kv_cache(kv, block_bytes=4096)
        prefill.publish("req-1", src, block_ids=[3, 4, 5])        # pins blocks 3..5 until released
        out = np.zeros_like(kv)
        dst = decode.register_kv_cache(out, block_bytes=4096)
        assert prefill.address is not None                          # "host:port" (None: a client-only engine)
        decode.get_blocking(prefill.address, "req-1", dst, block_ids=[10, 11, 12], timeout=5.0)
        assert (out[10:13] == kv[3:6]).all()
