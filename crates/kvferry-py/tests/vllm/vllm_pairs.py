"""Pairs of vLLM instances that differ, and the check of one transfer between them.

:data:`CASES` names prefill/decode argument pairs (tensor-parallel size both ways,
replicated KV heads, block size, KV cache layout, the CPU backend's K/V planes into
flash-attn's packed cells); :func:`transfer` prefills prompts on one side, pulls them
into the other and checks every decode rank's every head of every token and that both
sides end empty. test_connector_hetero.py runs every case on every backend,
test_connector_same_host.py some with the same-host mover.
"""

from __future__ import annotations

from typing import Any

from vllm_harness import KV2, Instance, RemoteInstance, check_landed, needed, prefill, prompts, wire


def transfer(
    made: list[Any],
    p_kw: dict[str, Any],
    d_kw: dict[str, Any],
    n: int = 3,
    seed: int = 31,
    lo: int = 20,
    hi: int = 90,
    remote: bool = False,
):
    """Prefill ``n`` prompts on a ``p_kw`` instance, pull them into a ``d_kw`` one,
    check every decode rank's every head of every token and that both sides end
    empty. ``remote``: the prefill runs in a process of its own (its engine loop, its
    kvferry engines), as vLLM deploys it; its state is then read over a pipe."""
    p_tp, p_bs = p_kw.get("tp", 1), p_kw.get("block_size", 16)
    p: Any = RemoteInstance("kv_producer", **p_kw, tag="p") if remote else Instance("kv_producer", **p_kw, tag="p")
    made.append(p)
    d = Instance("kv_consumer", **d_kw, tag="d")
    made.append(d)
    reqs = prompts(n, seed=seed, lo=lo, hi=hi)
    rids = {r for r, _ in reqs}
    params = p.prefill(reqs) if remote else prefill(p, reqs)
    wire0 = wire(d)
    for rid, prompt in reqs:
        assert params[rid]["kvferry_desc"]["tp_size"] == p_tp
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 20, "the pulls on every rank")
    assert not d.failed_recving, d.failed_recving
    for rid, prompt in reqs:
        check_landed(d, rid, prompt)
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
    # Every reader's Done (and the releases of the unused slots) arrived: every prefill
    # rank reports finished sending, and only then the scheduler frees the blocks.
    if remote:
        st = p.wait_freed(rids, 10)
        assert rids <= set(st["finished_sending"])
        assert st["leaks"] == [] and st["free"] == st["free_at_start"], st
        assert d.leaks() == [] and d.free_blocks() == d.free_at_start
    else:
        p.run_until(lambda: not (p.held() & rids), 10, "the prefill to free every request")
        assert rids <= p.finished_sending.keys()
        assert p.leaks() == [] and d.leaks() == []
        assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start
    for w in (d.workers() if remote else p.workers() + d.workers()):
        assert w.engine.stats()["consumer"]["draining"] == 0
    need = sum(needed(p_bs, d, len(pr)) for _, pr in reqs)
    return p, d, reqs, need, wire(d) - wire0


CASES = {
    "tp1-to-tp2": ({"tp": 1}, {"tp": 2}),
    "tp2-to-tp1": ({"tp": 2}, {"tp": 1}),
    "tp2-to-tp4": ({"tp": 2, "layout": "HND"}, {"tp": 4, "layout": "HND"}),
    "tp4-to-tp2": ({"tp": 4, "layout": "HND"}, {"tp": 2, "layout": "HND"}),
    "tp2-to-tp4-replicated": ({"tp": 2, "model": KV2, "kv_heads": 2}, {"tp": 4, "model": KV2, "kv_heads": 2}),
    "tp4-to-tp1-replicated": ({"tp": 4, "model": KV2, "kv_heads": 2}, {"tp": 1, "model": KV2, "kv_heads": 2}),
    "bs16-to-bs32-tp2-to-tp4": ({"tp": 2, "block_size": 16}, {"tp": 4, "block_size": 32}),
    "bs32-to-bs16-tp2-to-tp4": ({"tp": 2, "block_size": 32}, {"tp": 4, "block_size": 16}),
    "hnd-to-nhd-tp2-to-tp4": ({"tp": 2, "layout": "HND"}, {"tp": 4, "layout": "NHD"}),
    # The CPU backend's K and V planes (HKND) into flash-attn's packed LBNHC cells (NHKD).
    "cpu-planes-to-flash-nhd-tp2-to-tp4": (
        {"tp": 2, "backend": "CPU_ATTN", "block_size": 32},
        {"tp": 4, "backend": "FLASH_ATTN", "layout": "NHD", "block_size": 32},
    ),
}
