"""KvferryConnector with tensor parallelism (TP=2) under vLLM 0.33.0's real scheduler.

Each instance is one real ``Scheduler`` (``tensor_parallel_size=2``) and two
worker-side connectors — ranks 0 and 1, each with its own KV shard (one KV head of
two), its own kvferry engine and address — driven by the scheduler's metadata the way
vLLM's executor drives its workers; their outputs are combined by vLLM's own
``KVOutputAggregator`` (a request is finished only once every rank reports it). Each
rank's "forward" writes bytes of its own (salted by rank), so a rank that pulled from
the wrong prefill rank cannot pass. Both instances run in the test process (separate
engines, real loopback sockets).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from test_connector import BLOCK_SIZE, LAYERS, MODEL_DIR, SLOT_BYTES, need_vllm, prompts  # noqa: F401

TP = 2
HEADS_PER_RANK = 1  # the tiny model's 2 KV heads, split over 2 ranks
RANK_SLOT = SLOT_BYTES // 2  # one head of the two


def _pattern(token: int, pos: int, layer: int, kv: int, salt: int, rank: int):
    import torch

    base = (token * 7 + pos * 13 + layer * 29 + kv * 101 + salt * 53 + rank * 71) % 256
    return (torch.arange(RANK_SLOT, dtype=torch.int32) * 5 + base).remainder(256).to(torch.uint8)


class TPInstance:
    """A real scheduler plus one worker-side connector per TP rank."""

    def __init__(self, role: str, extra: dict[str, Any], salt: int, num_blocks: int = 256) -> None:
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

        def config(rank: int) -> VllmConfig:
            cfg = VllmConfig(
                model_config=ModelConfig(model=MODEL_DIR, skip_tokenizer_init=True, dtype="float16", max_model_len=1024, seed=0),
                cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
                scheduler_config=SchedulerConfig(
                    max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=1024, is_encoder_decoder=False
                ),
                parallel_config=ParallelConfig(tensor_parallel_size=TP),
                device_config=DeviceConfig("cpu"),
                kv_transfer_config=KVTransferConfig(
                    kv_connector="KvferryConnector",
                    kv_connector_module_path="kvferry.integrations.vllm",
                    kv_role=role,
                    kv_connector_extra_config=extra,
                    engine_id=f"tp-{role}-{salt}",
                ),
            )
            cfg.parallel_config.rank = rank  # as vLLM sets it in each worker process
            return cfg

        self.vllm_config = config(0)
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS_PER_RANK, head_size=16, dtype=torch.float16)
        page = 2 * BLOCK_SIZE * RANK_SLOT
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=0, block_stride=page) for n in LAYERS],
            kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=False,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.ranks = []
        self.kv = []
        for r in range(TP):
            c = KVConnectorFactory.create_connector(config(r), KVConnectorRole.WORKER, self.kv_cache_config)
            kv = {n: torch.zeros((2, num_blocks, BLOCK_SIZE, HEADS_PER_RANK, 16), dtype=torch.float16) for n in LAYERS}
            c.register_kv_caches(kv)
            assert c.connector_worker.tp_rank == r
            self.ranks.append(c)
            self.kv.append(kv)
        hs = {(0, r): c.get_handshake_metadata() for r, c in enumerate(self.ranks)}
        self.scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware(hs)
        self.aggregator = KVOutputAggregator(expected_finished_count=TP)
        self.salt = salt
        self.free_at_start = self.free_blocks()
        self.final: dict[str, Any] = {}
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.landed: dict[str, list[list[bytes]]] = {}
        self.stats: list[dict[str, Any]] = []  # per step: the aggregated connector stats

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

    def step(self) -> None:
        import torch
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        so = self.scheduler.schedule()
        req_ids = list(so.num_scheduled_tokens)
        outs = []
        for rank, conn in enumerate(self.ranks):
            kv_transfer_state._KV_CONNECTOR_AGENT = conn  # this "process"'s worker
            sampled: list[list[int]] = []
            with (
                set_forward_context(None, self.vllm_config),
                KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kvo,
            ):
                for rid in req_ids:
                    req = self.scheduler.requests[rid]
                    n = so.num_scheduled_tokens[rid]
                    end = req.num_computed_tokens
                    (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
                    toks = req.all_token_ids
                    for pos in range(end - n, end):
                        b, off = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                        for li, name in enumerate(LAYERS):
                            raw = self.kv[rank][name].view(torch.uint8)
                            for kvi in (0, 1):
                                raw[kvi, b, off].view(-1)[:] = _pattern(toks[pos], pos, li, kvi, self.salt, rank)
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
        if kvo.kv_connector_stats is not None:  # both ranks' stats, combined by vLLM
            self.stats.append(kvo.kv_connector_stats.to_dict())
        self.finished_sending |= kvo.finished_sending or set()
        self.finished_recving |= kvo.finished_recving or set()
        self.failed_recving |= kvo.failed_recving or set()
        for outs_ in self.scheduler.update_from_output(so, mro).values():
            for o in outs_.outputs:
                if o.finish_reason is not None:
                    self.final[o.request_id] = o
        for rid in kvo.finished_recving or ():
            req = self.scheduler.requests.get(rid)
            if req is not None and not req.is_finished() and rid not in (kvo.failed_recving or ()):
                (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
                self.landed[rid] = [
                    [self.slot(rank, blocks, pos) for rank in range(TP)] for pos in range(req.num_prompt_tokens)
                ]

    def slot(self, rank: int, blocks: list[int], pos: int) -> bytes:
        import torch

        b, off = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
        return b"".join(bytes(self.kv[rank][n].view(torch.uint8)[kvi, b, off].reshape(-1).numpy()) for n in LAYERS for kvi in (0, 1))

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


def expected(prompt: list[int], pos: int, salt: int, rank: int) -> bytes:
    return b"".join(bytes(_pattern(prompt[pos], pos, li, kvi, salt, rank).numpy()) for li in range(len(LAYERS)) for kvi in (0, 1))


@pytest.fixture
def pair(need_vllm):  # noqa: F811 - the fixture imported above
    made: list[TPInstance] = []
    p = TPInstance("kv_producer", {"lease_ttl": 30.0, "timeout": 10.0}, salt=1)
    made.append(p)
    d = TPInstance("kv_consumer", {"timeout": 10.0}, salt=2)
    made.append(d)
    yield p, d
    for i in made:
        i.close()


def _prefill(p: TPInstance, reqs: list[tuple[str, list[int]]]) -> dict[str, dict[str, Any]]:
    for rid, prompt in reqs:
        p.add(rid, prompt, 1, {"do_remote_decode": True})
    p.run_until(lambda: all(r in p.final for r, _ in reqs), 30, "the prefills")
    p.step()  # the step after: the workers publish
    return {r: p.final[r].kv_transfer_params for r, _ in reqs}


def test_tp2_each_rank_pulls_its_own_shard(pair):
    p, d = pair
    reqs = prompts(6, seed=21, lo=20, hi=90)
    params = _prefill(p, reqs)
    for rid, _ in reqs:
        peers = params[rid]["kvferry_peers"]
        assert params[rid]["tp_size"] == TP and len(peers) == TP
        assert peers[0]["address"] != peers[1]["address"], "one engine per rank"
        assert [x["address"] for x in peers] == [c.connector_worker.engine.address for c in p.ranks]
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 15, "the pulls on both ranks")
    assert not d.failed_recving
    for rid, prompt in reqs:
        for pos in range(len(prompt)):
            for rank in range(TP):
                assert d.landed[rid][pos][rank] == expected(prompt, pos, salt=1, rank=rank), (rid, pos, rank)
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
    # Every rank's Done arrived: each prefill rank reports finished sending, and only
    # then (the aggregator waits for both) the scheduler frees the blocks.
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 5, "prefill to free the blocks")
    assert {r for r, _ in reqs} <= p.finished_sending
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start
    for c in p.ranks + d.ranks:
        assert c.connector_worker.engine.stats()["consumer"]["draining"] == 0


def test_tp2_abort_releases_every_rank(pair):
    p, d = pair
    reqs = prompts(2, seed=22, lo=40, hi=60)
    params = _prefill(p, reqs)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    for rid, _ in reqs:
        d.abort(rid)  # before any pull: each decode rank releases on its prefill rank
    t0 = time.monotonic()
    d.step()  # the next step's metadata carries the releases to both decode ranks
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 5, "prefill to free the aborted requests")
    assert time.monotonic() - t0 < 5.0  # far below the 30 s lease
    d.run_until(lambda: not any(c.connector_worker._releases for c in d.ranks), 5, "the releases")
    assert not d.finished_recving and p.free_blocks() == p.free_at_start


def test_tp2_connector_metrics_through_vllms_stats_classes(pair):
    """Both ranks' connector stats, combined by vLLM's ``KVOutputAggregator`` every
    step, logged by ``KVConnectorLogging`` and recorded by ``KVConnectorProm`` (both
    resolve the connector class from the config, as vLLM's front end does)."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    p, d = pair
    d.stats.clear()
    p.stats.clear()
    reqs = prompts(4, seed=23, lo=40, hi=80)
    params = _prefill(p, reqs)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 15, "the pulls")
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 5, "prefill to free the blocks")
    # What moved: every request's blocks, once per rank, each rank's shard of a block.
    nblocks = sum(len(params[r]["remote_block_ids"]) for r, _ in reqs)
    block_bytes = d.ranks[0].connector_worker.region.block_bytes
    got = d.ranks[0].build_kv_connector_stats()
    for data in d.stats:
        got = got.aggregate(type(got)(data=data))
    assert len(got.data["pull_seconds"]) == TP * len(reqs)
    assert sum(got.data["pull_blocks"]) == TP * nblocks
    assert sum(got.data["pull_bytes"]) == TP * nblocks * block_bytes
    assert not any(got.data["failed"].values())
    sent = d.ranks[0].build_kv_connector_stats()
    for data in p.stats:
        sent = sent.aggregate(type(sent)(data=data))
    assert sent.data["published_released"]["done"] == TP * len(reqs)

    logging_ = KVConnectorLogging(d.vllm_config.kv_transfer_config)
    for data in d.stats:
        logging_.observe(data)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    assert len(lines) == 1 and f"pulls={TP * len(reqs)}" in lines[0] and f"blocks={TP * nblocks}" in lines[0], lines

    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    prom = Prom(d.vllm_config, labelnames=["model_name", "engine"], per_engine_labelvalues={0: ["tiny", "0"]})
    for data in d.stats:
        prom.observe(data, engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:kvferry_bytes_total", labels) == TP * nblocks * block_bytes
    assert registry.get_sample_value("vllm:kvferry_blocks_total", labels) == TP * nblocks
    assert registry.get_sample_value("vllm:kvferry_pull_seconds_count", labels) == TP * len(reqs)
    assert registry.get_sample_value("vllm:kvferry_failed_pulls_total", {**labels, "kind": "miss"}) == 0
