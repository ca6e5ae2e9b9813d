"""KvferryConnector between prefill and decode instances that differ: tensor-parallel
size (both directions, and replicated KV heads), block size (16↔32; 32↔64 on the CPU
backend, whose kernels take multiples of 32), KV cache layout (LBHNC↔LBNHC, and the
CPU backend's K/V planes ↔ flash-attn's packed cells), MLA, a local prefix hit, and an
incompatible pair — under vLLM 0.33.0's real scheduler on CPU (the harness:
``vllm_harness.py``), over KV tensors allocated by vLLM's own ``allocate_kv_cache`` for
each attention backend in ``BACKENDS`` (the CPU backend, flash-attn, Triton) and read
and written through that backend's own K/V views. Every pairing of
``test_every_decode_rank_holds_its_heads``, the abort and the prefill death run with
the prefill in a process of its own (its engine loop, its kvferry engines; SIGKILLed
mid-pull in the last).

Every decode rank's every head of every prompt token is compared with a reference
assembled from global heads, in the decode's own layout and block size.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kvferry.integrations.vllm.prompt import prompt_digest, publication_key
from vllm_harness import (
    BACKENDS,
    HEAD32,
    KV2,
    MLA_MODEL,
    Instance,
    RemoteInstance,
    needed,
    on_backend,
    prefill,
    prompts,
    pulled,
    released_by_rank,
    wire,
)
from vllm_pairs import CASES, transfer


def _cases() -> list[Any]:
    out = []
    for backend in BACKENDS:
        for case, (p_kw, d_kw) in CASES.items():
            if "backend" in p_kw and backend != BACKENDS[0]:
                continue  # a case naming its backends runs once
            if backend == "CPU_ATTN" and case.startswith("hnd-to-nhd"):
                continue  # the CPU backend has one layout
            out.append(pytest.param(backend, case, id=f"{backend}-{case}"))
    return out


@pytest.mark.parametrize("backend,case", _cases())
def test_every_decode_rank_holds_its_heads(made, backend, case):
    """Every decode rank's every head of every token checked, K and V, on KV tensors
    allocated by vLLM for ``backend``. On the CPU backend (what vLLM runs here) the
    prefill runs in a process of its own (its engine loop and kvferry engines); the
    GPU backends' layouts, allocated on CPU, run both instances in this process (the
    same connector code: only the memory layout differs), which keeps the suite's
    time within CI's budget."""
    p_kw, d_kw = (on_backend(kw, backend) for kw in CASES[case])
    p, d, reqs, need, moved = transfer(made, p_kw, d_kw, remote=backend == "CPU_ATTN")
    assert pulled(d)[0] == need  # the bytes the connector reports pulled: what the decode needs
    assert moved == need, (moved, need)  # partial gets: the wire carries exactly those bytes


@pytest.mark.parametrize("case", ["tp2-to-tp4", "bs32-to-bs16-tp2-to-tp4"])
def test_wire_carries_only_the_head_slices(made, case):
    p_kw, d_kw = CASES[case]
    _, _, _, need, moved = transfer(made, p_kw, d_kw, n=2)
    assert moved == need, (moved, need)


def test_prefix_hit_reads_only_the_missing_blocks(made):
    p = Instance("kv_producer", tp=2, tag="p")
    d = Instance("kv_consumer", tp=4, tag="d")
    made += [p, d]
    (rid, prompt), = prompts(1, seed=41, lo=80, hi=81)
    # The decode computes the first 48 tokens itself (three full blocks it caches)...
    d.add("warm", prompt[:48] + [5], 1, None)
    d.run_until(lambda: "warm" in d.final, 10, "the local prefill")
    # ...then a remote prefill of the whole prompt: only blocks 3 and 4 are read.
    params = prefill(p, [(rid, prompt)])[rid]
    d.stats.clear()
    wire0 = wire(d)
    d.add(rid, prompt, 2, params)
    d.run_until(lambda: rid in d.finished_recving, 20, "the pull")
    assert not d.failed_recving
    nbytes, nblocks = pulled(d)
    assert nblocks == d.tp * 2, nblocks
    # Bytes the decode needs: 2 blocks x (2 layers x K,V) x its heads' slice, per rank.
    assert nbytes == d.tp * 2 * 4 * (16 * d.hpr * d.hs * 2) == needed(p.bs, d, len(prompt), 48), nbytes
    assert wire(d) - wire0 == nbytes  # only the missing blocks' head slices crossed the wire
    for rank in range(d.tp):
        for pos in range(48, len(prompt)):
            assert d.landed[rid][rank][pos] == d.expected(prompt, rank, pos), (rank, pos)
    d.run_until(lambda: rid in d.final, 10, "the decode")
    p.run_until(lambda: rid not in p.held(), 10, "the prefill to free the request")
    assert p.free_blocks() == p.free_at_start


