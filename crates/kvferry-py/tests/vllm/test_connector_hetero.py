"""KvferryConnector between prefill and decode instances that differ: tensor-parallel
size (both directions, and replicated KV heads), block size (16↔32), KV layout
(HND↔NHD), a local prefix hit, and an incompatible pair — under vLLM 0.33.0's real
scheduler on CPU.

Each instance is one real ``Scheduler`` with one worker-side connector per TP rank
(each its own kvferry engine and address), driven as vLLM's executor drives its
workers, outputs combined by vLLM's ``KVOutputAggregator`` (as in test_connector_tp.py).
The prefill's "forward" writes, into every rank's cache, bytes that depend only on
(token, position, layer, K/V, *global* KV head): the reference a decode rank must hold
is assembled from its own heads, in its own layout and block size, so a read from the
wrong rank, head, token range or layout cannot pass.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_connector import LAYERS, MODEL_DIR, need_vllm, prompts  # noqa: F401

HEAD_SIZE = 16
HEAD_BYTES = HEAD_SIZE * 2  # float16
HERE = Path(__file__).parent
KV4 = str(HERE / "tiny-llama-kv4")  # 4 KV heads (8 query heads)
KV2 = MODEL_DIR  # 2 KV heads (4 query heads)
HEAD32 = str(HERE / "head32" / "tiny-llama")  # as tiny-llama, head size 32


def _pattern(token: int, pos: int, layer: int, kv: int, head: int, hb: int = HEAD_BYTES):
    import torch

    base = (token * 7 + pos * 13 + layer * 29 + kv * 101 + head * 57) % 256
    return (torch.arange(hb, dtype=torch.int32) * 3 + base).remainder(256).to(torch.uint8)


def heads_of(rank: int, tp: int, heads: int) -> tuple[int, int]:
    if tp <= heads:
        return rank * heads // tp, (rank + 1) * heads // tp
    h = rank * heads // tp
    return h, h + 1


class HInstance:
    """A real scheduler plus one worker-side connector per TP rank; KV tensors in
    ``layout`` (HND: heads outside tokens in memory, a permuted view as vLLM makes it)."""

    def __init__(
        self,
        role: str,
        *,
        tp: int,
        model: str = KV4,
        kv_heads: int = 4,
        block_size: int = 16,
        layout: str = "NHD",
        head_size: int = HEAD_SIZE,
        extra: dict[str, Any] | None = None,
        num_blocks: int = 96,
        tag: str = "",
    ) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.utils.hashing import sha256

        self.tp, self.bs, self.layout, self.kv_heads, self.hs = tp, block_size, layout, kv_heads, head_size
        self.hpr = max(1, kv_heads // tp)
        extra = {"timeout": 10.0, "lease_ttl": 30.0, "arena_bytes": 4 << 20, "reader_slots": 4, **(extra or {})}

        def config(rank: int) -> VllmConfig:
            cfg = VllmConfig(
                model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=1024, seed=0),
                cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
                scheduler_config=SchedulerConfig(
                    max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=1024, is_encoder_decoder=False
                ),
                parallel_config=ParallelConfig(tensor_parallel_size=tp),
                device_config=DeviceConfig("cpu"),
                kv_transfer_config=KVTransferConfig(
                    kv_connector="KvferryConnector",
                    kv_connector_module_path="kvferry.integrations.vllm",
                    kv_role=role,
                    kv_connector_extra_config=extra,
                    engine_id=f"h-{role}-{tp}-{block_size}-{layout}-{tag}-{id(self)}",
                ),
            )
            cfg.parallel_config.rank = rank
            return cfg

        self.vllm_config = config(0)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=self.hpr, head_size=head_size, dtype=torch.float16)
        page = 2 * block_size * self.hpr * head_size * 2
        self.kv_cache_config = self.make_kv_cache_config(num_blocks, spec) or KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=0, block_stride=page) for n in LAYERS],
            kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            log_stats=False,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.ranks, self.kv = [], []
        for r in range(tp):
            c = KVConnectorFactory.create_connector(config(r), KVConnectorRole.WORKER, self.kv_cache_config)
            kv = self.make_caches(num_blocks)
            c.register_kv_caches(kv)
            self.ranks.append(c)
            self.kv.append(kv)
        hs = {(0, r): c.get_handshake_metadata() for r, c in enumerate(self.ranks)}
        self.scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware(hs)
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.free_at_start = self.free_blocks()
        self.final: dict[str, Any] = {}
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.invalid: set[int] = set()
        self.landed: dict[str, list[list[list[bytes]]]] = {}  # rid -> rank -> pos -> per (layer, kv, head)
        self.landed_groups: dict[str, list[list[int]]] = {}  # rid -> its blocks per group when it landed
        self.stats: list[dict[str, Any]] = []

    def make_kv_cache_config(self, num_blocks: int, spec: Any) -> Any:
        return None  # the default: one full-attention group, one tensor per layer

    def make_caches(self, num_blocks: int) -> dict[str, Any]:
        import torch

        kv = {}
        for n in LAYERS:
            if self.layout == "HND":
                phys = torch.zeros((2, num_blocks, self.hpr, self.bs, self.hs), dtype=torch.float16)
                kv[n] = phys.permute(0, 1, 3, 2, 4)  # logical [2, blocks, tokens, heads, head_size]
            else:
                kv[n] = torch.zeros((2, num_blocks, self.bs, self.hpr, self.hs), dtype=torch.float16)
        return kv

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params} if params else None)
        self.scheduler.add_request(Request(req_id, list(prompt), sp, None, block_hasher=self.hasher))

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def raw(self, rank: int, layer: str, kvi: int, block: int, off: int, head: int):
        import torch

        return self.kv[rank][layer][kvi, block, off, head].view(torch.uint8)

    def step(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        so = self.scheduler.schedule()
        req_ids = list(so.num_scheduled_tokens)
        outs = []
        for rank, conn in enumerate(self.ranks):
            kv_transfer_state._KV_CONNECTOR_AGENT = conn
            sampled: list[list[int]] = []
            a, _ = heads_of(rank, self.tp, self.kv_heads)
            with (
                set_forward_context(None, self.vllm_config),
                KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kvo,
            ):
                for rid in req_ids:
                    req = self.scheduler.requests[rid]
                    n = so.num_scheduled_tokens[rid]
                    end = req.num_computed_tokens
                    groups = self.scheduler.kv_cache_manager.get_block_ids(rid)
                    toks = req.all_token_ids
                    for pos in range(end - n, end):
                        for li, name in enumerate(LAYERS):
                            blocks = groups[li if len(groups) > 1 else 0]  # a layer's group's blocks
                            b, off = blocks[pos // self.bs], pos % self.bs
                            for kvi in (0, 1):
                                for hh in range(self.hpr):
                                    self.raw(rank, name, kvi, b, off, hh).view(-1)[:] = _pattern(
                                        toks[pos], pos, li, kvi, a + hh, self.hs * 2
                                    )
                    sampled.append([3 + (end * 17) % 1000] if end >= req.num_tokens else [])
            outs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=kvo,
                )
            )
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        mro = self.aggregator.aggregate(outs)
        kvo = mro.kv_connector_output
        if kvo.kv_connector_stats is not None:
            self.stats.append(kvo.kv_connector_stats.to_dict())
        self.finished_sending |= kvo.finished_sending or set()
        self.finished_recving |= kvo.finished_recving or set()
        self.failed_recving |= kvo.failed_recving or set()
        self.invalid |= kvo.invalid_block_ids or set()
        for outs_ in self.scheduler.update_from_output(so, mro).values():
            for o in outs_.outputs:
                if o.finish_reason is not None:
                    self.final[o.request_id] = o
        for rid in kvo.finished_recving or ():
            req = self.scheduler.requests.get(rid)
            if req is not None and not req.is_finished() and rid not in (kvo.failed_recving or ()):
                groups = self.scheduler.kv_cache_manager.get_block_ids(rid)
                self.landed_groups[rid] = [list(g) for g in groups]
                if len(groups) > 1:
                    continue
                (blocks,) = groups
                self.landed[rid] = [
                    [self.slot(rank, blocks, pos) for pos in range(req.num_prompt_tokens)] for rank in range(self.tp)
                ]

    def slot(self, rank: int, blocks: list[int], pos: int) -> list[bytes]:
        b, off = blocks[pos // self.bs], pos % self.bs
        return [
            bytes(self.raw(rank, n, kvi, b, off, hh).reshape(-1).numpy()) for n in LAYERS for kvi in (0, 1) for hh in range(self.hpr)
        ]

    def expected(self, prompt: list[int], rank: int, pos: int) -> list[bytes]:
        a, _ = heads_of(rank, self.tp, self.kv_heads)
        return [
            bytes(_pattern(prompt[pos], pos, li, kvi, a + hh, self.hs * 2).numpy())
            for li in range(len(LAYERS))
            for kvi in (0, 1)
            for hh in range(self.hpr)
        ]

    def run_until(self, pred, timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while not pred():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            self.step()
            time.sleep(0.002)
        return time.monotonic() - t0

    def held(self) -> set[str]:
        return set(self.scheduler.requests)

    def close(self) -> None:
        for c in self.ranks:
            c.shutdown()


@pytest.fixture
def made(need_vllm):  # noqa: F811
    out: list[HInstance] = []
    yield out
    for i in out:
        i.close()


def _prefill(p: HInstance, reqs: list[tuple[str, list[int]]]) -> dict[str, dict[str, Any]]:
    for rid, prompt in reqs:
        p.add(rid, prompt, 1, {"do_remote_decode": True})
    p.run_until(lambda: all(r in p.final for r, _ in reqs), 30, "the prefills")
    p.step()  # the step after: the workers publish
    return {r: p.final[r].kv_transfer_params for r, _ in reqs}


def _pulled(d: HInstance) -> tuple[int, int]:
    """(bytes, blocks) the decode's ranks report pulled, over every step."""
    return (
        sum(sum(s.get("pull_bytes", [])) for s in d.stats),
        sum(sum(s.get("pull_blocks", [])) for s in d.stats),
    )


