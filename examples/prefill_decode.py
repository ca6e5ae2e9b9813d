"""Disaggregated prefill/decode with the Python package, across two processes.

A *prefill* process fills blocks of its KV cache, publishes them under a request's key
(zero copy: blocks stay where they are, leased until the consumer is done) and reports
its address. A *decode* process pulls those blocks into other block ids of its own
cache and checks every byte; the prefill process then sees the publication released
(``done``) and may reuse its blocks.

    python examples/prefill_decode.py        # after: pip install ./crates/kvferry-py
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import sys
import time

import numpy as np

import kvferry

BLOCK_BYTES = 16 << 10
BLOCKS = 64
SRC_BLOCKS = [3, 4, 5, 9]
DST_BLOCKS = [20, 21, 22, 23]


def expected(block: int) -> np.ndarray:
    """The bytes prefill writes into ``block`` (so decode can check them)."""
    return np.random.default_rng(block).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def prefill(secret: str, to_decode: mp.Queue, from_decode: mp.Queue) -> None:
    with kvferry.Engine(secret=secret, peer_id="prefill") as engine:
        kv = np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8)
        for b in SRC_BLOCKS:
            kv[b] = expected(b)
        region = engine.register_kv_cache(kv, block_bytes=BLOCK_BYTES)
        engine.publish("request-42", region, block_ids=SRC_BLOCKS, ttl=30.0)
        to_decode.put(engine.address)
        verdict = from_decode.get(timeout=60)
        # The decode side's Done released the blocks; wait (bounded) to be told so.
        released: list[tuple[str, str]] = []
        for _ in range(200):
            released += engine.released()
            if released:
                break
            time.sleep(0.01)
        print(f"prefill: decode says {verdict}; released: {released}")
        if verdict != "ok" or [r for _, r in released] != ["done"]:
            sys.exit(1)


def decode(secret: str, from_prefill: mp.Queue, to_prefill: mp.Queue) -> None:
    address = from_prefill.get(timeout=60)
    with kvferry.Engine(secret=secret, peer_id="decode") as engine:
        out = np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8)
        region = engine.register_kv_cache(out, block_bytes=BLOCK_BYTES)
        n = engine.get_blocking(address, "request-42", region, block_ids=DST_BLOCKS, timeout=10.0)
        ok = all((out[d] == expected(s)).all() for s, d in zip(SRC_BLOCKS, DST_BLOCKS))
        print(f"decode: {n} chunk(s) from {address}, every byte {'matches' if ok else 'DIFFERS'}")
        to_prefill.put("ok" if ok else "mismatch")
        if not ok:
            sys.exit(1)


def main() -> int:
    ctx = mp.get_context("spawn")
    secret = secrets.token_hex(32)  # both processes share it; never sent over the wire
    p_to_d, d_to_p = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=prefill, args=(secret, p_to_d, d_to_p), name="prefill"),
        ctx.Process(target=decode, args=(secret, p_to_d, d_to_p), name="decode"),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    codes = {p.name: p.exitcode for p in procs}
    print(f"exit codes: {codes}")
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
