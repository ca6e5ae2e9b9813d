"""The vLLM connector's batched reads (``kvferry.integrations.vllm.reads``) between two
real engines, without vLLM: reads of one prefill rank that share their ranges ride
multi-key selected gets, batches close at ``read_batch`` keys and at
``MAX_BATCH_BYTES``, a batch that fails after staging fails each of its members with
that error (its slots were consumed), and one refused before staging (a key not
published yet) hands its members back to gets of their own, which land. Every landed
byte is compared with the source's head slice."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

import kvferry
from kvferry.integrations.vllm import reads as vllm_reads
from kvferry.integrations.vllm.mapping import Read
from kvferry.integrations.vllm.reads import RankReads, _Geometry, launch_batched

LAYERS, HEADS, TOKENS, D, NPUB = 2, 4, 16, 32, 2
PIECE = HEADS * TOKENS * D  # one layer's K (or V) of one block, HND
HALF = PIECE // 2

Pair = tuple[kvferry.Engine, kvferry.Engine]


@pytest.fixture
def pair() -> Iterator[Pair]:
    with kvferry.Engine(peer_id="prefill", transport="tcp") as p, kvferry.Engine(peer_id="decode") as d:
        yield p, d


def _setup(p: kvferry.Engine, d: kvferry.Engine, n: int, publish: int | None = None) -> tuple[Any, Any, dict[str, NDArray[np.uint8]], dict[str, NDArray[np.uint8]]]:
    """``n`` requests of NPUB blocks each, published (the first ``publish`` of them)
    under keys ``r<i>`` as the connector does (once); a decode cache with half the
    heads."""
    nb = n * NPUB
    rng = np.random.default_rng(7)
    src = {f"l{i}": rng.integers(0, 255, (2, nb, HEADS, TOKENS, D), dtype=np.uint8) for i in range(LAYERS)}
    dst = {f"l{i}": np.zeros((2, nb, HEADS // 2, TOKENS, D), dtype=np.uint8) for i in range(LAYERS)}
    s = p.register_kv_caches(src)
    t = d.register_kv_caches(dst)
    for i in range(n if publish is None else publish):
        p.publish(f"r{i}", s, [NPUB * i + b for b in range(NPUB)])
    return s, t, src, dst


def _reads(p: kvferry.Engine, d: kvferry.Engine, t: Any, n: int, defer: list[RankReads]) -> list[RankReads]:
    geo = _Geometry(pieces=[None] * (2 * LAYERS), src_piece_bytes=PIECE, npub=NPUB)
    peers = [{"address": p.address, "incarnation": p.incarnation}]
    now = time.monotonic()
    out = []
    for i in range(n):
        # The decode's blocks in reverse order: block b of request i lands at nb-1-(NPUB*i+b).
        dst_blocks = [n * NPUB - 1 - (NPUB * i + b) for b in range(NPUB)]
        rd = Read(rank=0, key=f"r{i}", blocks=list(range(NPUB)), dst_blocks=dst_blocks, src_ranges=[(HALF, HALF)], dst_ranges=None)
        out.append(
            RankReads(d, t, geo, [rd], peers, deadline=now + 10, retry_until=now + 5, path="direct", timeout=10, register=None, defer=defer)
        )
    return out


def _finish(reads: list[RankReads], bound: float = 10.0) -> None:
    end = time.monotonic() + bound
    while not all(r.done() for r in reads):
        assert time.monotonic() < end, "reads did not finish"
        time.sleep(0.002)
    while not all(r.drained() for r in reads):
        assert time.monotonic() < end, "reads did not drain"
        time.sleep(0.002)


def _landed(src: dict[str, NDArray[np.uint8]], dst: dict[str, NDArray[np.uint8]], n: int, i: int) -> bool:
    nb = n * NPUB
    return all(
        bool((dst[name][kv, nb - 1 - (NPUB * i + b)] == src[name][kv, NPUB * i + b, HEADS // 2 :]).all())
        for name in src
        for kv in (0, 1)
        for b in range(NPUB)
    )


def _gets(d: kvferry.Engine) -> int:
    c = d.stats()["consumer"]
    return int(c["completed"] + c["failed"] + c["cancelled"])


@pytest.mark.parametrize("cap_reads", [None, 2])
def test_batches_close_at_read_batch_and_at_the_byte_cap(pair: Pair, monkeypatch: pytest.MonkeyPatch, cap_reads: int | None) -> None:
    """16 reads of one prefill rank: 4 gets of 4 (spread over 4); with the byte cap at
    two reads' bytes, 8 gets of 2. Every head slice lands; every slot is released."""
    p, d = pair
    n = 16
    _, t, src, dst = _setup(p, d, n)
    one = 2 * LAYERS * NPUB * HALF
    if cap_reads is not None:
        monkeypatch.setattr(vllm_reads, "MAX_BATCH_BYTES", cap_reads * one)
    defer: list[RankReads] = []
    reads = _reads(p, d, t, n, defer)
    assert len(defer) == n and all(s.transfer is None for r in reads for s in r.subs), "defer starts nothing"
    launch_batched(defer, max_keys=8)
    _finish(reads)
    assert all(r.error is None for r in reads), [r.error for r in reads]
    assert all(_landed(src, dst, n, i) for i in range(n))
    assert _gets(d) == (4 if cap_reads is None else 8)
    assert d.stats()["consumer"]["bytes_received"] == n * one
    released = {k for k, why in p.released() if why == "done"}
    assert released == {f"r{i}" for i in range(n)}


def test_a_batch_that_fails_after_staging_fails_each_member(pair: Pair) -> None:
    """The producer corrupts its next send: the batch carrying it fails its checksum
    after its slots were staged (and consumed by its Done), so each of its members
    fails with ChecksumError — none is retried into a miss; the other batch lands."""
    p, d = pair
    n = 8  # 4 gets of 2
    _, t, src, dst = _setup(p, d, n)
    defer: list[RankReads] = []
    reads = _reads(p, d, t, n, defer)
    p._e._inject_faults(send_delay_us=0, corrupt_next_sends=1)
    launch_batched(defer, max_keys=8)
    _finish(reads)
    failed = [i for i, r in enumerate(reads) if r.error is not None]
    assert len(failed) == 2, [r.error for r in reads]
    assert all(isinstance(reads[i].error, kvferry.ChecksumError) for i in failed)
    assert all(_landed(src, dst, n, i) for i in range(n) if i not in failed)
    assert _gets(d) == 4, "the failed members were not got again"


def test_a_batch_refused_before_staging_hands_its_members_back(pair: Pair) -> None:
    """One key of a batch is published only after the batch missed: the miss staged
    nothing, so both members are got alone, with their retries, and land."""
    p, d = pair
    n = 8
    s, t, src, dst = _setup(p, d, n, publish=n - 1)
    defer: list[RankReads] = []
    reads = _reads(p, d, t, n, defer)
    launch_batched(defer, max_keys=8)
    end = time.monotonic() + 5
    while not all(r.done() for r in reads[: n - 2]):
        assert time.monotonic() < end
        time.sleep(0.002)
    assert not reads[n - 1].done()
    p.publish(f"r{n - 1}", s, [NPUB * (n - 1) + b for b in range(NPUB)])
    _finish(reads)
    assert all(r.error is None for r in reads), [r.error for r in reads]
    assert all(_landed(src, dst, n, i) for i in range(n))