def _wire(d: HInstance) -> int:
    """Payload bytes every decode rank's engine received."""
    return sum(c.connector_worker.engine.stats()["consumer"]["bytes_received"] for c in d.ranks)


def _needed(p: HInstance, d: HInstance, ntok: int, skip_tokens: int = 0) -> int:
    """Bytes the decode needs for one prompt: every token slot of the finer block grid
    from ``skip_tokens`` to the prompt's end, K and V of 2 layers, each rank's heads."""
    g = min(p.bs, d.bs)
    slots = (-(-ntok // g) - skip_tokens // g) * g
    return d.tp * slots * 2 * len(LAYERS) * d.hpr * d.hs * 2


def _transfer(made, p_kw: dict[str, Any], d_kw: dict[str, Any], n: int = 3, seed: int = 31, lo: int = 20, hi: int = 90):
    p = HInstance("kv_producer", **p_kw, tag="p")
    made.append(p)
    d = HInstance("kv_consumer", **d_kw, tag="d")
    made.append(d)
    reqs = prompts(n, seed=seed, lo=lo, hi=hi)
    params = _prefill(p, reqs)
    wire0 = _wire(d)
    for rid, prompt in reqs:
        assert params[rid]["kvferry_desc"]["tp_size"] == p.tp
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 20, "the pulls on every rank")
    assert not d.failed_recving, d.failed_recving
    for rid, prompt in reqs:
        for rank in range(d.tp):
            for pos in range(len(prompt)):
                assert d.landed[rid][rank][pos] == d.expected(prompt, rank, pos), (rid, rank, pos)
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
    # Every reader's Done (and the releases of the unused slots) arrived: every prefill
    # rank reports finished sending, and only then the scheduler frees the blocks.
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 10, "the prefill to free every request")
    assert {r for r, _ in reqs} <= p.finished_sending
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start
    for c in p.ranks + d.ranks:
        assert c.connector_worker.engine.stats()["consumer"]["draining"] == 0
    need = sum(_needed(p, d, len(pr)) for _, pr in reqs)
    return p, d, reqs, need, _wire(d) - wire0


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
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_decode_rank_holds_its_heads(made, case):
    p_kw, d_kw = CASES[case]
    p, d, reqs, need, wire = _transfer(made, p_kw, d_kw)
    assert _pulled(d)[0] == need  # the bytes the connector reports pulled: what the decode needs
    assert wire == need, (wire, need)  # partial gets: the wire carries exactly those bytes