def test_incompatible_pair_is_refused_naming_the_difference(made):
    p = Instance("kv_producer", tp=1, model=HEAD32, kv_heads=2, head_size=32, tag="p")
    d = Instance("kv_consumer", tp=2, model=KV2, kv_heads=2, tag="d")
    made += [p, d]
    reqs = prompts(2, seed=43, lo=30, hi=50)
    params = prefill(p, reqs)
    import logging

    records: list[str] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    lg = logging.getLogger("kvferry.integrations.vllm")
    h = H()
    lg.addHandler(h)
    try:
        for rid, prompt in reqs:
            d.add(rid, prompt, max_tokens=2, params=params[rid])
        t = d.run_until(lambda: all(r in d.failed_recving for r, _ in reqs), 10, "the refusals")
    finally:
        lg.removeHandler(h)
    assert t < 5.0  # refused at once, no pull waited on
    refusals = [m for m in records if "refusing prefill engine" in m]
    assert len(refusals) == 1, records  # one verdict per prefill engine
    assert "head_size differs (prefill 32, decode 16)" in refusals[0]
    # The decode recomputes (kv_load_failure_policy "recompute"), and the prefill is
    # told at once: its blocks are freed long before the 30 s lease.
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the local recompute")
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 5, "the prefill to free the refused requests")
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start




def _in_flight_on_every_rank(d: Instance, rids: list[str]) -> None:
    """Every decode rank has a get of every request running (not landed, not failed)."""
    for rank, w in enumerate(d.workers()):
        for rid in rids:
            pull = w._pulls.get(rid)
            assert pull is not None and pull.transfer is not None, (rank, rid)
            assert not pull.transfer.done(), f"rank {rank}: the pull of {rid} already finished"


def test_abort_mid_pull_tp2_to_tp4_frees_every_rank_on_both_sides(made):
    """The prefill (TP 2) in its own process, its sends slowed; four decode ranks mid-pull
    when the decode aborts: the decode's blocks come back once each rank's gets drained,
    and every prefill rank frees the blocks within a round trip (each unread slot
    released), long before the 30 s lease; both schedulers end empty."""
    p = RemoteInstance("kv_producer", tp=2, tag="p", extra={"lease_ttl": 30.0, "timeout": 10.0})
    made.append(p)
    d = Instance("kv_consumer", tp=4, tag="d", extra={"timeout": 10.0})
    made.append(d)
    reqs = prompts(3, seed=45, lo=60, hi=90)
    params = p.prefill(reqs)
    p.faults(send_delay_us=300_000)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.step()  # the pulls start on every rank
    time.sleep(0.1)
    _in_flight_on_every_rank(d, [r for r, _ in reqs])
    t0 = time.monotonic()
    for rid, _ in reqs:
        d.abort(rid)
    d.run_until(lambda: not (d.held() & {r for r, _ in reqs}), 10, "the decode to free the aborted requests")
    st = p.wait_freed({r for r, _ in reqs}, 10)
    took = time.monotonic() - t0
    assert took < 5.0, took  # released, not expired (lease 30 s)
    assert {r for r, _ in reqs} <= set(st["finished_sending"])
    assert st["leaks"] == [] and st["free"] == st["free_at_start"], st
    assert not any(st["publishing"]), st
    assert d.leaks() == [] and d.free_blocks() == d.free_at_start
    for w in d.workers():
        assert w.engine.stats()["consumer"]["draining"] == 0 and not w._pulls and not w._draining
    assert not d.failed_recving  # aborted, not failed


