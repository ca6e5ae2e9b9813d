"""Batched gets (``read_batch``): the reads a decode step starts from one prefill rank
ride a few multi-key kvferry gets instead of one get per request — under vLLM 0.33.0's
real scheduler on CPU (``vllm_harness.py``), with partial gets (TP 2→4: each decode
rank's heads of every block) and whole publications (TP 2→2).

Each test checks every decode rank's every head of every prompt token against the
reference, that both schedulers end empty, and what a batch must never do: fail a
request that a get of its own would have landed (a member whose key is not published,
an aborted member), or write a request's blocks from two gets at once.
"""

from __future__ import annotations

import time

import pytest
from kvferry.integrations.vllm.prompt import prompt_digest, publication_key
from vllm_harness import (
    Instance,
    RemoteInstance,
    needed,
    prefill,
    prompts,
    wire,
)

CASES = {
    "tp2-to-tp4": ({"tp": 2, "layout": "HND"}, {"tp": 4, "layout": "HND"}),  # selected gets
    "tp2-to-tp2": ({"tp": 2}, {"tp": 2}),  # whole publications
}


def _gets(d: Instance) -> list[int]:
    """Gets each decode rank's engine finished (landed, failed or cancelled)."""
    out = []
    for w in d.workers():
        c = w.engine.stats()["consumer"]
        out.append(c["completed"] + c["failed"] + c["cancelled"])
    return out


def _check_landed(d: Instance, reqs: list[tuple[str, list[int]]]) -> None:
    for rid, prompt in reqs:
        for rank in range(d.tp):
            for pos in range(len(prompt)):
                assert d.landed[rid][rank][pos] == d.expected(prompt, rank, pos), (rid, rank, pos)


@pytest.mark.parametrize("read_batch", [8, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_a_step_of_requests_rides_few_gets(made, case, read_batch):
    """Twelve requests reach the decode together: with ``read_batch`` 8 each decode
    rank moves them in a few gets (in one step: 4, spread over the pooled connections,
    3 keys each), with 1 in 12; the same bytes land either way, the wire carries only what the decode
    needs, and every slot is released (the prefill frees every request)."""
    p_kw, d_kw = CASES[case]
    p = Instance("kv_producer", **p_kw, tag="p")
    made.append(p)
    d = Instance("kv_consumer", **d_kw, tag="d", extra={"read_batch": read_batch})
    made.append(d)
    reqs = prompts(12, seed=61, lo=20, hi=60)
    params = prefill(p, reqs)
    gets0, wire0 = _gets(d), wire(d)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 20, "the pulls")
    assert not d.failed_recving, d.failed_recving
    _check_landed(d, reqs)
    gets = [b - a for a, b in zip(gets0, _gets(d))]
    if read_batch > 1:  # 12 in one step: 4 gets of 3; over two steps, at most 6 of 2
        assert all(g <= 6 for g in gets), gets
    else:
        assert gets == [12] * d.tp, gets
    assert wire(d) - wire0 == sum(needed(p.bs, d, len(pr)) for _, pr in reqs)
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 10, "the prefill to free every request")
    assert p.leaks() == [] and d.leaks() == []
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start


@pytest.mark.parametrize("case", list(CASES))
def test_a_member_never_published_fails_alone(made, case):
    """One request of the step names a key the prefill never published (its lease
    advertised to end in a second): the batch carrying it misses (a selected get) or
    lands only the keys before it (a plain get); every other request is got alone and
    lands, the ghost alone is a load error, reported with exactly its blocks."""
    p_kw, d_kw = CASES[case]
    p = Instance("kv_producer", **p_kw, tag="p")
    made.append(p)
    d = Instance("kv_consumer", **d_kw, tag="d")
    made.append(d)
    reqs = prompts(9, seed=63, lo=20, hi=60)
    params = prefill(p, reqs)
    ghost_prompt = reqs[4][1]
    # A key bound to the ghost's own prompt (it passes the prompt check) that no one published.
    ghost_key = publication_key("ghost", prompt_digest(ghost_prompt))
    ghost = dict(params[reqs[4][0]], remote_request_id=ghost_key, kvferry_expires_at=time.time() + 1.0)
    order = reqs[:4] + [("ghost", ghost_prompt)] + reqs[4:]
    for rid, prompt in order:
        d.add(rid, prompt, max_tokens=2, params=ghost if rid == "ghost" else params[rid])
    d.step()
    ghost_blocks = {b for w in d.workers() for b in w._pulls["ghost"].spec.load_block_ids}
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs) and "ghost" in d.failed_recving, 20, "the pulls")
    assert set(d.failed_recving) == {"ghost"}, d.failed_recving
    assert d.invalid_blocks == ghost_blocks, "exactly the ghost's blocks are reported"
    _check_landed(d, reqs)
    d.run_until(lambda: all(r in d.final for r, _ in order), 20, "the decodes (the ghost recomputed)")
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 10, "the prefill to free every request")
    assert p.leaks() == [] and d.leaks() == []
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start


def test_an_aborted_member_does_not_fail_the_others(made):
    """The prefill (TP 2) in its own process, its sends slowed; six requests ride
    batched gets on four decode ranks when the decode aborts one: the gets carrying it
    go on for the others (the aborted member only leaves) — all five land with the
    right bytes, the aborted one's blocks come back once the gets that write them
    finished, and the prefill frees all six."""
    p = RemoteInstance("kv_producer", tp=2, layout="HND", tag="p", extra={"lease_ttl": 30.0, "timeout": 10.0})
    made.append(p)
    d = Instance("kv_consumer", tp=4, layout="HND", tag="d", extra={"timeout": 10.0})
    made.append(d)
    reqs = prompts(6, seed=65, lo=20, hi=50)
    rids = [r for r, _ in reqs]
    params = p.prefill(reqs)
    p.faults(send_delay_us=200_000)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.step()
    time.sleep(0.05)
    batched = [rid for rid in rids if all(s.batch is not None for w in d.workers() for s in w._pulls[rid].transfer.subs)]
    assert len(batched) >= 2, "requests from one prefill rank ride batched gets"
    victim = batched[0]
    d.abort(victim)
    p.faults(send_delay_us=0)
    others = [r for r in rids if r != victim]
    d.run_until(lambda: all(r in d.finished_recving for r in others), 20, "the other pulls")
    assert not d.failed_recving, d.failed_recving
    _check_landed(d, [(r, pr) for r, pr in reqs if r != victim])
    d.run_until(lambda: all(r in d.final for r in others) and not (d.held() & set(rids)), 20, "the decodes and the abort")
    assert d.leaks() == [] and d.free_blocks() == d.free_at_start
    for w in d.workers():
        assert w.engine.stats()["consumer"]["draining"] == 0 and not w._pulls and not w._draining
    st = p.wait_freed(set(rids), 10)
    assert st["leaks"] == [] and st["free"] == st["free_at_start"], st


def test_read_batch_is_checked(made):
    """A ``read_batch`` outside 1..64 is refused when the connector is made, naming the key."""
    with pytest.raises(ValueError, match="read_batch"):
        Instance("kv_consumer", tp=1, tag="d", extra={"read_batch": 0})
    with pytest.raises(ValueError, match="read_batch"):
        Instance("kv_consumer", tp=1, tag="d", extra={"read_batch": "8"})