@pytest.mark.parametrize("case", ["tp2-to-tp4", "bs32-to-bs16-tp2-to-tp4"])
def test_wire_carries_only_the_head_slices(made, case):
    p_kw, d_kw = CASES[case]
    _, _, _, need, wire = _transfer(made, p_kw, d_kw, n=2)
    assert wire == need, (wire, need)


def test_prefix_hit_reads_only_the_missing_blocks(made):
    p = HInstance("kv_producer", tp=2, tag="p")
    d = HInstance("kv_consumer", tp=4, tag="d")
    made += [p, d]
    (rid, prompt), = prompts(1, seed=41, lo=80, hi=81)
    # The decode computes the first 48 tokens itself (three full blocks it caches)...
    d.add("warm", prompt[:48] + [5], 1, None)
    d.run_until(lambda: "warm" in d.final, 10, "the local prefill")
    # ...then a remote prefill of the whole prompt: only blocks 3 and 4 are read.
    params = _prefill(p, [(rid, prompt)])[rid]
    d.stats.clear()
    wire0 = _wire(d)
    d.add(rid, prompt, 2, params)
    d.run_until(lambda: rid in d.finished_recving, 20, "the pull")
    assert not d.failed_recving
    nbytes, nblocks = _pulled(d)
    assert nblocks == d.tp * 2, nblocks
    # Bytes the decode needs: 2 blocks x (2 layers x K,V) x its heads' slice, per rank.
    assert nbytes == d.tp * 2 * 4 * (16 * d.hpr * HEAD_BYTES) == _needed(p, d, len(prompt), 48), nbytes
    assert _wire(d) - wire0 == nbytes  # only the missing blocks' head slices crossed the wire
    for rank in range(d.tp):
        for pos in range(48, len(prompt)):
            assert d.landed[rid][rank][pos] == d.expected(prompt, rank, pos), (rank, pos)
    d.run_until(lambda: rid in d.final, 10, "the decode")
    p.run_until(lambda: rid not in p.held(), 10, "the prefill to free the request")
    assert p.free_blocks() == p.free_at_start