@pytest.mark.parametrize("n", [3, 6])
def test_prefill_sigkilled_mid_pull_tp2_to_tp4_is_a_load_error_on_every_rank(made, n):
    """The prefill (TP 2, both ranks in one process of their own) is SIGKILLed while
    four decode ranks are mid-pull (sends slowed): every decode rank reports each
    request failed within its bound, the failed blocks are reported to vLLM, the
    requests are recomputed (``kv_load_failure_policy`` recompute), and every block of
    the decode comes back — vLLM's ``assert_scheduler_empty`` checks hold. Nothing
    hangs: the decode's shutdown is bounded too. With 6 requests the pulls ride batched
    gets (``read_batch``: 3 gets of 2 per rank), and a failed batch fails each of its
    requests the same way."""
    timeout = 8.0
    p = RemoteInstance("kv_producer", tp=2, tag="p", extra={"lease_ttl": 30.0, "timeout": 10.0})
    made.append(p)
    d = Instance("kv_consumer", tp=4, tag="d", extra={"timeout": timeout, "io_timeout": 2.0})
    made.append(d)
    reqs = prompts(n, seed=47, lo=60, hi=90)
    rids = [r for r, _ in reqs]
    params = p.prefill(reqs)
    # Published on every prefill rank before the decode starts: no pull misses and
    # falls back to a get of its own, so the batching below holds under any load.
    p.wait_published(set(rids))
    p.faults(send_delay_us=400_000)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.step()
    time.sleep(0.2)  # the gets are in flight on every rank
    _in_flight_on_every_rank(d, rids)
    if n > 3:
        batched = [r for r in rids if all(s.batch is not None for w in d.workers() for s in w._pulls[r].transfer.subs)]
        assert len(batched) >= 2, "the pulls ride batched gets"
    loading = {b for w in d.workers() for r in rids for b in w._pulls[r].spec.load_block_ids}
    killed = time.monotonic()
    assert p.kill() == -9
    d.run_until(lambda: all(r in d.failed_recving for r in rids), timeout + 2, "the load errors")
    for rank, failed in enumerate(d.rank_failed):
        for rid in rids:
            assert rid in failed, f"rank {rank} did not report {rid} failed"
            assert failed[rid] - killed < timeout, (rank, rid, failed[rid] - killed)
    worst = max(t - killed for failed in d.rank_failed for t in failed.values())
    print(f"every decode rank's load error within {worst * 1e3:.0f} ms of the SIGKILL (bound {timeout} s)")
    assert d.invalid_blocks == loading, "exactly the blocks the pulls were loading are reported"
    d.run_until(lambda: all(r in d.final for r in rids), 20, "vLLM to recompute the requests")
    assert all(str(d.final[r].finish_reason) == "length" for r in rids)
    d.run_until(lambda: not d.held(), 10, "the decode to free every request")
    assert d.leaks() == [] and d.free_blocks() == d.free_at_start
    for w in d.workers():
        assert w.engine.stats()["consumer"]["draining"] == 0 and not w._pulls and not w._draining
    t0 = time.monotonic()
    made.remove(d)
    d.close()  # releases still retrying against the dead prefill end with the engines
    assert time.monotonic() - t0 < timeout, time.monotonic() - t0


@pytest.mark.parametrize("case", ["tp2-to-tp4", "tp4-to-tp2"])
def test_reader_slots_need_no_config(made, case):
    """No ``reader_slots`` in either config: the prefill publishes its automatic number
    of slots (``vllm_hetero.auto_reader_slots``), the decode reads what its plan needs
    and releases the rest in one message per prefill rank and step, and every prefill
    rank frees every request once its readers are done — none waits for the lease."""
    from kvferry.integrations.vllm.hetero import auto_reader_slots

    p_kw, d_kw = CASES[case]
    p, d, reqs, need, moved = transfer(made, p_kw, d_kw)
    for inst in (p, d):
        assert "reader_slots" not in inst.vllm_config.kv_transfer_config.kv_connector_extra_config
    slots = auto_reader_slots("MHA", 4, p.tp)
    assert slots == {2: 4, 4: 2}[p.tp]
    assert all(w.reader_slots == slots for w in p.workers())
    assert moved == need
    for q, reasons in enumerate(released_by_rank(p)):
        assert sum(reasons.values()) == len(reqs), (q, reasons)
        assert set(k for k, v in reasons.items() if v) <= {"done", "declined"}, (q, reasons)  # never "expired"


def test_too_few_reader_slots_is_refused_naming_the_key(made):
    """A prefill set by hand to fewer reader slots than the decode's plan needs (TP 2→4
    reads each prefill rank twice): refused at the handshake, the error naming
    ``reader_slots``; the requests are recomputed and the prefill frees them at once."""
    import logging

    p = Instance("kv_producer", tp=2, tag="p", extra={"reader_slots": 1})
    d = Instance("kv_consumer", tp=4, tag="d")
    made += [p, d]
    reqs = prompts(2, seed=44, lo=30, hi=50)
    params = prefill(p, reqs)
    assert params[reqs[0][0]]["kvferry_desc"]["slots"] == 1
    records: list[str] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    lg = logging.getLogger("kvferry.integrations.vllm")
    h = H()
    lg.addHandler(h)
    try:
        for rid, prompt in reqs:
            d.add(rid, prompt, max_tokens=2, params=params[rid])
        d.run_until(lambda: all(r in d.failed_recving for r, _ in reqs), 10, "the refusals")
    finally:
        lg.removeHandler(h)
    (refusal,) = [m for m in records if "refusing prefill engine" in m]
    assert "reads one prefill rank 2 times" in refusal and "reader_slots" in refusal, refusal
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the local recompute")
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 5, "the prefill to free the refused requests")
    assert p.leaks() == [] and d.leaks() == []


