"""KvferryConnector under vLLM's hybrid memory allocator: a sliding-window group and a
full-attention group (as Gemma 3 and gpt-oss are served), two KV cache groups sharing
one KV tensor per rank, vLLM 0.33.0's real scheduler and hybrid coordinator on CPU
(harness: ``vllm_harness.HybridInstance``). ``request_finished_all_groups`` hands the
connector one block list per group; only the sliding window's blocks move for its group
— with equal shapes, and combined with block sizes that differ (16→32, 32→16) and with
LBHNC→LBNHC, each with prefill TP 2 → decode TP 4, on KV tensors vLLM allocates for
each attention backend in ``BACKENDS`` (the CPU backend with block sizes 32↔64).
Also: a KV cache kind kvferry cannot move (Mamba state) is refused at start-up."""

from __future__ import annotations

import pytest
from vllm_harness import (
    BACKENDS,
    LAYERS,
    HybridInstance,
    on_backend,
    pattern,
    prefill,
    prompts,
    wire,
)

WINDOW = 32

CASES = {
    "same-shapes-tp2-to-tp4": ({"tp": 2}, {"tp": 4}),
    "bs16-to-bs32-tp2-to-tp4": ({"tp": 2, "block_size": 16}, {"tp": 4, "block_size": 32}),
    "bs32-to-bs16-tp2-to-tp4": ({"tp": 2, "block_size": 32}, {"tp": 4, "block_size": 16}),
    "hnd-to-nhd-tp2-to-tp4": ({"tp": 2, "layout": "HND"}, {"tp": 4, "layout": "NHD"}),
    "nhd-to-hnd-bs32-to-bs16-tp4-to-tp2": ({"tp": 4, "block_size": 32}, {"tp": 2, "block_size": 16, "layout": "HND"}),
}


def _cases() -> list[object]:
    out = []
    for backend in BACKENDS:
        for case in CASES:
            if backend == "CPU_ATTN" and "hnd" in case:
                continue  # the CPU backend has one layout
            out.append(pytest.param(backend, case, id=f"{backend}-{case}"))
    return out


@pytest.mark.parametrize("backend,case", _cases())
def test_sliding_window_moves_only_the_window(made, backend, case):
    """On KV tensors vLLM allocates for ``backend`` (CPU: block sizes doubled)."""
    p_kw, d_kw = (on_backend(kw, backend) for kw in CASES[case])
    p = HybridInstance("kv_producer", window=WINDOW, tag="p", **p_kw)
    made.append(p)
    d = HybridInstance("kv_consumer", window=WINDOW, tag="d", **d_kw)
    made.append(d)
    assert len(p.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups) == 2
    reqs = prompts(2, seed=51, lo=90, hi=120)
    params = prefill(p, reqs)
    for rid, _ in reqs:
        assert len(params[rid]["remote_block_ids"]) == 2  # one list per group
        assert "reader_slots" not in p.vllm_config.kv_transfer_config.kv_connector_extra_config
    wire0 = wire(d)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 20, "the pulls")
    assert not d.failed_recving
    g = min(p.bs, d.bs)  # the finer block grid: what one read moves per block pair
    slot_bytes = 2 * d.hpr * d.hs * 2  # K and V of a rank's heads, one token
    need = 0
    for rid, prompt in reqs:
        n = len(prompt)
        first_p = max(0, n - WINDOW) // p.bs  # the prefill's first block in the window
        groups = d.landed_groups[rid]
        cells = -(-n // g)
        full = cells * g
        # Sliding group: cells the prefill published (in the window) and the decode holds.
        window_cells = [
            c for c in range(cells) if (c * g) // p.bs >= first_p and groups[1][(c * g) // d.bs] != 0
        ]
        assert all(c in window_cells for c in range(max(0, n - WINDOW) // g, cells)), "the window is covered"
        assert len(window_cells) < cells, "tokens before the window stay behind"
        need += d.tp * (full + len(window_cells) * g) * slot_bytes
        moved = {0: set(range(n)), 1: {t for c in window_cells for t in range(c * g, min(n, c * g + g))}}
        for rank in range(d.tp):
            a = d.first_head(rank)
            for layer in (0, 1):
                for pos in sorted(moved[layer]):
                    # The bytes as they were when the request's pull finished (a later
                    # step recomputes the last token with the decode's own salt).
                    slot = d.landed_layers[rid][rank][layer][pos]
                    assert slot is not None, (rid, rank, layer, pos)
                    for kvi in (0, 1):
                        for hh in range(d.hpr):
                            want = bytes(pattern(prompt[pos], pos, layer, kvi, a + hh, d.hs * 2, 1).numpy())
                            assert slot[kvi * d.hpr + hh] == want, (rid, rank, layer, pos)
    # Only the window crossed for the sliding group, and only each rank's heads.
    assert wire(d) - wire0 == need, (wire(d) - wire0, need)
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 10, "the prefill to free the requests")
    assert p.leaks() == [] and d.leaks() == []
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start


def test_mamba_state_is_refused_at_start_up(need_vllm):  # noqa: F811
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvferry.integrations.vllm import hetero as vllm_hetero

    cfg = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([LAYERS[0]], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float16)),
            KVCacheGroupSpec([LAYERS[1]], MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float16,))),
        ],
    )
    with pytest.raises(ValueError, match=r"KV cache group 1 \(MambaSpec.*not Mamba/SSM state"):
        vllm_hetero.groups_of(cfg)