def test_incompatible_pair_is_refused_naming_the_difference(made):
    p = HInstance("kv_producer", tp=1, model=HEAD32, kv_heads=2, head_size=32, tag="p")
    d = HInstance("kv_consumer", tp=2, model=KV2, kv_heads=2, tag="d")
    made += [p, d]
    reqs = prompts(2, seed=43, lo=30, hi=50)
    params = _prefill(p, reqs)
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


def test_abort_mid_pull_tp2_to_tp4_frees_every_rank(made):
    p = HInstance("kv_producer", tp=2, tag="p")
    d = HInstance("kv_consumer", tp=4, tag="d", extra={"timeout": 10.0})
    made += [p, d]
    reqs = prompts(3, seed=45, lo=60, hi=90)
    params = _prefill(p, reqs)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.step()  # the pulls start on every rank
    for rid, _ in reqs:
        d.abort(rid)
    d.run_until(lambda: not (d.held() & {r for r, _ in reqs}), 10, "the decode to free the aborted requests")
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 10, "the prefill to free them (every slot released)")
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start
    for c in d.ranks:
        assert c.connector_worker.engine.stats()["consumer"]["draining"] == 0


def test_prefill_death_mid_pull_tp2_to_tp4_is_a_load_error_on_every_rank(made):
    """Both prefill ranks go away (their engines closed, sockets torn down) while four
    decode ranks are mid-pull (sends delayed): every decode rank reports the request
    failed within its bound, the failed blocks are reported to vLLM, and the blocks
    come back to the decode's pool once vLLM has finished the request (recomputed or
    failed, per ``kv_load_failure_policy``)."""
    p = HInstance("kv_producer", tp=2, tag="p")
    d = HInstance("kv_consumer", tp=4, tag="d", extra={"timeout": 8.0, "io_timeout": 2.0})
    made += [p, d]
    reqs = prompts(2, seed=47, lo=60, hi=90)
    params = _prefill(p, reqs)
    for c in p.ranks:
        c.connector_worker.engine._e._inject_faults(send_delay_us=400_000, corrupt_next_sends=None)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.step()
    time.sleep(0.2)  # the gets are in flight on every rank
    t0 = time.monotonic()
    for c in p.ranks:
        c.shutdown()
    made.remove(p)
    d.run_until(lambda: all(r in d.failed_recving for r, _ in reqs), 15, "the load errors")
    assert time.monotonic() - t0 < 12.0  # within timeout plus a small bound
    assert d.invalid, "the failed blocks are reported to vLLM"
    d.run_until(lambda: not (d.held() & {r for r, _ in reqs}), 15, "vLLM to finish the requests")
    assert d.free_blocks() == d.free_at_start
    for c in d.ranks:
        assert c.connector_worker.engine.stats()["consumer"]["draining"] == 0