MLA = {"model": MLA_MODEL, "mla": True, "head_size": 48}


@pytest.mark.parametrize("d_tp", [1, 4])
def test_mla_one_reader_per_decode_rank(made, d_tp):
    """MLA (a DeepSeek-V3-shaped config: one latent cache per layer, the same on every
    rank), prefill TP 2 → decode TP 1 and TP 4: decode rank *r* reads prefill rank
    ``r % 2`` whole, and nothing else (each prefill rank's ``bytes_sent`` is its readers'
    share); with TP 1 prefill rank 1 is read by nobody and releases every request at
    once, while rank 0 is still sending. Every latent of every token is compared."""
    p = Instance("kv_producer", tp=2, tag="p", **MLA)
    d = Instance("kv_consumer", tp=d_tp, tag="d", **MLA)
    made += [p, d]
    reqs = prompts(3, seed=61, lo=40, hi=90)
    rids = {r for r, _ in reqs}
    params = prefill(p, reqs)
    desc = params[reqs[0][0]]["kvferry_desc"]
    assert desc["attention"] == "MLA" and desc["num_kv_heads"] == 1 and desc["head_size"] == 48
    sent0 = [w.engine.stats()["producer"]["bytes_sent"] for w in p.workers()]
    wire0 = wire(d)
    if d_tp == 1:
        p.workers()[0].engine._e._inject_faults(send_delay_us=200_000, corrupt_next_sends=None)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    if d_tp == 1:
        r0, r1 = p.workers()
        d.step()  # the pulls start: rank 1's slots are released in the same step

        def rank1_released() -> bool:
            d.step()
            return not (rids & r1._sending)

        p.run_until(rank1_released, 5, "prefill rank 1 (read by nobody) to release its slots")
        assert rids <= r0._sending, "rank 0 is still sending (its sends are slowed)"
        r0.engine._e._inject_faults(send_delay_us=0, corrupt_next_sends=None)
    d.run_until(lambda: rids <= d.finished_recving.keys(), 20, "the pulls on every decode rank")
    assert not d.failed_recving
    for rid, prompt in reqs:
        for rank in range(d.tp):
            for pos in range(len(prompt)):
                assert d.landed[rid][rank][pos] == d.expected(prompt, rank, pos), (rid, rank, pos)
    need = sum(needed(p.bs, d, len(pr)) for _, pr in reqs)
    assert wire(d) - wire0 == need, (wire(d) - wire0, need)
    sent = [w.engine.stats()["producer"]["bytes_sent"] - s0 for w, s0 in zip(p.workers(), sent0)]
    per_reader = need // d_tp
    readers = [sum(1 for r in range(d_tp) if r % 2 == q) for q in range(2)]
    assert sent == [per_reader * n for n in readers], (sent, readers)
    d.run_until(lambda: rids <= set(d.final), 10, "the decodes")
    p.run_until(lambda: not (p.held() & rids), 10, "the prefill to free every request")
    assert p.leaks() == [] and d.leaks() == []
    rel = released_by_rank(p)
    if d_tp == 1:
        assert rel[1].get("declined") == len(reqs) and rel[0].get("done") == len(reqs), rel
    for reasons in rel:
        assert sum(reasons.values()) == len(reqs) and not reasons.get("expired"), rel


