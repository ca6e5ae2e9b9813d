"""KvferryConnector under vLLM's hybrid memory allocator: a sliding-window group and a
full-attention group (as Gemma 3 and gpt-oss are served), two KV cache groups sharing
one KV tensor per layer pair, vLLM 0.33.0's real scheduler and hybrid coordinator on
CPU, prefill TP 2 → decode TP 4. ``request_finished_all_groups`` hands the connector
one block list per group; only the sliding window's blocks move for its group.
Also: a KV cache kind kvferry cannot move (Mamba state) is refused at start-up."""

from __future__ import annotations

from typing import Any

import pytest
from test_connector import LAYERS, need_vllm, prompts  # noqa: F401
from test_connector_hetero import KV4, HInstance, _pattern, _prefill, _wire, heads_of

WINDOW = 32


class HybridInstance(HInstance):
    """``HInstance`` whose layer 0 is full attention and layer 1 a sliding window:
    two KV cache groups, one tensor shared by both (vLLM's layout for equal page sizes)."""

    def __init__(self, role: str, *, tp: int, extra: dict[str, Any] | None = None, num_blocks: int = 96, tag: str = "") -> None:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec

        self._groups_made = True
        hpr = max(1, 4 // tp)
        bs = 16
        full = FullAttentionSpec(block_size=bs, num_kv_heads=hpr, head_size=16, dtype=torch.float16)
        swa = SlidingWindowSpec(block_size=bs, num_kv_heads=hpr, head_size=16, dtype=torch.float16, sliding_window=WINDOW)
        page = 2 * bs * hpr * 16 * 2
        self._kvc = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=list(LAYERS), layer_stride=0, block_stride=page)],  # aliased
            kv_cache_groups=[KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], swa)],
        )
        super().__init__(role, tp=tp, model=KV4, kv_heads=4, extra=extra, num_blocks=num_blocks, tag=tag)

    def make_kv_cache_config(self, num_blocks: int, spec: Any) -> Any:
        return self._kvc

    def make_caches(self, num_blocks: int) -> dict[str, Any]:
        import torch

        t = torch.zeros((2, num_blocks, self.bs, self.hpr, self.hs), dtype=torch.float16)
        return {n: t for n in LAYERS}  # one tensor, both layers (both groups)

    def group_blocks(self, rid: str, layer: int) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[layer])


def test_sliding_window_moves_only_the_window(need_vllm):  # noqa: F811
    made: list[HInstance] = []
    try:
        p = HybridInstance("kv_producer", tp=2, tag="p")
        made.append(p)
        d = HybridInstance("kv_consumer", tp=4, tag="d")
        made.append(d)
        assert len(p.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups) == 2
        reqs = prompts(2, seed=51, lo=90, hi=120)
        params = _prefill(p, reqs)
        for rid, _ in reqs:
            ids = params[rid]["remote_block_ids"]
            assert len(ids) == 2  # one list per group
        wire0 = _wire(d)
        for rid, prompt in reqs:
            d.add(rid, prompt, max_tokens=2, params=params[rid])
        d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 20, "the pulls")
        assert not d.failed_recving
        need = 0
        for rid, prompt in reqs:
            n = len(prompt)
            first = max(0, n - WINDOW) // 16  # first block the window touches
            nblk = -(-n // 16)
            # Bytes needed: layer 0 (full) every block, layer 1 (window) its blocks; the
            # shared tensor moves both layers' block ids in full (K and V, its heads).
            need += d.tp * (nblk + (nblk - first)) * 2 * (16 * d.hpr * 32)
            for rank in range(d.tp):
                a, _ = heads_of(rank, d.tp, 4)
                for layer in (0, 1):
                    blocks = d.landed_groups[rid][layer]
                    for pos in range(n):
                        if layer == 1 and pos // 16 < first:
                            continue  # outside the window: not moved, not needed
                        b, off = blocks[pos // 16], pos % 16
                        for kvi in (0, 1):
                            for hh in range(d.hpr):
                                got = bytes(d.raw(rank, LAYERS[layer], kvi, b, off, hh).reshape(-1).numpy())
                                assert got == bytes(_pattern(prompt[pos], pos, layer, kvi, a + hh).numpy()), (rid, rank, layer, pos)
        # Only the window crossed for the sliding group, and only each rank's heads.
        assert _wire(d) - wire0 == need, (_wire(d) - wire0, need)
        d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
        p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 10, "the prefill to free the requests")
        assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start
    finally:
        for i in made:
            i.close()


def test_mamba_state_is_refused_at_start_up(need_vllm):  # noqa: F811
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvferry.integrations import vllm_hetero

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