def test_a_planned_pull_that_missed_until_its_end_is_a_miss_not_relaunched(made):
    """Issue 41, defect 2: a planned pull (TP 1 → 2) of a key the prefill never
    publishes. Its ``RankReads`` retries the misses until its own ``retry_until`` and
    then fails with ``NotFoundError``; the worker reads its clock once per step,
    *before* ``RankReads`` does, so it may still see ``now < retry_until`` — widened
    here to certainty by moving the worker's copy of ``retry_until`` a minute on. Such a
    pull must be reported as the miss it is (a load error, kind ``miss``, its unread
    slots released), never relaunched: relaunching a planned pull tripped ``_launch``'s
    assertion and reported an ``other`` failure."""
    p = Instance("kv_producer", tp=1, tag="p")
    d = Instance("kv_consumer", tp=2, tag="d", extra={"timeout": 3.0})
    made += [p, d]
    (rid, prompt), = prompts(1, seed=77, lo=40, hi=60)
    params = dict(prefill(p, [(rid, prompt)])[rid])
    # A key the prefill never publishes, bound to this prompt (it passes the prompt check).
    params["remote_request_id"] = publication_key("never-published", prompt_digest(prompt))
    d.add(rid, prompt, max_tokens=2, params=params)
    d.step()  # the pulls start on both ranks
    for w in d.workers():
        pull = w._pulls[rid]
        assert pull.spec.plans is not None, "a planned pull (TP 1 -> 2)"
        pull.retry_until = time.monotonic() + 60.0  # the worker's stale view of the end
    t = d.run_until(lambda: rid in d.failed_recving, 10, "the miss to be reported")
    assert t < 6.0, t
    failed: dict[str, int] = {}
    for per_rank in d.rank_stats:
        for st in per_rank:
            for kind, n in st.get("failed", {}).items():
                failed[kind] = failed.get(kind, 0) + n
    assert failed.get("miss", 0) == d.tp and not failed.get("other"), failed
    d.run_until(lambda: rid in d.final, 10, "the local recompute")
    assert d.leaks() == [] and d.free_blocks() == d.free_at_start


def test_abort_of_a_failed_undrained_planned_pull_releases_its_unread_slots(made):
    """Issue 41, defect 3: a planned pull (TP 2 → 1) reads one slot from each prefill
    rank. Rank 0's bytes arrive and their scatter into the decode's (sim) device
    stalls until past ``device_timeout``: the pull fails, and has not drained (the
    stalled copy may still write its blocks). Rank 1 published late (its slot was a
    miss being retried), so that slot was never read. vLLM then aborts the request.
    The abort must release rank 1's unread slot at once: before the fix, the abort
    released only pulls without an error, and the slot stayed pinned until its lease
    ended (30 s). Counted black-box: rank 1's engine's ``published_now``."""
    from kvferry.errors import DeviceError

    p = Instance("kv_producer", tp=2, tag="p", extra={"lease_ttl": 30.0, "timeout": 10.0})
    d = Instance("kv_consumer", tp=1, tag="d", extra={"timeout": 10.0, "device": "sim", "device_timeout": 0.5})
    made += [p, d]
    late = p.workers()[1].engine
    held: list[tuple[Any, Any]] = []
    real_publish = late.publish
    late.publish = lambda *a, **kw: held.append((a, kw))  # rank 1 publishes late
    (rid, prompt), = prompts(1, seed=78, lo=40, hi=41)
    params = prefill(p, [(rid, prompt)])[rid]
    assert held, "rank 1 was to publish"
    eng = d.workers()[0].engine
    eng._e._inject_device_fault("stall", "next")  # rank 0's scatter into the decode
    try:
        d.add(rid, prompt, max_tokens=2, params=params)
        # A miss of rank 1's slot counts as a failed get too: wait for the pull itself
        # to have failed (rank 0's scatter timed out), its copy unconfirmed.
        w = d.workers()[0]
        d.run_until(lambda: rid in w._pulls and w._pulls[rid].error is not None, 10, "rank 0's read to fail at device_timeout")
        assert isinstance(w._pulls[rid].error, DeviceError), w._pulls[rid].error
        t = w._pulls[rid].transfer
        assert t is not None and not t.drained(), "the stalled copy may still write"
        assert rid not in d.finished_recving, "reported before its drain"
        del late.publish
        for a, kw in held:  # rank 1 publishes now: its reader slots
            real_publish(*a, **kw)
        pub = late.stats()["producer"]["published_now"]
        assert pub >= 1, pub
        d.abort(rid)
        d.step()
        d.run_until(lambda: late.stats()["producer"]["published_now"] == 0, 5, "rank 1's slots to be released")
        assert rid not in d.finished_recving, "blocks handed back while the device may write them"
    finally:
        eng._e._release_device()
    d.run_until(lambda: rid in d.finished_recving, 5, "the blocks, once drained")
    d.run_until(lambda: not d.scheduler.requests, 5, "the decode to drop the request")
    assert d.free_blocks() == d.free_at_start
    p.run_until(lambda: rid in p.finished_sending, 10, "the prefill to free the request")
    assert all(w.engine.stats()["producer"]["published_now"] == 0 for w in p.workers())
